"""Which of one process's flows across one link sends next: the one with the least left to send.

Flows that share a bottleneck link finish, if the link is split evenly among them, all near
the time the last would have finished alone: two cold prompts' KV started together both land
after twice one prompt's transfer. Served shortest-remaining-first, the first lands after one
transfer and the second no later than before; a follow-up turn's few blocks overtake a cold
prompt's tens of megabytes instead of sharing the link with them. (The router's ledger
predicts landings under the same rule: ``services/router/link_share.py``.)

A flow's sender says when it has KV in hand (``LinkTurns.hold``, with how much of the prompt
is still to send) and when it has none (``let_go``: the rest is still being computed or
exported). It sends its KV as pieces (``PIECE_BYTES``); before each piece it waits for its
turn (``LinkTurns.turn``), given while no other flow with KV in hand or a piece on its way has
less left (ties: the flow opened first). The rule is work-conserving: a flow with nothing in
hand holds nothing up, so others send meanwhile. A piece that has started goes out whole; what
the kernel and the link already hold of another flow's pieces still shares the link.

No piece waits for its turn longer than ``MAX_TURN_WAIT_S``: its flow then stops taking turns
and sends whenever it has KV, sharing the link as a TCP connection does. So a flow with much
left is not starved by a stream of shorter ones until its receiver gives up on it, and a flow
whose receiver stopped reading (its piece stuck in the kernel) holds the others up for at most
that long.

Only the flows of this process take turns: flows of other senders share the link as TCP
connections do. One ``LinkTurns`` serves one link (a prefill's WAN path: two sites, one link).
"""

import asyncio
import itertools
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

PIECE_BYTES = 1 << 20
"""Most bytes a flow hands the kernel per turn (84 ms at 100 Mbit/s)."""
MAX_TURN_WAIT_S = 10.0
"""Longest a piece waits for its turn (a twelfth of a receiver's default 120 s wait for a frame)."""


@dataclass(eq=False)
class LinkFlow:
    """One flow on the link.

    Attributes:
        seq: Opening order (breaks ties between flows with as much left).
        tokens_left: What the flow has still to send, as its sender last said (``hold``).
        in_hand: Its sender has KV for it, between ``hold`` and ``let_go``.
        pieces_pending: Its pieces waiting for a turn or on their way to the kernel.
        takes_turns: False once a piece waited ``MAX_TURN_WAIT_S``, or the flow is closed: its
            pieces then go without waiting.
    """

    seq: int
    tokens_left: int = 0
    in_hand: bool = False
    pieces_pending: int = 0
    takes_turns: bool = True

    @property
    def pending(self) -> bool:
        """Whether it has KV in hand or a piece on its way (it keeps flows behind it waiting)."""
        return self.in_hand or self.pieces_pending > 0

    @property
    def rank(self) -> tuple[int, int]:
        return (self.tokens_left, self.seq)


class LinkTurns:
    """The flows of this process that cross one link, and whose piece goes next."""

    def __init__(self, max_wait_s: float = MAX_TURN_WAIT_S):
        self.max_wait_s = max_wait_s
        self._flows: list[LinkFlow] = []
        self._seq = itertools.count()
        self._changed = asyncio.Event()

    def open(self) -> LinkFlow:
        """A new flow on the link (``close`` it when it ends, whatever way)."""
        flow = LinkFlow(next(self._seq))
        self._flows.append(flow)
        return flow

    def close(self, flow: LinkFlow):
        """``flow`` is done with the link (idempotent): flows behind it may go on; its pieces
        still waiting go at once (a frame that has started is finished before a cancel)."""
        if flow in self._flows:
            flow.takes_turns, flow.in_hand = False, False
            self._flows.remove(flow)
            self._notify()

    @property
    def num_flows(self) -> int:
        """Flows open on the link."""
        return len(self._flows)

    def hold(self, flow: LinkFlow, tokens_left: int):
        """``flow``'s sender has KV in hand, ``tokens_left`` of the prompt's still to send: it
        keeps its place ahead of flows with more left until ``let_go``.

        Raises:
            ValueError: ``tokens_left`` is negative.
        """
        if tokens_left < 0:
            raise ValueError(f"tokens_left must be >= 0, got {tokens_left}")
        flow.tokens_left, flow.in_hand = tokens_left, True
        self._notify()  # a flow whose rank fell may now be first

    def let_go(self, flow: LinkFlow):
        """``flow``'s sender has no KV in hand: flows behind it may send meanwhile."""
        if flow.in_hand:
            flow.in_hand = False
            self._notify()

    @asynccontextmanager
    async def turn(self, flow: LinkFlow) -> AsyncIterator[None]:
        """Held while one piece of ``flow`` goes to the kernel; entered once no other flow with
        KV in hand or a piece on its way has less left (or as much, opened earlier), or at once
        if ``flow`` no longer takes turns. A piece that waited ``max_wait_s`` enters, and its
        flow stops taking turns. Cancelled while waiting, it gives up its place."""
        flow.pieces_pending += 1
        try:
            await self._wait_for_turn(flow)
            yield
        finally:
            flow.pieces_pending -= 1
            self._notify()

    async def _wait_for_turn(self, flow: LinkFlow):
        deadline_s = asyncio.get_running_loop().time() + self.max_wait_s
        while flow.takes_turns and self._first_pending() not in (None, flow):
            changed = self._changed
            try:  # not wait_for: on 3.11 it can swallow a cancel that comes as the event is set
                async with asyncio.timeout_at(deadline_s):
                    await changed.wait()
            except TimeoutError:
                flow.takes_turns = False

    def _first_pending(self) -> LinkFlow | None:
        """The pending flow that goes first."""
        pending = [flow for flow in self._flows if flow.pending]
        return min(pending, key=lambda flow: flow.rank, default=None)

    def _notify(self):
        self._changed.set()
        self._changed = asyncio.Event()


def pieces(parts: list[bytes | memoryview], piece_bytes: int) -> list[list[memoryview]]:
    """``parts`` cut, in order and without copying, into pieces of at most ``piece_bytes``."""
    out: list[list[memoryview]] = [[]]
    room = piece_bytes
    for part in parts:
        view = memoryview(part).cast("B")
        while len(view):
            if room == 0:
                out.append([])
                room = piece_bytes
            take = view[:room]
            out[-1].append(take)
            view, room = view[len(take) :], room - len(take)
    return out
