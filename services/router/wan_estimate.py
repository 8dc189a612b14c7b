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
"""

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
    """

    bandwidth_bps: float
    rtt_s: float

    def transfer_s(self, num_bytes: int) -> float:
        """Predicted time to ship ``num_bytes`` (plus one round trip for the handshake)."""
        return num_bytes * 8 / self.bandwidth_bps + self.rtt_s


class WanEstimator:
    """EWMA of bandwidth and RTT samples."""

    def __init__(self, bandwidth_bps: float, rtt_s: float, alpha: float = 0.3):
        self.bandwidth_bps, self.rtt_s, self.alpha = bandwidth_bps, rtt_s, alpha
        self.bandwidth_samples = self.rtt_samples = 0

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

    def current(self) -> WanEstimate:
        """The estimate placement uses now."""
        return WanEstimate(self.bandwidth_bps, self.rtt_s)
