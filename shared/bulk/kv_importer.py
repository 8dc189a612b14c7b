"""The receiving side of KV flows for an engine service (relay decode, main decode).

What it keeps and when a flow waits for blocks already in flight is the decode-side cache's
policy (``shared.decode_cache``); this module runs it against the engine and the flows.
"""

import asyncio
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import structlog

from shared.block_hash import hash_blocks
from shared.bulk.import_admission import ImportAdmission
from shared.bulk.receiver import FlowStats
from shared.decode_cache import InFlightBlocks, keeps_importing
from shared.engine.backend import RequestView
from shared.engine_worker import EngineWorker
from shared.errors import InvalidRequestState, RequestCancelled
from shared.kv_wire import KvFrame
from shared.messages import FlowEnd, FlowOpen
from shared.metrics import PREFIX_HIT_BLOCKS, PREFIX_LOOKUP_BLOCKS

log = structlog.get_logger(__name__)
MAX_EARLY_CANCELS = 4096
"""Cancels remembered for requests whose flow has not arrived (see ``KvImporter.cancel``)."""
MAX_QUEUED_FRAMES = 4
"""Frames of one flow queued on the engine thread at once. The receiver queues a frame and
reads the next without waiting for its import, so frames that arrive during a step import
together after it, and the flow's end follows them, instead of a decode step between each."""


@dataclass
class ImportState:
    """A flow being imported.

    Attributes:
        flow_open: The sender's FlowOpen.
        cached_tokens: Prompt tokens the receiver's prefix cache supplied.
        stats: The flow's live byte and frame counts.
        discard_when_done: The request ended elsewhere: keep the KV for the cache, then free.
        frames_queued: Frame imports queued on the engine thread and not yet awaited.
        frame_error: The first frame import that failed (set on the engine thread); later
            frames and the finish refuse with it.
    """

    flow_open: FlowOpen
    cached_tokens: int
    stats: FlowStats
    discard_when_done: bool = False
    frames_queued: list[asyncio.Future] = field(default_factory=list)
    frame_error: Exception | None = None


ImportCompleted = Callable[[ImportState, RequestView, FlowStats], Awaitable[None]]
ImportOpened = Callable[[FlowOpen], Awaitable[None]]
ImportAborted = Callable[[str, str], Awaitable[None]]
ImportRefused = Callable[[str, str], Awaitable[None]]
ImportKept = Callable[[ImportState, FlowStats], Awaitable[None]]


class KvImporter:
    """FlowHandler that imports frames into an engine and reports completed imports."""

    def __init__(
        self,
        worker: EngineWorker,
        on_complete: ImportCompleted,
        on_open: ImportOpened | None = None,
        in_flight_wait_s: float = 120.0,
        on_abort: ImportAborted | None = None,
        max_sequences: int = 0,
        on_refused: ImportRefused | None = None,
        on_kept: ImportKept | None = None,
    ):
        """``on_open`` hears of each flow as it arrives; when one it heard of is then refused
        (no room, a bad prompt, cancelled meanwhile) ``on_refused(request_id, reason)`` follows;
        when one breaks after its import began, ``on_abort(request_id, reason)``; when one whose
        request ended elsewhere has all its KV in the cache, ``on_kept(state, stats)``."""
        self._worker = worker
        self._on_complete = on_complete
        self._on_open = on_open
        self._on_abort = on_abort
        self._on_refused = on_refused
        self._on_kept = on_kept
        self.imports: dict[str, ImportState] = {}
        self._in_flight = InFlightBlocks()
        self.admission = ImportAdmission(worker, self._in_flight, max_sequences, in_flight_wait_s)
        self._cancelled_before_flow: OrderedDict[str, tuple[bool, float]] = OrderedDict()

    async def open_flow(self, flow_open: FlowOpen, stats: FlowStats) -> int:
        rid = flow_open.request_id
        if self.holds(rid):
            raise InvalidRequestState(f"a flow for {rid!r} is already open")
        engine = self._worker.engine
        claim = self._in_flight.claim(rid, hash_blocks(flow_open.token_ids, engine.block_size))
        early = self._cancelled_before_flow.pop(rid, None)
        heard = False
        try:
            if early is not None:  # the request ended before its flow got here
                self._in_flight.cancel_waiting(rid, finished_elsewhere=early[0])
                if claim.dropped:
                    raise RequestCancelled(f"request {rid!r} was cancelled before its flow arrived")
            elif self._on_open:
                await self._on_open(flow_open)
                heard = True
            await self.admission.wait_for_blocks_in_flight(rid, claim)
            if claim.dropped:
                raise RequestCancelled(f"request {rid!r} was cancelled while its flow waited")
            first = await self.admission.begin_when_room(flow_open, claim)
            if claim.dropped:  # while the sequence was made
                await self._worker.call(engine.abort, rid)
                raise RequestCancelled(f"request {rid!r} was cancelled while its import began")
        except Exception as exc:
            self._release(rid)
            if heard and self._on_refused:
                await self._on_refused(rid, str(exc) or type(exc).__name__)
            raise
        except BaseException:
            self._release(rid)
            raise
        self.imports[rid] = ImportState(
            flow_open, cached_tokens=first, stats=stats, discard_when_done=claim.finished_elsewhere
        )
        service = flow_open.role
        PREFIX_HIT_BLOCKS.labels(service).inc(first // engine.block_size)
        PREFIX_LOOKUP_BLOCKS.labels(service).inc(len(flow_open.token_ids) // engine.block_size)
        log.info(
            "kv_import_opened",
            request_id=rid,
            cached_tokens=first,
            prompt_tokens=len(flow_open.token_ids),
            role=flow_open.role,
        )
        return first

    def _release(self, request_id: str):
        self._in_flight.release(request_id)

    @property
    def request_ids(self) -> set[str]:
        """Requests with a flow importing or waiting in line."""
        return set(self.imports) | set(self._in_flight.claims)

    @property
    def waiting(self) -> list[str]:
        """Request ids of flows still waiting for earlier flows' blocks."""
        return [rid for rid in self._in_flight.claims if rid not in self.imports]

    def kept_for_cache(self) -> set[str]:
        """Requests that ended elsewhere whose import goes on (or waits in line) only to fill the cache."""
        return {rid for rid, state in list(self.imports.items()) if state.discard_when_done} | {
            rid
            for rid, claim in list(self._in_flight.claims.items())
            if claim.finished_elsewhere and rid not in self.imports
        }

    async def import_frame(self, request_id: str, frame: KvFrame) -> None:
        """Queue the frame's import (the receiver reads on meanwhile); raise a failed import."""
        state = self.imports.get(request_id)
        if state is None:  # not importing here (cancelled): the engine refuses the frame
            await self._worker.call(self._worker.engine.import_frame, frame)
            return
        if state.frame_error is not None:
            raise state.frame_error
        state.frames_queued = [f for f in state.frames_queued if not f.done()]
        if len(state.frames_queued) >= MAX_QUEUED_FRAMES:
            await state.frames_queued.pop(0)
        queued = self._worker.submit(self.import_frame_intact, state, frame)
        queued.add_done_callback(_retrieve_exception)
        queued.add_done_callback(lambda _, rid=request_id: self._in_flight.progressed(rid))
        state.frames_queued.append(queued)

    def import_frame_intact(self, state: ImportState, frame: KvFrame):
        # On the engine thread: once a frame failed, no later one may land after the gap.
        if state.frame_error is not None:
            raise state.frame_error
        try:
            self._worker.engine.import_frame(frame)
        except Exception as exc:
            state.frame_error = exc
            raise

    def finish_import_intact(self, state: ImportState, request_id: str, end: FlowEnd) -> RequestView:
        if state.frame_error is not None:
            raise state.frame_error
        return self._worker.engine.finish_import(request_id, end.output_token_ids, end.output_logprobs)

    async def end_flow(self, request_id: str, end: FlowEnd, stats: FlowStats) -> None:
        state = self.imports.pop(request_id, None)
        if state is None:
            return
        self._release(request_id)
        engine = self._worker.engine
        try:
            if state.discard_when_done:
                await asyncio.gather(*state.frames_queued)
                await self._worker.call(engine.free, request_id)
                log.info("kv_import_kept_for_cache", request_id=request_id)
                if self._on_kept is not None:
                    await self._on_kept(state, stats)
                return
            # Queued right behind the flow's frames, before any step the engine loop asks for later.
            finishing = self._worker.submit(self.finish_import_intact, state, request_id, end)
            await asyncio.gather(*state.frames_queued, return_exceptions=True)
            seq = await finishing
        except Exception as exc:
            await self._abort(state, request_id, f"KV import failed: {exc}")
            raise
        log.info(
            "kv_import_done",
            request_id=request_id,
            frames=stats.frames,
            kv_bytes=stats.bytes_received,
            transfer_s=round(stats.transfer_s, 4),
        )
        await self._on_complete(state, seq, stats)

    async def abort_flow(self, request_id: str, reason: str) -> None:
        state = self.imports.pop(request_id, None)
        if state is None:
            return
        self._release(request_id)
        await self._abort(state, request_id, reason)

    async def _abort(self, state: ImportState, request_id: str, reason: str):
        await self._worker.call(self._worker.engine.abort, request_id)
        log.warning("kv_import_aborted", request_id=request_id, reason=reason)
        if self._on_abort and not state.discard_when_done:
            await self._on_abort(request_id, reason)

    def holds(self, request_id: str) -> bool:
        """Whether a flow of ``request_id`` is open here (waiting, beginning or importing): its
        sequence is the importer's to free."""
        return request_id in self.imports or request_id in self._in_flight.claims

    async def cancel(self, request_id: str, finished_elsewhere: bool) -> ImportState | None:
        """Cancel an import in progress; return its state if there was one.

        A request that finished elsewhere keeps importing (its blocks keep this instance's
        cache aligned with the prefill's); any other cancel drops the KV now (complete
        blocks already cached stay valid), and the sender's next frame is refused. A cancel
        for a flow not here yet is kept: the flow imports for the cache only, or is refused.
        """
        state = self.imports.get(request_id)
        if state is None:
            # Still waiting in line: it must not import later and park. Or not here yet: a
            # flow queued on the WAN behind other KV can arrive after its request ended.
            if not self._in_flight.cancel_waiting(request_id, finished_elsewhere):
                self._remember_cancel(request_id, finished_elsewhere)
            return None
        if keeps_importing(finished_elsewhere):
            state.discard_when_done = True
            return state
        del self.imports[request_id]
        self._release(request_id)
        await self._worker.call(self._worker.engine.abort, request_id)
        return state

    def _remember_cancel(self, request_id: str, finished_elsewhere: bool):
        """Keep a cancel for a flow that may still come, for as long as a flow may wait."""
        now = asyncio.get_running_loop().time()
        self._cancelled_before_flow[request_id] = (finished_elsewhere, now)
        self._cancelled_before_flow.move_to_end(request_id)
        oldest = self._cancelled_before_flow
        while oldest and (
            len(oldest) > MAX_EARLY_CANCELS or next(iter(oldest.values()))[1] < now - self.admission.wait_s
        ):
            oldest.popitem(last=False)


def _retrieve_exception(future: asyncio.Future):
    # A frame import nobody awaits any more (its flow was cancelled) must not warn at exit.
    if not future.cancelled():
        future.exception()
