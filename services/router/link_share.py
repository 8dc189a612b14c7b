"""How flows crossing one link share it: each flow whose first byte may leave gets an equal share
of the link's rate (processor sharing), as TCP connections through one bottleneck do and as the
WAN link emulator does (it takes turns a chunk per connection). A flow that has sent everything
drops out and the others' shares grow.
"""

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass

DONE_BYTES = 1e-6
"""Less than this left counts as sent (floating-point dust)."""


@dataclass
class Sending:
    """A flow on the link: when its first byte may leave, and what it has still to send."""

    first_byte_at: float
    unsent_bytes: float


def advance(flows: Sequence[Sending], from_s: float, to_s: float, bytes_per_s: float):
    """Let the link carry ``flows`` from ``from_s`` to ``to_s`` (their ``unsent_bytes`` shrink)."""
    _share(flows, from_s, to_s, bytes_per_s, None)


def finish_times(flows: Sequence[Sending], now_s: float, bytes_per_s: float) -> list[float]:
    """When each of ``flows`` sends its last byte if the link carries only them from ``now_s``
    on (``flows`` are left as they are)."""
    copies = [Sending(flow.first_byte_at, flow.unsent_bytes) for flow in flows]
    finished = [now_s if flow.unsent_bytes <= DONE_BYTES else math.inf for flow in flows]
    _share(copies, now_s, math.inf, bytes_per_s, finished)
    return finished


def drained(crossing_bytes: Sequence[float], sent_bytes: float) -> list[float]:
    """What flows with ``crossing_bytes`` still to send have left once a link shared equally
    among them has carried ``sent_bytes`` (each gives up to the same amount; the finished drop
    out)."""
    level, left, remaining = 0.0, sent_bytes, len(crossing_bytes)
    for size in sorted(crossing_bytes):
        if left <= (size - level) * remaining:
            level += left / remaining
            break
        left -= (size - level) * remaining
        level, remaining = size, remaining - 1
    else:
        return []
    return [size - level for size in crossing_bytes if size > level]


def shared_transfer_bytes(num_bytes: float, crossing_bytes: Sequence[float]) -> float:
    """Bytes the link carries until a flow of ``num_bytes``, sharing it equally with flows that
    have ``crossing_bytes`` to send, sends its last: its own, and of each other flow as much,
    or all it has if less."""
    return num_bytes + sum(min(size, num_bytes) for size in crossing_bytes)


def _share(flows: Sequence[Sending], now_s: float, until_s: float, bytes_per_s: float, finished: list | None):
    """Processor sharing by virtual time: ``served`` is what each flow sending has been given
    so far, growing at ``bytes_per_s / flows sending``; a flow that starts with ``unsent`` left
    is done when ``served`` reaches its start's ``served + unsent``. O(n log n) in the flows."""
    waiting = sorted((flow.first_byte_at, i) for i, flow in enumerate(flows) if flow.unsent_bytes > DONE_BYTES)
    waiting.reverse()  # the next to start at the end
    sending: list[tuple[float, int]] = []  # (served when done, index), a heap
    served = 0.0
    while (sending or waiting) and now_s < until_s:
        while waiting and waiting[-1][0] <= now_s:
            i = waiting.pop()[1]
            heapq.heappush(sending, (served + flows[i].unsent_bytes, i))
        upcoming_s = waiting[-1][0] if waiting else math.inf
        if not sending:
            now_s = min(upcoming_s, until_s)
            continue
        share = bytes_per_s / len(sending)
        step_s = min(until_s - now_s, upcoming_s - now_s, (sending[0][0] - served) / share)
        now_s += step_s
        served += share * step_s
        done_below = served + max(DONE_BYTES, 1e-12 * served)  # rounding dust
        while sending and sending[0][0] <= done_below:
            i = heapq.heappop(sending)[1]
            flows[i].unsent_bytes = 0.0
            if finished is not None:
                finished[i] = now_s
    for done_at_served, i in sending:
        flows[i].unsent_bytes = done_at_served - served
