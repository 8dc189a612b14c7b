"""What a decoding service knows of a request's output, for a producer's resend.

Tokens are delivered at least once: a producer answers ``ResendTokens`` from the live
sequence or, once the request ended here, from a short record of its output.
"""

from collections import OrderedDict
from typing import NamedTuple

from shared.engine.backend import EngineBackend, RequestView
from shared.engine.logprobs import TokenLogprobs

RECENT_OUTPUTS = 512
"""Finished requests whose output a producer keeps for resends."""


class KnownOutputs(NamedTuple):
    """A request's output as this instance knows it, for a resend."""

    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[TokenLogprobs | None] | None


def logprobs_of(view: RequestView) -> list[TokenLogprobs | None] | None:
    """The request's per-token log-probabilities, or None when it did not ask for them."""
    return list(view.output_logprobs) if view.output_logprobs is not None else None


def live_outputs(engine: EngineBackend, request_id: str) -> KnownOutputs | None:
    """A live sequence's output so far (call it on the engine thread)."""
    seq = engine.request(request_id)
    if seq is None:
        return None
    return KnownOutputs(list(seq.output_token_ids), None, logprobs_of(seq))


class RecentOutputs:
    """The output of the last ``capacity`` requests that ended here with ``stop`` or ``length``."""

    def __init__(self, capacity: int = RECENT_OUTPUTS):
        self.capacity = capacity
        self._outputs: OrderedDict[str, KnownOutputs] = OrderedDict()

    def remember(self, view: RequestView):
        """Keep a freed sequence's output (one that failed or was cut short is not worth a resend)."""
        if view.finish_reason in ("stop", "length"):
            self._outputs[view.request_id] = KnownOutputs(
                list(view.output_token_ids), view.finish_reason, logprobs_of(view)
            )
            while len(self._outputs) > self.capacity:
                self._outputs.popitem(last=False)

    def get(self, request_id: str) -> KnownOutputs | None:
        """The output of ``request_id`` if it ended here recently."""
        return self._outputs.get(request_id)
