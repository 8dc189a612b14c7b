"""When a KV flow may begin importing: after earlier flows that bring its blocks, and once the
pool has room for its prompt (the decode-side cache's policy, ``shared.decode_cache``, says
which flows wait on which; this runs the waits against the engine)."""

import asyncio

import structlog

from shared.decode_cache import Claim, InFlightBlocks
from shared.engine_worker import EngineWorker
from shared.errors import OutOfKvBlocks, RequestCancelled
from shared.messages import FlowOpen

log = structlog.get_logger(__name__)
ROOM_POLL_S = 0.05
"""How often a flow waiting for room looks again."""


class ImportAdmission:
    """The waits of a flow before its import begins, each bounded by ``wait_s``."""

    def __init__(self, worker: EngineWorker, in_flight: InFlightBlocks, max_sequences: int, wait_s: float):
        self.worker, self.in_flight = worker, in_flight
        self.max_sequences, self.wait_s = max_sequences, wait_s
        self.num_waits_for_room = 0

    async def begin_when_room(self, flow_open: FlowOpen, claim: Claim) -> int:
        """Reserve the prompt's blocks once the pool has them and fewer than ``max_sequences``
        requests are held: a full instance makes the flow wait (the sender's accept timeout
        bounds it), never fail. A prompt larger than the whole pool fails at once."""
        engine, rid = self.worker.engine, flow_open.request_id
        needed = -(-len(flow_open.token_ids) // engine.block_size)
        num_blocks = engine.load().num_blocks
        if needed > num_blocks:
            raise OutOfKvBlocks(f"the prompt needs {needed} KV blocks; the pool has {num_blocks}")
        deadline = asyncio.get_running_loop().time() + self.wait_s
        waited = False
        while True:
            if not self.max_sequences or engine.load().num_sequences < self.max_sequences:
                try:
                    return await self.worker.call(
                        engine.begin_import, rid, flow_open.token_ids, flow_open.sampling, flow_open.seed
                    )
                except OutOfKvBlocks:
                    pass
            if claim.cancelled.is_set():
                raise RequestCancelled(f"request {rid!r} ended while its flow waited for room")
            if asyncio.get_running_loop().time() > deadline:
                raise OutOfKvBlocks(f"no room for {needed} KV blocks within {self.wait_s:.0f} s")
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

    async def wait_for_blocks_in_flight(self, request_id: str, claim: Claim):
        """Let earlier flows that bring this prompt's blocks bring them first.

        A follow-up turn often arrives while the previous turn's KV is still crossing the
        WAN: asking for those blocks again would send them twice over the same link. The
        flow waits until the cache holds the blocks it shares with earlier flows (they are
        cached frame by frame as those flows import), then asks only for the rest. Earlier
        flows still waiting themselves count too (by arrival order, so no two flows wait on
        each other): otherwise two turns queued behind a shared system prompt would both ask
        for the first turn's blocks. A request that ended elsewhere still imports (for the
        cache), so it keeps its place; any other cancel ends the wait at once.
        """
        engine = self.worker.engine
        deadline = asyncio.get_running_loop().time() + self.wait_s
        logged_behind = None
        while not claim.dropped:
            cached = await self.worker.call(engine.cached_prefix_blocks, claim.block_hashes)
            found = self.in_flight.blocker(claim, cached)
            remaining = deadline - asyncio.get_running_loop().time()
            if found is None or remaining <= 0:
                return
            behind, blocker = found
            if behind != logged_behind:
                logged_behind = behind
                log.info(
                    "kv_import_waits_for_blocks_in_flight", request_id=request_id, behind=behind, cached_blocks=cached
                )
            waits = [asyncio.ensure_future(blocker.done.wait()), asyncio.ensure_future(blocker.progressed.wait())]
            if not claim.cancelled.is_set():
                waits.append(asyncio.ensure_future(claim.cancelled.wait()))
            try:
                await asyncio.wait(waits, timeout=remaining, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for waiting in waits:
                    waiting.cancel()
