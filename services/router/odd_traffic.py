"""The odd-traffic filter: long-input, very-short-output requests that would waste the WAN.

A request is odd when its output bound is short and the relay would finish it before its KV
could reach main decode (predicted WAN time of the missed blocks above both the TTFT target
and ``max_tokens`` relay steps). An odd request goes P→RLD→MD; if the relay finishes it while
main decode's KV is still incomplete, the router cancels the WAN transfer and main decode
discards the partial KV. Only odd requests are cut short: any other request that the relay
happens to finish first still completes its transfer, so main decode's cache stays aligned
with the prefill's.

States: ``not_odd``; ``relaying`` → ``kv_landed_first`` (main decode got the KV first, the
request ends normally) or ``wan_cancelled`` (the relay finished first).
"""

import enum
from dataclasses import dataclass


class OddState(enum.Enum):
    """Where an odd request stands."""

    NOT_ODD = "not_odd"
    RELAYING = "relaying"
    KV_LANDED_FIRST = "kv_landed_first"
    WAN_CANCELLED = "wan_cancelled"


@dataclass(frozen=True)
class OddTransition:
    """A state the tracker entered, and why (for the caller to count, log and trace)."""

    state: OddState
    why: str


@dataclass(frozen=True)
class OddTrafficRule:
    """The thresholds.

    Attributes:
        enabled: Whether the filter runs at all.
        max_output_tokens: Output bounds above this are never odd.
        relay_step_s: Estimated relay decode step (how fast it would finish).
        min_wan_s: Predicted WAN time below which a prompt is not "long" (the TTFT target).
    """

    enabled: bool
    max_output_tokens: int
    relay_step_s: float
    min_wan_s: float

    def is_odd(self, max_tokens: int, predicted_wan_s: float) -> bool:
        """Whether the relay would finish before the KV lands, on a long prompt."""
        return (
            self.enabled
            and max_tokens <= self.max_output_tokens
            and predicted_wan_s > self.min_wan_s
            and predicted_wan_s > max_tokens * self.relay_step_s
        )


class OddTrafficTracker:
    """One request's odd-traffic state machine; each method returns the transition it made."""

    def __init__(self, odd: bool):
        self.state = OddState.RELAYING if odd else OddState.NOT_ODD
        self.initial = OddTransition(self.state, "marked odd" if odd else "not odd")

    @property
    def odd(self) -> bool:
        """Whether the request was marked odd."""
        return self.state is not OddState.NOT_ODD

    def kv_landed(self) -> OddTransition | None:
        """Main decode holds the whole prompt KV."""
        if self.state is not OddState.RELAYING:
            return None
        return self._move(OddState.KV_LANDED_FIRST, "main decode's KV complete before the relay finished")

    def relay_finished(self) -> OddTransition | None:
        """The relay ended the request; a transition (not None) means: cancel the WAN transfer now."""
        if self.state is not OddState.RELAYING:
            return None
        return self._move(OddState.WAN_CANCELLED, "relay finished before main decode's KV was complete")

    def _move(self, state: OddState, why: str) -> OddTransition:
        self.state = state
        return OddTransition(state, why)
