"""The router's live estimate of the WAN link, learnt from the bulk channel's own transfers.

Main decode measures throughput between the first and last frame of each WAN flow
(``KvReady.throughput_bps``); prefill measures the flow handshake, one round trip
(``PrefillCompleted.wan_rtt_s``). Both are smoothed with an exponentially weighted moving
average; the configured values stand until the first measurement replaces them.

Smoothing applies to rises and noise only. A transfer much slower than believed (below
``DROP_FACTOR`` of the estimate) replaces the bandwidth estimate at once: a link that fell
from 100 to 2 Mbit/s must not send several more requests P→MD while the average catches up,
and over-predicting for one transfer after a brief dip only costs a relayed request.

A handshake sample also waits behind other flows' KV in the link's queue; one sample may
raise the RTT estimate at most ``RTT_MAX_RISE``-fold, so one handshake queued behind a burst
does not make every later request look relay-worthy. Repeated slow handshakes still raise it
quickly.

The link is shared: every flow this router placed is still crossing until its predicted last
byte (``flow_placed``), relayed requests' included (their KV still goes to main decode after
the relay answered). A new flow's first byte waits for those (``WanEstimate.queue_s``), so two
cold prompts in a row are not both predicted as if each had the link alone. Other routers'
flows are not counted.
"""

import time
from collections.abc import Callable
from dataclasses import dataclass

MIN_SAMPLE_BYTES = 256 << 10
DROP_FACTOR = 0.5
RTT_MAX_RISE = 4.0


@dataclass(frozen=True)
class WanEstimate:
    """What the router believes about the link.

    Attributes:
        bandwidth_bps: Bits per second.
        rtt_s: Round trip in seconds.
        queue_s: Seconds from now until the flows this router already placed have left.
    """

    bandwidth_bps: float
    rtt_s: float
    queue_s: float = 0.0

    def arrival_after_prefill_s(self, num_bytes: int, prefill_s: float = 0.0, first_chunk_s: float = 0.0) -> float:
        """When the last of ``num_bytes`` of KV lands at main decode, counted from the end of
        a prefill that computes for ``prefill_s`` and ships chunk by chunk from ``first_chunk_s``
        on. The flow opens as the compute starts (one round trip), so its first byte leaves at
        ``max(first_chunk_s, rtt, queue)``, its last at ``max(prefill end, first byte + bytes /
        rate)``, and lands one one-way delay later. Without a prefill estimate (0, 0): a round
        trip (or the queue), the whole transfer and a one-way delay."""
        first_byte_s = max(first_chunk_s, self.rtt_s, self.queue_s)
        last_byte_s = max(prefill_s, first_byte_s + num_bytes * 8 / self.bandwidth_bps)
        return last_byte_s - prefill_s + self.rtt_s / 2


class WanEstimator:
    """EWMA of bandwidth and RTT samples."""

    def __init__(
        self, bandwidth_bps: float, rtt_s: float, alpha: float = 0.3, clock: Callable[[], float] = time.monotonic
    ):
        self.bandwidth_bps, self.rtt_s, self.alpha = bandwidth_bps, rtt_s, alpha
        self.bandwidth_samples = self.rtt_samples = 0
        self._clock = clock
        self._link_free_at = 0.0  # clock time the placed flows' last bytes are predicted to leave

    def add_throughput(self, throughput_bps: float, num_bytes: int):
        """A WAN flow's measured throughput (ignored for transfers too small to tell)."""
        if throughput_bps <= 0 or num_bytes < MIN_SAMPLE_BYTES:
            return
        dropped = throughput_bps < DROP_FACTOR * self.bandwidth_bps
        weight = self.alpha if self.bandwidth_samples and not dropped else 1.0
        self.bandwidth_bps += weight * (throughput_bps - self.bandwidth_bps)
        self.bandwidth_samples += 1

    def add_rtt(self, rtt_s: float):
        """A WAN flow's handshake time."""
        if rtt_s <= 0:
            return
        rtt_s = min(rtt_s, RTT_MAX_RISE * self.rtt_s) if self.rtt_s > 0 else rtt_s
        weight = self.alpha if self.rtt_samples else 1.0
        self.rtt_s += weight * (rtt_s - self.rtt_s)
        self.rtt_samples += 1

    def flow_placed(self, num_bytes: int, prefill_s: float, predicted_wan_s: float):
        """A flow of ``num_bytes`` was placed now, its prefill predicted to take ``prefill_s``
        and its last byte to land ``predicted_wan_s`` after (with the queue as it was)."""
        if num_bytes <= 0:
            return
        last_byte_leaves = self._clock() + prefill_s + max(0.0, predicted_wan_s - self.rtt_s / 2)
        self._link_free_at = max(self._link_free_at, last_byte_leaves)

    def current(self) -> WanEstimate:
        """The estimate placement uses now."""
        return WanEstimate(self.bandwidth_bps, self.rtt_s, max(0.0, self._link_free_at - self._clock()))
