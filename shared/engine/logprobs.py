"""Per-token log-probabilities, as OpenAI's ``logprobs`` reports them.

They are the model's own distribution (log-softmax of the raw logits, before penalties,
temperature or truncation), as in vLLM's default ``raw_logprobs`` mode: the same values
``transformers`` gives for the same positions.
"""

import msgspec
import torch


class TokenLogprobs(msgspec.Struct, frozen=True, array_like=True):
    """One output token's log-probability and its most likely alternatives.

    Attributes:
        logprob: Log-probability of the token that was chosen.
        top_token_ids: The most likely tokens, most likely first.
        top_logprobs: Their log-probabilities, aligned with ``top_token_ids``.
    """

    logprob: float
    top_token_ids: tuple[int, ...] = ()
    top_logprobs: tuple[float, ...] = ()


def token_logprobs(logits: torch.Tensor, token_id: int, num_top: int) -> TokenLogprobs:
    """The chosen token's log-probability and the ``num_top`` most likely, from raw logits."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    top = torch.topk(logprobs, num_top) if num_top else None
    return TokenLogprobs(
        logprob=float(logprobs[token_id]),
        top_token_ids=tuple(top.indices.tolist()) if top is not None else (),
        top_logprobs=tuple(top.values.tolist()) if top is not None else ())
