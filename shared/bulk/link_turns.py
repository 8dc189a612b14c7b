"""Which of one process's flows across one link sends next: the one with the least left to send.

Flows that share a bottleneck link finish, if the link is split evenly among them, all near
the time the last would have finished alone: two cold prompts' KV started together both land
after twice one prompt's transfer. Served shortest-remaining-first, the first lands after one
transfer and the second no later than before; a follow-up turn's few blocks overtake a cold
prompt's tens of megabytes instead of sharing the link with them. (The router's ledger
predicts landings under the same rule: ``services/router/link_share.py``.)

A flow sends its KV as pieces; before each piece it waits for its turn (``LinkTurns.turn``),
given while no other flow with a piece waiting or on its way to the kernel has less left
(``tokens_left``; ties: the flow opened first). The rule is work-conserving: a flow whose next
KV is still being computed waits for nothing and holds nothing, so others send meanwhile. A
piece that has started goes out whole; what the kernel and the link already hold of another
flow's pieces still shares the link, so pieces are cut small (``PIECE_BYTES``) while flows
contend (``contended``) and sent whole otherwise.

Only the flows of this process take turns: flows of other senders share the link as TCP
connections do.
"""

import asyncio
import itertools
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

PIECE_BYTES = 1 << 20
"""Most bytes a flow hands the kernel per turn while flows contend (84 ms at 100 Mbit/s)."""


@dataclass(eq=False)
class LinkFlow:
    """One flow on the link.

    Attributes:
        seq: Opening order (breaks ties between flows with as much left).
        tokens_left: What the flow has still to send when its latest piece was asked for.
        pieces_pending: Its pieces waiting for a turn or on their way to the kernel.
    """

    seq: int
    tokens_left: int = 0
    pieces_pending: int = 0
    closed: bool = field(default=False)

    @property
    def rank(self) -> tuple[int, int]:
        return (self.tokens_left, self.seq)


class LinkTurns:
    """The flows of this process that cross one link, and whose piece goes next."""

    def __init__(self):
        self._flows: list[LinkFlow] = []
        self._seq = itertools.count()
        self._changed = asyncio.Event()

    def open(self) -> LinkFlow:
        """A new flow on the link (``close`` it when it ends, whatever way)."""
        flow = LinkFlow(next(self._seq))
        self._flows.append(flow)
        return flow

    def close(self, flow: LinkFlow):
        """``flow`` sends no more (idempotent): flows behind it may go on."""
        if not flow.closed:
            flow.closed = True
            self._flows.remove(flow)
            self._notify()

    @property
    def contended(self) -> bool:
        """Whether more than one flow is open on the link."""
        return len(self._flows) > 1

    @asynccontextmanager
    async def turn(self, flow: LinkFlow, tokens_left: int) -> AsyncIterator[None]:
        """Held while one piece of ``flow`` goes to the kernel; entered once no other flow with
        a piece pending has less left than ``tokens_left`` (or as much, opened earlier)."""
        flow.tokens_left = tokens_left
        flow.pieces_pending += 1
        try:
            while not flow.closed and self._first_pending() not in (None, flow):
                changed = self._changed
                await changed.wait()
            yield
        finally:
            flow.pieces_pending -= 1
            self._notify()

    def _first_pending(self) -> LinkFlow | None:
        """The flow whose pending piece goes first."""
        pending = [flow for flow in self._flows if flow.pieces_pending]
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
