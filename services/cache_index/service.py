"""Cache-index (site A): which leading prompt blocks each prefill and main-decode instance holds.

It replays every site's KV event stream (JetStream, one per site and domain; the remote one
through the leafnode) from the start and follows it live. Events are sequenced per
publisher and epoch (a restarted publisher starts a new epoch): an instance whose history
the stream does not fully cover, or whose events show a gap, is asked for a full dump of its
prefix cache, and only events newer than the dump are applied on top. Overlap queries are
answered by request/reply: for each instance, how many leading blocks of the prompt it holds.

Only the incarnation an instance's own heartbeat names (``InstanceRef.incarnation``) counts:
the streams outlive processes (and deployments, when a run folder is reused), so a replay
may bring the events of an earlier instance of the same name. Its blocks are gone; they are
ignored, and the instance is credited only with what it announces itself.
"""

import asyncio
import time

import nats

from services.cache_index.sync_state import EventVerdict, PublisherSync
from shared import subjects
from shared.block_hash import HASH_SCHEME_VERSION
from shared.config import CacheIndexConfig
from shared.kv_event_stream import replay
from shared.messages import (
    KvBlocksStored,
    KvEvent,
    LoadReported,
    OverlapQuery,
    OverlapReply,
    decoder,
    encode,
)
from shared.metrics import CACHE_INDEX_EVENTS, REFUSED_MESSAGES
from shared.service import Service

_kv_decoder = decoder(KvEvent)
_load_decoder = decoder(LoadReported)
_query_decoder = decoder(OverlapQuery)
_dump_decoder = decoder(KvBlocksStored)
ENGINE_SERVICES = ("prefill", "main_decode")


class CacheIndexService(Service):
    """The cache-index actor."""

    service_name = "cache_index"

    def __init__(self, config: CacheIndexConfig):
        super().__init__(config)
        self.config: CacheIndexConfig = config
        self.instances: dict[str, PublisherSync] = {}
        self.events_applied = 0
        self.gaps = 0

    async def on_start(self):
        await self.subscribe(subjects.LOAD_ALL, _load_decoder, self._on_load)
        for site in filter(None, (s.strip() for s in self.config.kv_event_sites.split(","))):
            await replay(self.nc, site, self._on_kv_msg)
        await self.subscribe(
            subjects.shared_work(self.config.site, self.service_name, subjects.OVERLAP),
            _query_decoder,
            self._on_query,
            queue=f"{self.service_name}-{self.config.site}",
        )

    def _index(self, instance_id: str, site: str) -> PublisherSync:
        index = self.instances.get(instance_id)
        if index is None:
            index = self.instances[instance_id] = PublisherSync(site, last_seen=time.monotonic())
        return index

    async def _on_load(self, report: LoadReported, msg):
        if report.service not in ENGINE_SERVICES:
            return
        instance_id, epoch = report.instance.instance_id, report.instance.incarnation
        index = self._index(instance_id, report.instance.site)
        if index.epoch and index.epoch != epoch and not index.syncing:
            self.log.info("instance_restarted", instance=instance_id, old_epoch=index.epoch, epoch=epoch)
        if index.heartbeat(report.service, epoch, time.monotonic()):
            self._request_dump(instance_id, index)
        self._expire()

    async def _on_kv_msg(self, msg):
        event = self.bad_messages.decode(_kv_decoder, msg, subjects.KV_EVENTS_ALL)
        if event is not None:
            self._on_kv_event(event, subjects.site_of_kv_events(msg.subject))

    def _on_kv_event(self, event: KvEvent, site: str):
        index = self._index(event.publisher_id, site)
        expected = index.seq + 1
        verdict, needs_dump = index.event(event, time.monotonic())
        if verdict is EventVerdict.APPLIED:
            self.events_applied += 1
        elif verdict is EventVerdict.GAP:
            self.gaps += 1
            self.log.warning("kv_event_gap", instance=event.publisher_id, expected=expected, got=event.seq)
        if verdict is not EventVerdict.HELD:
            CACHE_INDEX_EVENTS.labels(verdict.value).inc()
        if needs_dump:
            self._request_dump(event.publisher_id, index)

    def _request_dump(self, instance_id: str, index: PublisherSync):
        asyncio.create_task(self._dump(instance_id, index))

    async def _dump(self, instance_id: str, index: PublisherSync):
        subject = subjects.instance_work(index.site, index.service, instance_id, subjects.DUMP)
        try:
            reply = await self.nc.request(subject, b"", timeout=5.0)
            dump = self.bad_messages.decode(_dump_decoder, reply, "reply:dump")
            if dump is None:
                raise nats.errors.Error("the dump reply did not decode")
        except (TimeoutError, nats.errors.Error) as exc:
            index.dump_failed()
            self.log.warning("instance_dump_failed", instance=instance_id, error=str(exc) or type(exc).__name__)
            return
        applied = index.dump_received(dump, time.monotonic())
        self.events_applied += applied
        CACHE_INDEX_EVENTS.labels("applied").inc(applied)
        self.log.info("instance_synced", instance=instance_id, blocks=len(index.block_hashes), seq=dump.seq)

    def _expire(self):
        cutoff = time.monotonic() - self.config.instance_ttl_s
        for instance_id in [i for i, idx in self.instances.items() if idx.last_seen < cutoff]:
            del self.instances[instance_id]
            self.log.info("instance_expired", instance=instance_id)

    async def _on_query(self, query: OverlapQuery, msg):
        if query.hash_scheme != HASH_SCHEME_VERSION:
            # Hashes of another scheme name other blocks: no hits beats wrong hits.
            REFUSED_MESSAGES.labels(self.service_name, "hash_scheme").inc()
            self.log.warning("overlap_query_refused", hash_scheme=query.hash_scheme, expected=HASH_SCHEME_VERSION)
            await msg.respond(encode(OverlapReply(hit_blocks={})))
            return
        hits = {
            instance_id: index.leading_hits(query.block_hashes)
            for instance_id, index in self.instances.items()
            if index.routable
        }
        await msg.respond(encode(OverlapReply(hit_blocks=hits)))
