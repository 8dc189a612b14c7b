"""The sampler: a sequence's logits row in, its next token (and log-probabilities) out.

Penalties and ``min_tokens`` shape the row first (``logits_processing``), then the token is
drawn from ``(seed, index)`` (``sample_token``), so any instance that holds the same
tokens draws the same next one. Log-probabilities come from the raw row, as in vLLM.
"""

from dataclasses import dataclass

import torch
import xxhash

from shared.engine import logits_processing
from shared.engine.logprobs import TokenLogprobs
from shared.engine.sampling import SamplingParams
from shared.engine.sequence import Sequence
from shared.errors import SamplingFailed


@dataclass(frozen=True)
class RowFacts:
    """What one pass over a step's whole logits matrix says about one row.

    Attributes:
        finite: Every logit of the row is finite.
        argmax: The row's greedy token (the first of equal maxima).
    """

    finite: bool
    argmax: int


def row_facts(logits: torch.Tensor) -> list[RowFacts]:
    """``RowFacts`` of every row of ``[rows, vocab]`` logits, in two batched passes."""
    finite = torch.isfinite(logits).all(dim=1).tolist()
    argmax = logits.argmax(dim=1).tolist()
    return [RowFacts(f, a) for f, a in zip(finite, argmax, strict=True)]


class Sampler:
    """Draws each sequence's next token from its logits row."""

    def __init__(self, eos_token_ids: frozenset[int] | set[int]):
        self._eos_ids = eos_token_ids

    def sample(
        self, seq: Sequence, logits: torch.Tensor, facts: RowFacts | None = None
    ) -> tuple[int, TokenLogprobs | None]:
        """The next token of ``seq`` and, when the request asked for them, its log-probabilities.

        ``facts``: the row's ``row_facts``, when the caller computed them for the whole step.

        Raises:
            SamplingFailed: The model's row is not finite, or no token can be drawn from it.
        """
        finite = facts.finite if facts is not None else bool(torch.isfinite(logits).all())
        if not finite:
            raise SamplingFailed("the model produced non-finite logits")
        params = seq.sampling
        processed = logits_processing.apply(logits, params, seq.token_ids, seq.num_prompt_tokens, self._eos_ids)
        if facts is not None and params.greedy and processed is logits:
            token = facts.argmax  # an unchanged, finite row: its argmax is the greedy token
        else:
            token = sample_token(processed, params, seq.seed, len(seq.output_token_ids))
        logprobs = token_logprobs(logits, token, params.logprobs) if params.logprobs is not None else None
        return token, logprobs


def sample_token(logits: torch.Tensor, params: SamplingParams, seed: int, token_index: int) -> int:
    """Pick one token from a 1-D logits row (after ``logits_processing.apply``).

    Args:
        logits: Next-token logits, shape ``[vocab]``.
        params: The request's sampling parameters.
        seed: The request's effective seed (``params.seed`` or one the engine chose).
        token_index: Index of the token being sampled among the request's outputs.

    Raises:
        SamplingFailed: The row holds no finite logit to draw from.
    """
    if params.greedy:
        if not bool(torch.isfinite(logits).any()):
            raise SamplingFailed("no finite logit to choose from")
        return int(torch.argmax(logits))
    logits = logits.float() / params.temperature
    if 0 < params.top_k < logits.numel():
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, sorted_ids = torch.sort(probs, descending=True)
        # Keep the smallest prefix whose mass reaches top_p (always at least one token).
        outside = torch.cumsum(sorted_probs, dim=-1) - sorted_probs >= params.top_p
        outside[0] = False  # a top_p below float32's resolution still keeps the top token
        sorted_probs[outside] = 0.0
        probs = torch.zeros_like(probs).scatter_(0, sorted_ids, sorted_probs)
    if not bool(torch.isfinite(probs).all()) or not float(probs.sum()) > 0:
        raise SamplingFailed("the sampling distribution is not finite")
    generator = torch.Generator(device="cpu")
    generator.manual_seed(xxhash.xxh3_64_intdigest(f"{seed}:{token_index}".encode()) >> 1)
    return int(torch.multinomial(probs.cpu(), 1, generator=generator))


def token_logprobs(logits: torch.Tensor, token_id: int, num_top: int) -> TokenLogprobs:
    """The chosen token's log-probability and the ``num_top`` most likely, from raw logits."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    top = torch.topk(logprobs, num_top) if num_top else None
    return TokenLogprobs(
        logprob=float(logprobs[token_id]),
        top_token_ids=tuple(top.indices.tolist()) if top is not None else (),
        top_logprobs=tuple(top.values.tolist()) if top is not None else (),
    )
