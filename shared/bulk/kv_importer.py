"""The receiving side of KV flows for an engine service (relay decode, main decode)."""

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import structlog

from shared.block_hash import hash_blocks
from shared.bulk.receiver import FlowStats
from shared.engine.sequence import Sequence
from shared.engine_worker import EngineWorker
from shared.errors import InvalidRequestState
from shared.kv_wire import KvFrame
from shared.messages import FlowOpen
from shared.metrics import PREFIX_HIT_BLOCKS, PREFIX_LOOKUP_BLOCKS

log = structlog.get_logger(__name__)


@dataclass
class ImportState:
    """A flow being imported.

    Attributes:
        flow_open: The sender's FlowOpen.
        cached_tokens: Prompt tokens the receiver's prefix cache supplied.
        stats: The flow's live byte and frame counts.
        block_hashes: Chained hashes of the prompt's full blocks.
        done: Set when the import ends, whichever way.
        discard_when_done: The request ended elsewhere: keep the KV for the cache, then free.
    """

    flow_open: FlowOpen
    cached_tokens: int
    stats: FlowStats
    block_hashes: list[int] = field(default_factory=list)
    done: asyncio.Event = field(default_factory=asyncio.Event)
    discard_when_done: bool = False


ImportCompleted = Callable[[ImportState, Sequence, FlowStats], Awaitable[None]]
ImportOpened = Callable[[FlowOpen], Awaitable[None]]


class KvImporter:
    """FlowHandler that imports frames into an engine and reports completed imports."""

    def __init__(self, worker: EngineWorker, on_complete: ImportCompleted,
                 on_open: ImportOpened | None = None, in_flight_wait_s: float = 120.0):
        self._worker = worker
        self._in_flight_wait_s = in_flight_wait_s
        self._on_complete = on_complete
        self._on_open = on_open
        self.imports: dict[str, ImportState] = {}

    async def open_flow(self, flow_open: FlowOpen, stats: FlowStats) -> int:
        if flow_open.request_id in self.imports:
            raise InvalidRequestState(f"a flow for {flow_open.request_id!r} is already open")
        engine = self._worker.engine
        hashes = hash_blocks(flow_open.token_ids, engine.layout.block_size)
        await self._wait_for_blocks_in_flight(flow_open.request_id, hashes)
        first = await self._worker.call(engine.begin_import, flow_open.request_id,
                                        flow_open.token_ids, flow_open.sampling, flow_open.seed)
        self.imports[flow_open.request_id] = ImportState(flow_open, cached_tokens=first, stats=stats,
                                                         block_hashes=hashes)
        service = flow_open.role
        PREFIX_HIT_BLOCKS.labels(service).inc(first // engine.layout.block_size)
        PREFIX_LOOKUP_BLOCKS.labels(service).inc(len(flow_open.token_ids) // engine.layout.block_size)
        if self._on_open:
            await self._on_open(flow_open)
        log.info("kv_import_opened", request_id=flow_open.request_id, cached_tokens=first,
                 prompt_tokens=len(flow_open.token_ids), role=flow_open.role)
        return first

    async def _wait_for_blocks_in_flight(self, request_id: str, hashes: list[int]):
        """Let an earlier import that is bringing this prompt's blocks finish first.

        A follow-up turn often arrives while the previous turn's KV is still crossing the
        WAN: asking for those blocks again would send them twice over the same link. Once
        the earlier import is done they are in the prefix cache and only the rest is asked for.
        """
        engine = self._worker.engine
        deadline = asyncio.get_running_loop().time() + self._in_flight_wait_s
        while True:
            cached = await self._worker.call(engine.prefix_cache.peek, hashes)
            earlier = [s for s in self.imports.values() if _common_prefix(s.block_hashes, hashes) > cached]
            remaining = deadline - asyncio.get_running_loop().time()
            if not earlier or remaining <= 0:
                return
            log.info("kv_import_waits_for_blocks_in_flight", request_id=request_id,
                     behind=earlier[0].flow_open.request_id, cached_blocks=cached)
            try:
                await asyncio.wait_for(earlier[0].done.wait(), remaining)
            except asyncio.TimeoutError:
                return

    async def import_frame(self, request_id: str, frame: KvFrame) -> None:
        await self._worker.call(self._worker.engine.import_frame, frame)

    async def end_flow(self, request_id: str, output_token_ids: list[int], stats: FlowStats) -> None:
        state = self.imports.pop(request_id, None)
        if state is None:
            return
        state.done.set()
        engine = self._worker.engine
        if state.discard_when_done:
            await self._worker.call(engine.free, request_id)
            log.info("kv_import_kept_for_cache", request_id=request_id)
            return
        seq = await self._worker.call(engine.finish_import, request_id, output_token_ids)
        log.info("kv_import_done", request_id=request_id, frames=stats.frames,
                 kv_bytes=stats.bytes_received, transfer_s=round(stats.transfer_s, 4))
        await self._on_complete(state, seq, stats)

    async def abort_flow(self, request_id: str, reason: str) -> None:
        state = self.imports.pop(request_id, None)
        if state is None:
            return
        state.done.set()
        await self._worker.call(self._worker.engine.free_if_held, request_id)
        log.warning("kv_import_aborted", request_id=request_id, reason=reason)

    async def cancel(self, request_id: str, finished_elsewhere: bool) -> ImportState | None:
        """Cancel an import in progress; return its state if there was one.

        A request that finished elsewhere keeps importing (its blocks keep this instance's
        cache aligned with the prefill's); any other cancel drops the KV now (complete
        blocks already cached stay valid), and the sender's next frame is refused.
        """
        state = self.imports.get(request_id)
        if state is None:
            return None
        if finished_elsewhere:
            state.discard_when_done = True
            return state
        del self.imports[request_id]
        state.done.set()
        await self._worker.call(self._worker.engine.free_if_held, request_id)
        return state


def _common_prefix(a: list[int], b: list[int]) -> int:
    count = 0
    for x, y in zip(a, b):
        if x != y:
            break
        count += 1
    return count
