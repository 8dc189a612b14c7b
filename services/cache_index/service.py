"""Cache-index (site A): which leading prompt blocks each prefill and main-decode instance holds.

It follows every instance's stored/evicted block events (sequenced per instance). An
instance it has not seen, or whose events show a gap, is asked for a full dump of its
prefix cache; events older than the dump are ignored. Overlap queries are answered by
request/reply: for each instance, how many leading blocks of the prompt it holds.
"""

import asyncio
import time
from dataclasses import dataclass, field

import nats

from shared import subjects
from shared.config import CacheIndexConfig
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
        service: Its service.
        block_hashes: Cached block hashes.
        seq: Sequence number of the last event applied (-1: never synced).
        last_seen: Monotonic time of its last heartbeat or event.
        syncing: A dump request is in flight.
        pending: Events that arrived while syncing, applied after the dump if newer.
    """

    site: str
    service: str
    block_hashes: set[int] = field(default_factory=set)
    seq: int = -1
    last_seen: float = field(default_factory=time.monotonic)
    syncing: bool = False
    pending: list = field(default_factory=list)

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

    def __init__(self, config: CacheIndexConfig, instance_ttl_s: float = 10.0):
        super().__init__(config)
        self.instances: dict[str, InstanceIndex] = {}
        self.events_applied = 0
        self.gaps = 0
        self._instance_ttl_s = instance_ttl_s

    async def on_start(self):
        await self.nc.subscribe(subjects.LOAD_ALL, cb=self._on_load)
        await self.nc.subscribe(subjects.KV_EVENTS_ALL, cb=self._on_kv_event)
        await self.nc.subscribe(subjects.shared_work(self.config.site, self.service_name, subjects.OVERLAP),
                                queue=f"{self.service_name}-{self.config.site}", cb=self._on_query)

    async def _on_load(self, msg):
        report = _load_decoder.decode(msg.data)
        if report.service not in ENGINE_SERVICES:
            return
        index = self.instances.get(report.instance.instance_id)
        if index is None:
            index = self.instances[report.instance.instance_id] = InstanceIndex(
                report.instance.site, report.service)
        index.last_seen = time.monotonic()
        if index.seq < 0 and not index.syncing:
            self._request_dump(report.instance.instance_id, index)
        self._expire()

    async def _on_kv_event(self, msg):
        event = _kv_decoder.decode(msg.data)
        index = self.instances.get(event.publisher_id)
        if index is None:
            return  # unknown until its first heartbeat; the dump then covers this event
        if index.syncing:
            index.pending.append(event)
            return
        if index.seq >= 0 and event.seq > index.seq + 1:
            self.gaps += 1
            CACHE_INDEX_EVENTS.labels("gap").inc()
            self.log.warning("kv_event_gap", instance=event.publisher_id, expected=index.seq + 1, got=event.seq)
            self._request_dump(event.publisher_id, index)
            return
        if event.seq <= index.seq:
            CACHE_INDEX_EVENTS.labels("duplicate").inc()
            return  # duplicate or older than the dump
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
            dump = _dump_decoder.decode(reply.data)
            index.block_hashes = set(dump.block_hashes)
            index.seq = dump.seq
            for event in sorted(index.pending, key=lambda e: e.seq):
                if event.seq > index.seq:
                    self._apply(index, event)
            self.log.info("instance_synced", instance=instance_id, blocks=len(index.block_hashes), seq=dump.seq)
        except (nats.errors.Error, asyncio.TimeoutError) as exc:
            self.log.warning("instance_dump_failed", instance=instance_id, error=str(exc) or type(exc).__name__)
        finally:
            index.pending.clear()
            index.syncing = False

    def _expire(self):
        cutoff = time.monotonic() - self._instance_ttl_s
        for instance_id in [i for i, idx in self.instances.items() if idx.last_seen < cutoff]:
            del self.instances[instance_id]
            self.log.info("instance_expired", instance=instance_id)

    async def _on_query(self, msg):
        query = _query_decoder.decode(msg.data)
        wanted = query.instance_ids or list(self.instances)
        hits = {i: self.instances[i].leading_hits(query.block_hashes)
                for i in wanted if i in self.instances}
        await msg.respond(encode(OverlapReply(hit_blocks=hits)))
