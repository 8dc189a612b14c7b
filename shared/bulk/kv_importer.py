"""The receiving side of KV flows for an engine service (relay decode, main decode)."""

from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import structlog

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
        discard_when_done: The request ended elsewhere: keep the KV for the cache, then free.
    """

    flow_open: FlowOpen
    cached_tokens: int
    stats: FlowStats
    discard_when_done: bool = False


ImportCompleted = Callable[[ImportState, Sequence, FlowStats], Awaitable[None]]
ImportOpened = Callable[[FlowOpen], Awaitable[None]]


class KvImporter:
    """FlowHandler that imports frames into an engine and reports completed imports."""

    def __init__(self, worker: EngineWorker, on_complete: ImportCompleted,
                 on_open: ImportOpened | None = None):
        self._worker = worker
        self._on_complete = on_complete
        self._on_open = on_open
        self.imports: dict[str, ImportState] = {}

    async def open_flow(self, flow_open: FlowOpen, stats: FlowStats) -> int:
        if flow_open.request_id in self.imports:
            raise InvalidRequestState(f"a flow for {flow_open.request_id!r} is already open")
        engine = self._worker.engine
        first = await self._worker.call(engine.begin_import, flow_open.request_id,
                                        flow_open.token_ids, flow_open.sampling, flow_open.seed)
        self.imports[flow_open.request_id] = ImportState(flow_open, cached_tokens=first, stats=stats)
        service = flow_open.role
        PREFIX_HIT_BLOCKS.labels(service).inc(first // engine.layout.block_size)
        PREFIX_LOOKUP_BLOCKS.labels(service).inc(len(flow_open.token_ids) // engine.layout.block_size)
        if self._on_open:
            await self._on_open(flow_open)
        log.info("kv_import_opened", request_id=flow_open.request_id, cached_tokens=first,
                 prompt_tokens=len(flow_open.token_ids), role=flow_open.role)
        return first

    async def import_frame(self, request_id: str, frame: KvFrame) -> None:
        await self._worker.call(self._worker.engine.import_frame, frame)

    async def end_flow(self, request_id: str, output_token_ids: list[int], stats: FlowStats) -> None:
        state = self.imports.pop(request_id, None)
        if state is None:
            return
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
        await self._worker.call(self._free_if_live, request_id)
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
        await self._worker.call(self._free_if_live, request_id)
        return state

    def _free_if_live(self, request_id: str):
        if self._worker.engine.holds(request_id):
            self._worker.engine.free(request_id)
