"""Prefill's shipping plan: which receivers get a prompt's KV, what ends each flow, what to export.

Pure decisions, no I/O; ``PrefillService`` carries them out over the bulk channel.

- **Receivers.** P→MD ships to main decode over the WAN; P→RLD→MD to main decode over the
  WAN and to the relay over the local path; P→RLD (no main decoder reachable) to the relay
  only.
- **End tokens.** A flow ends with the output tokens its receiver starts from: the first
  token the prefill sampled (and its log-probabilities); for a recovered request, the
  tokens the client already has instead; for a main decoder behind a relay, none (it waits
  for the relay's handoff).
- **Exports.** Each receiver gets the blocks from where its own cache ends. While the prompt
  computes chunk by chunk, each path's next export runs from where its last one ended to
  the last complete block with KV; once the prompt is computed, to the prompt's end (its
  partial last block included). Receivers that stand at the same token get equal ranges
  (one export serves both), and one whose cache covers the whole prompt needs none. Odd
  traffic's WAN path waits for the whole prompt: the router cancels it if the relay wins.
"""

from dataclasses import dataclass

from shared.engine.logprobs import TokenLogprobs
from shared.errors import InvalidRequestState
from shared.messages import InstanceRef, StartPrefill


@dataclass(frozen=True)
class ShippingPath:
    """One flow of the plan.

    Attributes:
        path: ``wan`` (the flow to main decode) or ``local`` (to the relay); the network it
            takes is ``network``'s.
        receiver: The decoder that receives the KV.
        role: What the receiver acts as (``main_decode`` or ``relay_decode``).
    """

    path: str
    receiver: InstanceRef
    role: str

    def network(self, site: str) -> str:
        """The network a flow from ``site`` takes: ``wan`` to a receiver at another site, else
        ``local`` (a main decoder beside the prefill, as in the same-site baseline)."""
        return "wan" if self.receiver.site != site else "local"


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

    def next_export(
        self, path: str, exported_to: int, num_kv_tokens: int, prompt_computed: bool, block_size: int
    ) -> ExportRange | None:
        """``path``'s next export: from ``exported_to`` (where its exports, or its receiver's
        cache, end) to the last complete block below ``num_kv_tokens`` (the KV computed so
        far), or to the prompt's end once ``prompt_computed``; None when nothing new. A WAN
        path the router asked to wait (``wan_after_prompt``) ships only the whole prompt."""
        num_prompt_tokens = len(self._cmd.token_ids)
        if path == "wan" and self._cmd.wan_after_prompt and not prompt_computed:
            return None
        if prompt_computed:
            reach = num_prompt_tokens
        else:
            reach = min(num_kv_tokens // block_size * block_size, num_prompt_tokens)
        return ExportRange(exported_to, reach) if reach > exported_to else None


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
