"""The sampler: a sequence's logits row in, its next token (and log-probabilities) out.

Penalties and ``min_tokens`` shape the row first (``logits_processing``), then the token is
drawn from ``(seed, index)`` (``sampling.sample_token``), so any instance that holds the same
tokens draws the same next one. Log-probabilities come from the raw row, as in vLLM.
"""

import torch

from shared.engine import logits_processing
from shared.engine.logprobs import TokenLogprobs, token_logprobs
from shared.engine.sampling import sample_token
from shared.engine.sequence import Sequence
from shared.errors import SamplingFailed


class Sampler:
    """Draws each sequence's next token from its logits row."""

    def __init__(self, eos_token_ids: frozenset[int] | set[int]):
        self._eos_ids = eos_token_ids

    def sample(self, seq: Sequence, logits: torch.Tensor) -> tuple[int, TokenLogprobs | None]:
        """The next token of ``seq`` and, when the request asked for them, its log-probabilities.

        Raises:
            SamplingFailed: The model's row is not finite, or no token can be drawn from it.
        """
        if not bool(torch.isfinite(logits).all()):
            raise SamplingFailed("the model produced non-finite logits")
        params = seq.sampling
        processed = logits_processing.apply(logits, params, seq.token_ids, seq.num_prompt_tokens, self._eos_ids)
        token = sample_token(processed, params, seq.seed, len(seq.output_token_ids))
        logprobs = token_logprobs(logits, token, params.logprobs) if params.logprobs is not None else None
        return token, logprobs
