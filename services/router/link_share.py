"""How flows crossing one link share it. A prefill sends its WAN flows shortest remaining first
(``shared/bulk/link_turns.py``): of its flows whose first byte may leave, the one with the
fewest bytes left sends (ties: the one placed first), and a flow that starts with fewer left
takes over. Flows of different prefills share the link equally, as TCP connections do: each
prefill with a flow sending gets an equal share of the rate.
"""

import math
from collections.abc import Sequence
from dataclasses import dataclass

DONE_BYTES = 1e-6
"""Less than this left counts as sent (floating-point dust)."""


@dataclass
class Sending:
    """A flow on the link: when its first byte may leave, what it has still to send, and the
    prefill sending it."""

    first_byte_at: float
    unsent_bytes: float
    sender: str = ""


def advance(flows: Sequence[Sending], from_s: float, to_s: float, bytes_per_s: float):
    """Let the link carry ``flows`` from ``from_s`` to ``to_s`` (their ``unsent_bytes`` shrink)."""
    _serve(flows, from_s, to_s, bytes_per_s, None)


def finish_times(flows: Sequence[Sending], now_s: float, bytes_per_s: float) -> list[float]:
    """When each of ``flows`` sends its last byte if the link carries only them from ``now_s``
    on (``flows`` are left as they are)."""
    copies = [Sending(flow.first_byte_at, flow.unsent_bytes, flow.sender) for flow in flows]
    finished = [now_s if flow.unsent_bytes <= DONE_BYTES else math.inf for flow in flows]
    _serve(copies, now_s, math.inf, bytes_per_s, finished)
    return finished


def drained(crossing_bytes: Sequence[float], sent_bytes: float) -> list[float]:
    """What each of the flows with ``crossing_bytes`` still to send has left (same order; 0:
    done) once the link has carried ``sent_bytes`` of them, the smallest first (whoever
    sends them: an estimate for flows of several prefills)."""
    left = list(crossing_bytes)
    for i in sorted(range(len(left)), key=left.__getitem__):
        taken = min(left[i], sent_bytes)
        sent_bytes -= taken
        left[i] -= taken
    return left


def shared_transfer_bytes(
    num_bytes: float, crossing_bytes: Sequence[float], senders: Sequence[str] | None = None, sender: str = ""
) -> float:
    """Bytes the link carries until a flow of ``num_bytes`` from prefill ``sender`` sends its
    last beside flows with ``crossing_bytes`` to send from ``senders`` (default: all from
    ``sender``): its own; all of each flow of its prefill with no more left (placed earlier, it
    goes first; those with more left wait for it); and of each other prefill, which shares the
    link equally, as many as this flow's prefill sends until then, or all that prefill has."""
    senders = [sender] * len(crossing_bytes) if senders is None else senders
    own = num_bytes + sum(
        size for size, by in zip(crossing_bytes, senders, strict=True) if by == sender and size <= num_bytes
    )
    others: dict[str, float] = {}
    for size, by in zip(crossing_bytes, senders, strict=True):
        if by != sender:
            others[by] = others.get(by, 0.0) + size
    return own + sum(min(total, own) for total in others.values())


def _serve(flows: Sequence[Sending], now_s: float, until_s: float, bytes_per_s: float, finished: list | None):
    """Event by event (a start or an end): each prefill's flow with the least left among those
    that may send gets an equal share of the rate. O(n²) in the flows (a router's ledger holds
    a few dozen at most)."""
    while now_s < until_s:
        serving, upcoming_s = _serving(flows, now_s)
        if not serving:
            if upcoming_s == math.inf:
                return
            now_s = min(upcoming_s, until_s)
            continue
        share = bytes_per_s / len(serving)
        step_s = min(until_s - now_s, upcoming_s - now_s, min(flows[i].unsent_bytes for i in serving) / share)
        now_s += step_s
        for i in serving:
            flow = flows[i]
            flow.unsent_bytes -= step_s * share
            if flow.unsent_bytes <= max(DONE_BYTES, 1e-12 * share * step_s):  # rounding dust
                flow.unsent_bytes = 0.0
                if finished is not None:
                    finished[i] = now_s


def _serving(flows: Sequence[Sending], now_s: float) -> tuple[list[int], float]:
    """(per prefill, its flow with the least left among those that may send at ``now_s``;
    when the next flow may start)."""
    first: dict[str, int] = {}
    upcoming_s = math.inf
    for i, flow in enumerate(flows):
        if flow.unsent_bytes <= DONE_BYTES:
            continue
        if flow.first_byte_at > now_s:
            upcoming_s = min(upcoming_s, flow.first_byte_at)
        elif flow.sender not in first or flow.unsent_bytes < flows[first[flow.sender]].unsent_bytes:
            first[flow.sender] = i
    return list(first.values()), upcoming_s
