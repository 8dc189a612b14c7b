"""Prefill's shipping plan: which receivers get a prompt's KV, what ends each flow, what to export.

Pure decisions, no I/O; ``PrefillService`` carries them out over the bulk channel.

- **Receivers.** P→MD ships to main decode over the WAN; P→RLD→MD to main decode over the
  WAN and to the relay over the local path; P→RLD (no main decoder reachable) to the relay
  only.
- **End tokens.** A flow ends with the output tokens its receiver starts from: the first
  token the prefill sampled (and its log-probabilities); for a recovered request, the
  tokens the client already has instead; for a main decoder behind a relay, none (it waits
  for the relay's handoff).
- **Exports.** Each receiver asks for the blocks from where its own cache ends; receivers
  that start at the same block share one export, and one whose cache covers the whole
  prompt needs none.
"""

from dataclasses import dataclass

from shared.engine.logprobs import TokenLogprobs
from shared.errors import InvalidRequestState
from shared.messages import InstanceRef, StartPrefill


@dataclass(frozen=True)
class ShippingPath:
    """One flow of the plan.

    Attributes:
        path: ``wan`` or ``local``.
        receiver: The decoder that receives the KV.
        role: What the receiver acts as (``main_decode`` or ``relay_decode``).
    """

    path: str
    receiver: InstanceRef
    role: str


@dataclass(frozen=True)
class ExportRange:
    """Prompt tokens ``[start, end)`` to export as frames (one export may serve two flows)."""

    start: int
    end: int


class ShippingPlan:
    """The plan of one ``StartPrefill``."""

    def __init__(self, cmd: StartPrefill):
        """Raises ``InvalidRequestState`` when the pipeline lacks a decoder it needs."""
        self._cmd = cmd
        self.paths = _paths(cmd)

    def end_tokens(
        self, role: str, first_token: int, first_logprobs: TokenLogprobs | None
    ) -> tuple[list[int], list[TokenLogprobs]]:
        """The output tokens (and their log-probabilities) that end the flow to ``role``."""
        cmd = self._cmd
        if role == "main_decode" and cmd.pipeline == "P-RLD-MD":
            return [], []
        if cmd.resume_token_ids:
            return list(cmd.resume_token_ids), []
        return [first_token], [first_logprobs] if first_logprobs is not None else []

    def export_range(self, receiver_start: int) -> ExportRange | None:
        """What to export for a receiver whose cache ends at ``receiver_start``; None: nothing.
        Equal ranges are one export."""
        num_prompt_tokens = len(self._cmd.token_ids)
        if receiver_start >= num_prompt_tokens:
            return None
        return ExportRange(receiver_start, num_prompt_tokens)


def _paths(cmd: StartPrefill) -> list[ShippingPath]:
    paths = []
    if cmd.pipeline != "P-RLD":
        if cmd.main_decode is None:
            raise InvalidRequestState(f"pipeline {cmd.pipeline} needs a main decoder")
        paths.append(ShippingPath("wan", cmd.main_decode, "main_decode"))
    if cmd.pipeline != "P-MD":
        if cmd.relay_decode is None:
            raise InvalidRequestState(f"pipeline {cmd.pipeline} needs a relay decoder")
        paths.append(ShippingPath("local", cmd.relay_decode, "relay_decode"))
    return paths
