"""The discrete-event clock: callbacks at simulated times, in time order, ties in insertion order."""

import heapq
import itertools
from collections.abc import Callable


class EventQueue:
    """A min-heap of ``(time, serial, callback)``."""

    def __init__(self):
        self.now = 0.0
        self._heap: list = []
        self._serial = itertools.count()
        self.events_run = 0

    def at(self, time_s: float, callback: Callable[[], None]):
        """Run ``callback`` at ``time_s`` (never in the past)."""
        heapq.heappush(self._heap, (max(time_s, self.now), next(self._serial), callback))

    def after(self, delay_s: float, callback: Callable[[], None]):
        """Run ``callback`` ``delay_s`` from now."""
        self.at(self.now + delay_s, callback)

    def run(self, until_s: float = float("inf")):
        """Run events until none is left or the next is past ``until_s``."""
        while self._heap and self._heap[0][0] <= until_s:
            self.now, _, callback = heapq.heappop(self._heap)
            self.events_run += 1
            callback()
