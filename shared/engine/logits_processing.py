"""What changes a request's logits before sampling: penalties and ``min_tokens``.

The rules are vLLM's: the repetition penalty covers prompt and output tokens, the frequency
and presence penalties the output only, applied in that order; before ``min_tokens`` outputs
the end-of-sequence tokens cannot be drawn. Each depends only on the tokens a sequence holds,
so a relay and the main decoder that continues after it compute the same logits.
"""

import torch

from shared.engine.sampling import SamplingParams


def apply(
    logits: torch.Tensor,
    params: SamplingParams,
    token_ids: list[int],
    num_prompt_tokens: int,
    eos_token_ids: frozenset[int] | set[int],
) -> torch.Tensor:
    """The logits row ``params`` samples from, given the sequence's tokens so far.

    Args:
        logits: Raw next-token logits, shape ``[vocab]`` (not modified).
        params: The request's sampling parameters.
        token_ids: Prompt followed by the output tokens so far.
        num_prompt_tokens: Length of the prompt prefix of ``token_ids``.
        eos_token_ids: Tokens that end a sequence.
    """
    num_outputs = len(token_ids) - num_prompt_tokens
    masks_eos = num_outputs < params.min_tokens and not params.ignore_eos
    if not params.penalised and not masks_eos:
        return logits
    logits = logits.float().clone()
    vocab = logits.numel()
    if params.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(token_ids)), dtype=torch.long)
        seen = seen[seen < vocab]
        values = logits[seen]
        logits[seen] = torch.where(values > 0, values / params.repetition_penalty, values * params.repetition_penalty)
    if num_outputs and (params.frequency_penalty or params.presence_penalty):
        counts = torch.bincount(torch.tensor(token_ids[num_prompt_tokens:], dtype=torch.long), minlength=vocab)[
            :vocab
        ].float()
        logits -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).float()
    if masks_eos:
        logits[[t for t in eos_token_ids if t < vocab]] = float("-inf")
    return logits
