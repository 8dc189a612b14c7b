"""How flows crossing one link share it: shortest remaining first. Of the flows whose first
byte may leave, the one with the fewest bytes left has the whole link (ties: the one placed
first); a flow that starts with fewer left than it takes over. This is the order in which a
prefill sends its WAN flows (``shared/bulk/link_turns.py``).
"""

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
    _serve(flows, from_s, to_s, bytes_per_s, None)


def finish_times(flows: Sequence[Sending], now_s: float, bytes_per_s: float) -> list[float]:
    """When each of ``flows`` sends its last byte if the link carries only them from ``now_s``
    on (``flows`` are left as they are)."""
    copies = [Sending(flow.first_byte_at, flow.unsent_bytes) for flow in flows]
    finished = [now_s if flow.unsent_bytes <= DONE_BYTES else math.inf for flow in flows]
    _serve(copies, now_s, math.inf, bytes_per_s, finished)
    return finished


def drained(crossing_bytes: Sequence[float], sent_bytes: float) -> list[float]:
    """What flows with ``crossing_bytes`` still to send have left once the link has carried
    ``sent_bytes`` of them, the smallest first (the finished drop out)."""
    left = []
    for size in sorted(crossing_bytes):
        taken = min(size, sent_bytes)
        sent_bytes -= taken
        if size - taken > DONE_BYTES:
            left.append(size - taken)
    return left


def shared_transfer_bytes(num_bytes: float, crossing_bytes: Sequence[float]) -> float:
    """Bytes the link carries until a flow of ``num_bytes`` sends its last beside flows with
    ``crossing_bytes`` to send: its own, and all of each flow with no more left (placed
    earlier, it goes first); flows with more left wait for it."""
    return num_bytes + sum(size for size in crossing_bytes if size <= num_bytes)


def _serve(flows: Sequence[Sending], now_s: float, until_s: float, bytes_per_s: float, finished: list | None):
    """Shortest remaining first, event by event (a start or an end): O(n²) in the flows."""
    while now_s < until_s:
        started, upcoming_s = None, math.inf
        for i, flow in enumerate(flows):
            if flow.unsent_bytes <= DONE_BYTES:
                continue
            if flow.first_byte_at > now_s:
                upcoming_s = min(upcoming_s, flow.first_byte_at)
            elif started is None or flow.unsent_bytes < flows[started].unsent_bytes:
                started = i
        if started is None:
            if upcoming_s == math.inf:
                return
            now_s = min(upcoming_s, until_s)
            continue
        flow = flows[started]
        step_s = min(until_s - now_s, upcoming_s - now_s, flow.unsent_bytes / bytes_per_s)
        now_s += step_s
        flow.unsent_bytes -= step_s * bytes_per_s
        if flow.unsent_bytes <= max(DONE_BYTES, 1e-12 * bytes_per_s * step_s):  # rounding dust
            flow.unsent_bytes = 0.0
            if finished is not None:
                finished[started] = now_s
