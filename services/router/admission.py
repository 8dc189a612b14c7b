"""Admission control at the router: as many requests in flight as the decoders can hold, a
bounded FIFO queue behind them, and 429 with ``Retry-After`` beyond that.

Capacity is what the instances report: the sum of the live main decoders' ``max_sequences``
(the relays' while no main decoder is reachable), of which each of N live routers admits its
share (``capacity_share``: the shares of one decoder sum to its slots, and a router never
counts slots that the decoder reports other routers' requests fill). A request holds its slot
from admission to its end, recoveries included. Placement then puts it only on an instance
where this router has room, so the routers together never run more than a decoder's
``max_sequences`` on it.
"""

import asyncio
import collections
import math
import time
from contextlib import asynccontextmanager

from services.router.registry import InstanceRegistry


class Overloaded(Exception):
    """No slot now and none soon: answer 429.

    Attributes:
        retry_after_s: When a retry has a fair chance (the ``Retry-After`` header).
    """

    def __init__(self, message: str, retry_after_s: int):
        super().__init__(message)
        self.retry_after_s = retry_after_s


def capacity_of(registry: InstanceRegistry) -> int:
    """Requests the live decoders can hold at once (0: nothing to serve with)."""
    mains = registry.live("main_decode")
    return sum(s.capacity_sequences for s in (mains or registry.live("relay_decode")))


class Admission:
    """Slots for requests in flight and a bounded wait line for the rest."""

    def __init__(
        self, registry: InstanceRegistry, *, max_in_flight: int = 0, max_queued: int = 0, queue_timeout_s: float = 30.0
    ):
        self._registry = registry
        self._max_in_flight, self._max_queued = max_in_flight, max_queued
        self._queue_timeout_s = queue_timeout_s
        self._waiters: collections.deque[asyncio.Future] = collections.deque()
        self.in_flight = 0
        self._recent_s: collections.deque[float] = collections.deque(maxlen=64)

    @property
    def limit(self) -> int:
        """Requests allowed in flight now (``--max-in-flight``, else the decoders' capacity)."""
        return self._max_in_flight or capacity_of(self._registry)

    @asynccontextmanager
    async def slot(self):
        """Hold a slot while the block runs; yields the seconds spent waiting for it.

        Raises:
            Overloaded: the wait line is full, or the wait outlasted ``--queue-timeout-s``.
        """
        waited_s = await self._acquire()
        started = time.monotonic()
        try:
            yield waited_s
        finally:
            self._recent_s.append(time.monotonic() - started)
            self.in_flight -= 1
            self.wake()

    async def _acquire(self) -> float:
        limit = self.limit
        if self.in_flight < limit and not self._waiters:
            self.in_flight += 1
            return 0.0
        max_queued = self._max_queued or max(1, limit)
        if len(self._waiters) >= max_queued:
            raise Overloaded(
                f"server busy: {self.in_flight} requests running and {len(self._waiters)} waiting", self.retry_after_s()
            )
        started, waiter = time.monotonic(), asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            await asyncio.wait_for(asyncio.shield(waiter), self._queue_timeout_s)
        except TimeoutError:
            if waiter.done() and not waiter.cancelled():  # granted just as time ran out: keep it
                return time.monotonic() - started
            raise Overloaded(
                f"server busy: no slot within {self._queue_timeout_s:.0f} s", self.retry_after_s()
            ) from None
        except BaseException:
            if waiter.done() and not waiter.cancelled():
                self.in_flight -= 1  # granted, but the client left: hand it on
                self.wake()
            raise
        finally:
            if not waiter.done():
                waiter.cancel()
            if waiter in self._waiters:
                self._waiters.remove(waiter)
        return time.monotonic() - started

    @property
    def num_waiting(self) -> int:
        """Requests waiting for a slot."""
        return len(self._waiters)

    def wake(self):
        """Grant free slots to waiters in arrival order (after a release or a new heartbeat)."""
        limit = self.limit  # the registry does not change meanwhile: one look at the fleet
        while self._waiters and self.in_flight < limit:
            waiter = self._waiters.popleft()
            if not waiter.done():
                self.in_flight += 1
                waiter.set_result(None)

    def retry_after_s(self) -> int:
        """Seconds until the line ahead has likely drained, from recent request durations."""
        typical_s = sorted(self._recent_s)[len(self._recent_s) // 2] if self._recent_s else 1.0
        ahead = len(self._waiters) + 1
        return max(1, min(60, math.ceil(typical_s * ahead / max(1, self.limit))))
