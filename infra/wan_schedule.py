"""When each chunk crosses one direction of the WAN link, and how much the link may read from
one connection.

``LinkSchedule`` is the wire of one direction, shared by every route and connection. The proxy
submits each chunk it reads; the schedule commits a chunk (fixes when its last bit leaves) only
once the wire is free, picking among the chunks waiting: control chunks first, then bulk ones;
within a class the connections take turns, a chunk each, and each connection's chunks go in the
order read. A control chunk therefore waits for at most the one chunk already on the wire, never
for bulk chunks read before it but not yet committed. With no control chunk waiting, bulk chunks
keep the wire busy.

Time is virtual: a chunk starts when the wire became free (or when it was read, if later), not
when a late timer wake-up got round to committing it. A busy machine's late wake-ups delay
commits, not the schedule, so they cost no bandwidth as long as they stay below the one-way
delay each delivery waits anyway.

``FlowGate`` is one direction of one connection: bytes in flight against the connection's
window (TCP's send buffer / receive window), and bytes read but not yet on the wire against the
read-ahead that keeps the wire busy through late wake-ups.
"""

import asyncio
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass

CHUNK_BYTES = 64 << 10
"""Most bytes the link reads from a connection at once: the unit it schedules and delays."""
READ_AHEAD_S = 0.010
"""How much wire time one connection may have read and waiting. A sleep on a busy machine wakes
a millisecond or more late; reading only once the link is free would leave it idle for that long
after every chunk (81 % of 100 Mbit/s and 34 % of 1 Gbit/s were measured that way). Waiting
chunks are not committed, so control chunks still go ahead of them."""
CONTROL, BULK = "control", "bulk"


@dataclass
class _Waiting:
    num_bytes: int
    extra_s: float
    read_at: float
    sent: asyncio.Future


class LinkSchedule:
    """The wire of one direction: commits chunks one after another at ``rate_bps()``.

    Waiting chunks are kept per class and, within a class, per connection (``flow``). The wire
    takes a control chunk if one was read by the time it is free, else a bulk one; within a
    class it serves the connections in turn, one chunk each (a new connection after those
    already waiting), so a small flow waits for one chunk per busy connection, not for all they
    have read ahead.

    Args:
        rate_bps: The direction's capacity now, in bits/s (0: unlimited); read at each commit,
            so changes apply to chunks not yet committed.
    """

    def __init__(self, rate_bps: Callable[[], float]):
        self._rate_bps = rate_bps
        self.free_at = 0.0
        """Loop time the last committed chunk's last bit leaves."""
        self._flows: dict[str, OrderedDict[Hashable, deque[_Waiting]]] = {CONTROL: OrderedDict(), BULK: OrderedDict()}
        self.waiting_bytes = {CONTROL: 0, BULK: 0}
        """Bytes read and not yet committed, per class."""
        self._timer: asyncio.TimerHandle | None = None

    def submit(self, flow: Hashable, num_bytes: int, control: bool, extra_s: float = 0.0) -> asyncio.Future:
        """Queue a chunk of ``flow`` read now; the future gives the loop time its last bit leaves
        the wire (cancelled by ``close``).

        ``extra_s`` is added to its transmit time (a stall). One flow's chunks of one class
        commit in the order submitted.
        """
        loop = asyncio.get_running_loop()
        sent = loop.create_future()
        klass = CONTROL if control else BULK
        self._flows[klass].setdefault(flow, deque()).append(_Waiting(num_bytes, extra_s, loop.time(), sent))
        self.waiting_bytes[klass] += num_bytes
        if self._timer is None:  # with a timer set the wire is busy until it fires
            self._commit_due()
        return sent

    def close(self):
        """Stop committing; every waiting chunk's future is cancelled."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        for klass, flows in self._flows.items():
            for queue in flows.values():
                for chunk in queue:
                    chunk.sent.cancel()
            flows.clear()
            self.waiting_bytes[klass] = 0

    def _commit_due(self):
        """Commit every chunk whose virtual start has come; wake again when the wire frees."""
        self._timer = None
        loop = asyncio.get_running_loop()
        now = loop.time()
        while self.free_at <= now and (chunk := self._next()) is not None:
            rate_bps = self._rate_bps()
            transmit_s = chunk.num_bytes * 8 / rate_bps if rate_bps > 0 else 0.0
            self.free_at = max(self.free_at, chunk.read_at) + transmit_s + chunk.extra_s
            chunk.sent.set_result(self.free_at)
        if any(self._flows.values()):
            self._timer = loop.call_at(self.free_at, self._commit_due)

    def _next(self) -> _Waiting | None:
        """The chunk the wire takes next (see the class); a chunk whose connection is gone is
        dropped."""
        while any(self._flows.values()):
            first_read_at = min(q[0].read_at for flows in self._flows.values() for q in flows.values())
            starts_at = max(self.free_at, first_read_at)  # virtual: the wire's start, not now
            klass, flow = next(
                (klass, flow)
                for klass in (CONTROL, BULK)
                for flow, queue in self._flows[klass].items()
                if queue[0].read_at <= starts_at
            )
            queue = self._flows[klass][flow]
            chunk = queue.popleft()
            if queue:
                self._flows[klass].move_to_end(flow)  # its turn is over
            else:
                del self._flows[klass][flow]
            self.waiting_bytes[klass] -= chunk.num_bytes
            if not chunk.sent.done():
                return chunk
        return None


class FlowGate:
    """One direction of one connection: what the link may read from it now.

    A chunk is in flight from when it is read until its delivery plus the acknowledgement's
    return (``acknowledged``); it is waiting from when it is read until the wire commits it.
    """

    def __init__(self):
        self.in_flight_bytes = 0
        self.waiting_bytes = 0
        self._changed = asyncio.Event()

    async def room(self, window_bytes: int, rate_bps: float) -> int:
        """Wait until the link may read from this connection; return how many bytes it may read.

        It may read while in-flight bytes are below ``window_bytes`` (0: no window) and less
        than ``READ_AHEAD_S`` of wire time at ``rate_bps`` is waiting; never more than
        ``CHUNK_BYTES``, nor past the window.
        """
        read_ahead_bytes = READ_AHEAD_S * rate_bps / 8 if rate_bps > 0 else float("inf")
        while True:
            window_left = window_bytes - self.in_flight_bytes if window_bytes > 0 else CHUNK_BYTES
            if window_left > 0 and self.waiting_bytes < read_ahead_bytes:
                return min(CHUNK_BYTES, window_left)
            self._changed.clear()
            await self._changed.wait()

    def read(self, num_bytes: int, sent: asyncio.Future):
        """``num_bytes`` were read and submitted; ``sent`` resolves when the wire commits them."""
        self.in_flight_bytes += num_bytes
        self.waiting_bytes += num_bytes
        sent.add_done_callback(lambda _: self._committed(num_bytes))

    def acknowledged(self, num_bytes: int):
        """The far end's acknowledgement of ``num_bytes`` came back: they leave the window."""
        self.in_flight_bytes -= num_bytes
        self._changed.set()

    def _committed(self, num_bytes: int):
        self.waiting_bytes -= num_bytes
        self._changed.set()
