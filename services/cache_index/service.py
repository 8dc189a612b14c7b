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
from dataclasses import dataclass, field

import nats

from shared import subjects
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
from shared.metrics import CACHE_INDEX_EVENTS
from shared.service import Service

_kv_decoder = decoder(KvEvent)
_load_decoder = decoder(LoadReported)
_query_decoder = decoder(OverlapQuery)
_dump_decoder = decoder(KvBlocksStored)
ENGINE_SERVICES = ("prefill", "main_decode")


@dataclass
class InstanceIndex:
    """What one instance holds, as far as its events tell.

    Attributes:
        site: The instance's site.
        service: Its service (known from its heartbeat; needed to ask for a dump).
        epoch: The publisher incarnation the state belongs to.
        live_epoch: The incarnation its latest heartbeat names ("" until one arrives).
        block_hashes: Cached block hashes.
        seq: Sequence number of the last event applied (-1: not in sync).
        last_seen: Monotonic time of its last heartbeat or event.
        syncing: A dump request is in flight.
        pending: Events held until a dump tells where they fit.
    """

    site: str
    service: str = ""
    epoch: str = ""
    live_epoch: str = ""
    block_hashes: set[int] = field(default_factory=set)
    seq: int = -1
    last_seen: float = field(default_factory=time.monotonic)
    syncing: bool = False
    pending: list = field(default_factory=list)

    def reset(self, epoch: str):
        """A new incarnation of the publisher: forget the old one's state."""
        self.epoch, self.block_hashes, self.seq, self.pending = epoch, set(), -1, []

    @property
    def routable(self) -> bool:
        """Whether the state is the running incarnation's (a heartbeat confirmed it)."""
        return bool(self.live_epoch) and self.epoch == self.live_epoch

    def leading_hits(self, block_hashes: list[int]) -> int:
        """How many leading blocks of ``block_hashes`` are held."""
        hits = 0
        for block_hash in block_hashes:
            if block_hash not in self.block_hashes:
                break
            hits += 1
        return hits


class CacheIndexService(Service):
    """The cache-index actor."""

    service_name = "cache_index"

    def __init__(self, config: CacheIndexConfig):
        super().__init__(config)
        self.config: CacheIndexConfig = config
        self.instances: dict[str, InstanceIndex] = {}
        self.events_applied = 0
        self.gaps = 0

    async def on_start(self):
        await self.subscribe(subjects.LOAD_ALL, _load_decoder, self._on_load)
        for site in filter(None, (s.strip() for s in self.config.kv_event_sites.split(","))):
            await replay(self.nc, site, self._on_kv_msg)
        await self.subscribe(subjects.shared_work(self.config.site, self.service_name, subjects.OVERLAP),
                             _query_decoder, self._on_query, queue=f"{self.service_name}-{self.config.site}")

    def _index(self, instance_id: str, site: str) -> InstanceIndex:
        index = self.instances.get(instance_id)
        if index is None:
            index = self.instances[instance_id] = InstanceIndex(site)
        return index

    async def _on_load(self, report: LoadReported, msg):
        if report.service not in ENGINE_SERVICES:
            return
        index = self._index(report.instance.instance_id, report.instance.site)
        index.service, index.last_seen = report.service, time.monotonic()
        epoch = report.instance.incarnation
        index.live_epoch = epoch
        if index.epoch != epoch and not index.syncing:
            if index.epoch:
                self.log.info("instance_restarted", instance=report.instance.instance_id,
                              old_epoch=index.epoch, epoch=epoch)
            index.reset(epoch)
        if index.seq < 0 and not index.syncing:
            self._request_dump(report.instance.instance_id, index)
        self._expire()

    async def _on_kv_msg(self, msg):
        event = self.bad_messages.decode(_kv_decoder, msg, subjects.KV_EVENTS_ALL)
        if event is not None:
            self._on_kv_event(event, msg.subject)

    def _on_kv_event(self, event, subject: str):
        index = self._index(event.publisher_id, subject.split(".")[2])
        if index.live_epoch and event.epoch != index.live_epoch:
            CACHE_INDEX_EVENTS.labels("other_incarnation").inc()
            return
        if event.epoch != index.epoch:
            index.reset(event.epoch)
        if index.syncing or (index.seq < 0 and event.seq != 1):
            # Where this event fits is unknown until a dump says how far the state goes.
            index.pending.append(event)
            if not index.syncing and index.service:
                self._request_dump(event.publisher_id, index)
            return
        if event.seq <= index.seq:
            CACHE_INDEX_EVENTS.labels("duplicate").inc()
            return
        if index.seq >= 0 and event.seq > index.seq + 1:
            self.gaps += 1
            CACHE_INDEX_EVENTS.labels("gap").inc()
            self.log.warning("kv_event_gap", instance=event.publisher_id, expected=index.seq + 1, got=event.seq)
            index.pending.append(event)
            self._request_dump(event.publisher_id, index)
            return
        self._apply(index, event)

    def _apply(self, index: InstanceIndex, event):
        if isinstance(event, KvBlocksStored):
            index.block_hashes.update(event.block_hashes)
        else:
            index.block_hashes.difference_update(event.block_hashes)
        index.seq = event.seq
        index.last_seen = time.monotonic()
        self.events_applied += 1
        CACHE_INDEX_EVENTS.labels("applied").inc()

    def _request_dump(self, instance_id: str, index: InstanceIndex):
        index.syncing = True
        asyncio.create_task(self._dump(instance_id, index))

    async def _dump(self, instance_id: str, index: InstanceIndex):
        subject = subjects.instance_work(index.site, index.service, instance_id, subjects.DUMP)
        try:
            reply = await self.nc.request(subject, b"", timeout=5.0)
            dump = self.bad_messages.decode(_dump_decoder, reply, "reply:dump")
            if dump is None:
                raise nats.errors.Error("the dump reply did not decode")
            index.epoch, index.block_hashes, index.seq = dump.epoch, set(dump.block_hashes), dump.seq
            for event in sorted(index.pending, key=lambda e: e.seq):
                if event.epoch == index.epoch and event.seq == index.seq + 1:
                    self._apply(index, event)
            self.log.info("instance_synced", instance=instance_id, blocks=len(index.block_hashes), seq=dump.seq)
        except (nats.errors.Error, asyncio.TimeoutError) as exc:
            self.log.warning("instance_dump_failed", instance=instance_id, error=str(exc) or type(exc).__name__)
        finally:
            index.pending.clear()
            index.syncing = False

    def _expire(self):
        cutoff = time.monotonic() - self.config.instance_ttl_s
        for instance_id in [i for i, idx in self.instances.items() if idx.last_seen < cutoff]:
            del self.instances[instance_id]
            self.log.info("instance_expired", instance=instance_id)

    async def _on_query(self, query: OverlapQuery, msg):
        wanted = query.instance_ids or list(self.instances)
        hits = {i: self.instances[i].leading_hits(query.block_hashes)
                for i in wanted if i in self.instances and self.instances[i].routable}
        await msg.respond(encode(OverlapReply(hit_blocks=hits)))
