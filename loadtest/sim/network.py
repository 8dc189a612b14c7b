"""The links: the WAN as one pipe shared as the router's ledger models it (each prefill's flow
with the least left sends, prefills share the rate equally: ``services/router/link_share.py``;
each flow sees the RTT and jitter), and the local path (each flow on its own, at the local
rate)."""

import math
import random
from collections.abc import Callable
from dataclasses import dataclass

from loadtest.sim.events import EventQueue
from services.router.link_share import Sending, advance, finish_times


@dataclass(frozen=True)
class LinkSpec:
    """A link's shape.

    Attributes:
        bandwidth_bps: Bits per second, shared by every flow.
        rtt_s: Round trip.
        jitter_s: Standard deviation of each flow's extra one-way delay.
        buffer_bytes: Bytes a sender has already handed to the network (socket buffers) that a
            cancel cannot recall: they cross anyway.
    """

    bandwidth_bps: float
    rtt_s: float
    jitter_s: float = 0.0
    buffer_bytes: int = 0


class _Flow:
    __slots__ = ("cancelled", "num_bytes", "on_done", "sending")

    def __init__(self, num_bytes: int, on_done: Callable[[float], None], started_s: float, sender: str):
        self.sending = Sending(started_s, float(num_bytes), sender)
        self.num_bytes = num_bytes
        self.on_done = on_done
        self.cancelled = False


class WanPipe:
    """The flows crossing, shared as ``link_share`` says; a flow's last byte lands half an RTT
    (plus jitter) after it left."""

    def __init__(self, events: EventQueue, link: LinkSpec, seed: int = 0):
        self.events, self.link = events, link
        self._rng = random.Random(seed)
        self._flows: list[_Flow] = []
        self._last_s = 0.0
        self._version = 0
        self.bytes_carried = 0

    def one_way_s(self) -> float:
        """Half an RTT plus a jitter draw (never negative)."""
        return max(0.0, self.link.rtt_s / 2 + self._rng.gauss(0.0, self.link.jitter_s))

    def send(self, num_bytes: int, on_done: Callable[[float], None], sender: str = "") -> _Flow:
        """Start a flow from prefill ``sender`` now; ``on_done(throughput_bps)`` runs when its
        last byte has landed."""
        self._advance()
        flow = _Flow(num_bytes, on_done, self.events.now, sender)
        self._flows.append(flow)
        self._reschedule()
        return flow

    def cancel(self, flow: _Flow):
        """Stop a flow: what it has not handed to the network yet never crosses (what sits in
        socket buffers, up to ``buffer_bytes``, still does; its receiver discards it)."""
        if flow in self._flows:
            self._advance()
            flow.cancelled = True
            left = max(0.0, flow.sending.unsent_bytes)
            kept = min(left, float(self.link.buffer_bytes))
            flow.num_bytes -= int(left - kept)
            flow.sending.unsent_bytes = kept
            if kept <= 0:
                self.bytes_carried += flow.num_bytes
                self._flows.remove(flow)
            self._reschedule()

    @property
    def _bytes_per_s(self) -> float:
        return self.link.bandwidth_bps / 8

    def _advance(self):
        now = self.events.now
        if self._flows and now > self._last_s:
            advance([flow.sending for flow in self._flows], self._last_s, now, self._bytes_per_s)
        self._last_s = now

    def _reschedule(self):
        self._version += 1
        if not self._flows:
            return
        version = self._version
        now = self.events.now
        first_done_s = min(finish_times([flow.sending for flow in self._flows], now, self._bytes_per_s))
        if first_done_s < math.inf:
            self.events.after(max(0.0, first_done_s - now), lambda: self._tick(version))

    def _tick(self, version: int):
        if version != self._version:
            return
        self._advance()
        # a byte (or a nanosecond's worth) left is float residue, not data
        tolerance = max(1.0, self._bytes_per_s * 1e-9)
        done = [f for f in self._flows if f.sending.unsent_bytes <= tolerance]
        for flow in done:
            self._flows.remove(flow)
            self.bytes_carried += flow.num_bytes
            sent_s = self.events.now - flow.sending.first_byte_at  # when it was sent
            throughput = flow.num_bytes * 8 / sent_s if sent_s > 0 else self.link.bandwidth_bps
            self.events.after(self.one_way_s(), lambda f=flow, t=throughput: f.cancelled or f.on_done(t))
        self._reschedule()


class LocalPath:
    """Same-site transfers: each flow alone at ``bytes_per_s`` plus a fixed latency."""

    def __init__(self, events: EventQueue, bytes_per_s: float, latency_s: float):
        self.events, self.bytes_per_s, self.latency_s = events, bytes_per_s, latency_s
        self.bytes_carried = 0

    def send(self, num_bytes: int, on_done: Callable[[float], None]):
        """Deliver ``num_bytes``; ``on_done(throughput_bps)`` when they have landed."""
        self.bytes_carried += num_bytes
        self.events.after(self.latency_s + num_bytes / self.bytes_per_s, lambda: on_done(self.bytes_per_s * 8))
