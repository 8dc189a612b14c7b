"""Per-token log-probabilities, as OpenAI's ``logprobs`` reports them.

They are the model's own distribution (log-softmax of the raw logits, before penalties,
temperature or truncation), as in vLLM's default ``raw_logprobs`` mode: the same values
``transformers`` gives for the same positions.
"""

import msgspec


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
