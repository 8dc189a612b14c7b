"""Base of the services that run the model: engine thread, KV events, cache dumps, load."""

import asyncio
import time
from functools import partial

import nats

from shared import subjects
from shared.config import EngineConfig
from shared.engine.backend import BackendOptions, EngineBackend, create_backend
from shared.engine_worker import EngineWorker
from shared.kv_event_stream import STREAM_NAME as KV_EVENT_STREAM
from shared.kv_event_stream import wait_for_stream
from shared.messages import KvBlocksEvicted, KvBlocksStored, LoadReported, encode
from shared.metrics import ACTIVE_SEQUENCES, KV_BLOCKS_USED, KV_CACHE_USAGE
from shared.service import Service


class EngineService(Service):
    """A service with an engine; prefill and main decode publish their cached blocks."""

    publishes_kv_events = True
    holds_requests = True

    def __init__(self, config: EngineConfig, loaded=None):
        super().__init__(config)
        self.config: EngineConfig = config
        self._loaded = loaded
        self.worker: EngineWorker | None = None
        self._kv_events: asyncio.Queue | None = None
        self._kv_seq = 0

    @property
    def engine(self) -> EngineBackend:
        """The engine backend (call it only through ``self.worker``, but for ``load``)."""
        return self.worker.engine

    async def start(self):
        loop = asyncio.get_running_loop()
        self._kv_events = asyncio.Queue()

        def on_kv_event(kind: str, block_hashes: list[int]):
            # Called on the engine thread; hop to the loop.
            loop.call_soon_threadsafe(self._kv_events.put_nowait, (kind, block_hashes))

        config = self.config
        options = BackendOptions(
            model=config.model,
            device=config.device,
            dtype=config.dtype,
            kv_cache_bytes=config.kv_cache_mb << 20,
            block_size=config.block_size,
            max_batch_tokens=config.max_batch_tokens,
            first_chunk_tokens=config.first_chunk_tokens,
            enable_prefix_cache=config.prefix_cache,
            standin_step_s=config.standin_step_ms / 1000,
            kv_listener=on_kv_event if self.publishes_kv_events else None,
        )
        self.worker = await EngineWorker.build(
            partial(create_backend, config.engine, options, self._loaded),
            self.instance_id,
            config.torch_threads,
            config.engine_call_log,
        )
        await super().start()
        await self.nc.subscribe(
            subjects.instance_work(self.config.site, self.service_name, self.instance_id, subjects.DUMP),
            cb=self._on_dump,
        )
        if self.publishes_kv_events:
            await wait_for_stream(self.nc.jetstream(), KV_EVENT_STREAM)
            self._tasks.append(asyncio.create_task(self._publish_kv_events(), name="kv-events"))
            self.watch(self._tasks[-1])

    async def stop(self):
        """Stop as ``Service.stop`` does, then the engine thread, even when that stop fails."""
        try:
            await super().stop()
        finally:
            if self.worker:
                self.worker.shutdown()

    async def held_request_ids(self) -> list[str]:
        return await self.worker.call(self.engine.request_ids)

    def load_report(self) -> LoadReported:
        load = self.engine.load()
        ACTIVE_SEQUENCES.labels(self.service_name, self.instance_id).set(load.num_sequences)
        KV_BLOCKS_USED.labels(self.service_name, self.instance_id).set(load.num_used_blocks)
        KV_CACHE_USAGE.labels(self.service_name, self.instance_id).set(load.num_used_blocks / max(1, load.num_blocks))
        return LoadReported(
            instance=self.instance_ref(),
            service=self.service_name,
            active_sequences=load.num_sequences,
            max_sequences=self.config.max_sequences,
            used_blocks=load.num_used_blocks,
            total_blocks=load.num_blocks,
            free_blocks=load.num_free_blocks,
            pending_tokens=load.num_pending_tokens,
            unix_s=time.time(),
        )

    async def _publish_kv_events(self):
        subject = subjects.kv_events(self.config.site, self.instance_id)
        js = self.nc.jetstream()
        while True:
            burst = [await self._kv_events.get()]
            while not self._kv_events.empty():
                burst.append(self._kv_events.get_nowait())
            for kind, hashes in _merge_runs(burst):
                await self._publish_kv_event(js, subject, kind, hashes)

    async def _publish_kv_event(self, js, subject: str, kind: str, hashes: list[int]):
        self._kv_seq += 1
        cls = KvBlocksStored if kind == "stored" else KvBlocksEvicted
        event = cls(publisher_id=self.instance_id, epoch=self.incarnation, seq=self._kv_seq, block_hashes=hashes)
        msg_id = f"{self.instance_id}:{self.incarnation}:{self._kv_seq}"
        try:
            await js.publish(subject, encode(event), headers={"Nats-Msg-Id": msg_id})
        except (TimeoutError, nats.errors.Error) as exc:
            # The cache-index sees the gap and asks for a dump.
            self.log.warning("kv_event_not_stored", seq=self._kv_seq, error=str(exc) or type(exc).__name__)

    async def _on_dump(self, msg):
        hashes = await self.worker.call(self.engine.cached_block_hashes)
        await msg.respond(
            encode(
                KvBlocksStored(
                    publisher_id=self.instance_id, epoch=self.incarnation, seq=self._kv_seq, block_hashes=hashes
                )
            )
        )


def _merge_runs(events: list[tuple[str, list[int]]]) -> list[tuple[str, list[int]]]:
    """Consecutive events of the same kind as one (order between kinds is kept)."""
    merged: list[tuple[str, list[int]]] = []
    for kind, hashes in events:
        if merged and merged[-1][0] == kind:
            merged[-1] = (kind, merged[-1][1] + hashes)
        else:
            merged.append((kind, list(hashes)))
    return merged
