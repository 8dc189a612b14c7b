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
from shared.bulk.receiver import FlowStats
from shared.decode_cache import Claim, InFlightBlocks, keeps_importing
from shared.engine.backend import RequestView
from shared.engine_worker import EngineWorker
from shared.errors import InvalidRequestState, OutOfKvBlocks, RequestCancelled
from shared.kv_wire import KvFrame
from shared.messages import FlowEnd, FlowOpen
from shared.metrics import PREFIX_HIT_BLOCKS, PREFIX_LOOKUP_BLOCKS

log = structlog.get_logger(__name__)
ROOM_POLL_S = 0.05
"""How often a flow waiting for room looks again."""
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
    ):
        """``on_open`` hears of each flow as it arrives; when one it heard of is then refused
        (no room, a bad prompt, cancelled meanwhile) ``on_refused(request_id, reason)`` follows;
        when one breaks after its import began, ``on_abort(request_id, reason)``."""
        self._worker = worker
        self._max_sequences = max_sequences
        self.num_waits_for_room = 0
        self._in_flight_wait_s = in_flight_wait_s
        self._on_complete = on_complete
        self._on_open = on_open
        self._on_abort = on_abort
        self._on_refused = on_refused
        self.imports: dict[str, ImportState] = {}
        self._in_flight = InFlightBlocks()
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
            await self._wait_for_blocks_in_flight(rid, claim)
            if claim.dropped:
                raise RequestCancelled(f"request {rid!r} was cancelled while its flow waited")
            first = await self._begin_when_room(flow_open, claim)
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

    async def _begin_when_room(self, flow_open: FlowOpen, claim: Claim) -> int:
        """Reserve the prompt's blocks once the pool has them and fewer than ``max_sequences``
        requests are held: a full instance makes the flow wait (the sender's accept timeout
        bounds it), never fail. A prompt larger than the whole pool fails at once."""
        engine, rid = self._worker.engine, flow_open.request_id
        needed = -(-len(flow_open.token_ids) // engine.block_size)
        num_blocks = engine.load().num_blocks
        if needed > num_blocks:
            raise OutOfKvBlocks(f"the prompt needs {needed} KV blocks; the pool has {num_blocks}")
        deadline = asyncio.get_running_loop().time() + self._in_flight_wait_s
        waited = False
        while True:
            if not self._max_sequences or engine.load().num_sequences < self._max_sequences:
                try:
                    return await self._worker.call(
                        engine.begin_import, rid, flow_open.token_ids, flow_open.sampling, flow_open.seed
                    )
                except OutOfKvBlocks:
                    pass
            if claim.cancelled.is_set():
                raise RequestCancelled(f"request {rid!r} ended while its flow waited for room")
            if asyncio.get_running_loop().time() > deadline:
                raise OutOfKvBlocks(f"no room for {needed} KV blocks within {self._in_flight_wait_s:.0f} s")
            if not waited:
                waited = True
                self.num_waits_for_room += 1
                load = engine.load()
                log.info(
                    "kv_import_waits_for_room",
                    request_id=rid,
                    needed_blocks=needed,
                    free_blocks=load.num_free_blocks,
                    sequences=load.num_sequences,
                )
            try:  # room appears as other requests finish; a cancel ends the wait at once
                await asyncio.wait_for(claim.cancelled.wait(), ROOM_POLL_S)
            except TimeoutError:
                pass

    async def _wait_for_blocks_in_flight(self, request_id: str, claim: Claim):
        """Let earlier flows that bring this prompt's blocks finish first.

        A follow-up turn often arrives while the previous turn's KV is still crossing the
        WAN: asking for those blocks again would send them twice over the same link. Once
        the earlier import is done they are in the prefix cache and only the rest is asked
        for. Earlier flows still waiting themselves count too (by arrival order, so no two
        flows wait on each other): otherwise two turns queued behind a shared system prompt
        would both ask for the first turn's blocks.
        """
        engine = self._worker.engine
        deadline = asyncio.get_running_loop().time() + self._in_flight_wait_s
        while True:
            cached = await self._worker.call(engine.cached_prefix_blocks, claim.block_hashes)
            found = self._in_flight.blocker(claim, cached)
            remaining = deadline - asyncio.get_running_loop().time()
            if found is None or remaining <= 0:
                return
            behind, blocker = found
            log.info("kv_import_waits_for_blocks_in_flight", request_id=request_id, behind=behind, cached_blocks=cached)
            # A request that ended elsewhere still imports (for the cache), so it keeps its
            # place; any other cancel ends the wait at once.
            waits = [asyncio.ensure_future(blocker.done.wait())]
            if not claim.cancelled.is_set():
                waits.append(asyncio.ensure_future(claim.cancelled.wait()))
            try:
                await asyncio.wait(waits, timeout=remaining, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for waiting in waits:
                    waiting.cancel()
            if claim.dropped or not blocker.done.is_set():
                return

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
            len(oldest) > MAX_EARLY_CANCELS or next(iter(oldest.values()))[1] < now - self._in_flight_wait_s
        ):
            oldest.popitem(last=False)


def _retrieve_exception(future: asyncio.Future):
    # A frame import nobody awaits any more (its flow was cancelled) must not warn at exit.
    if not future.cancelled():
        future.exception()
