"""The sampler: penalties shape the row, (seed, index) fixes the draw, logprobs are the raw row's."""

import pytest
import torch

from shared.engine.sampler import Sampler, row_facts
from shared.engine.sampling import SamplingParams
from shared.engine.sequence import Sequence
from shared.errors import SamplingFailed


def seq(params: SamplingParams, outputs: list[int] = (), seed: int = 5) -> Sequence:
    prompt = [3]
    return Sequence("r", prompt + list(outputs), len(prompt), params, seed=seed)


def test_greedy_takes_the_argmax_and_a_repetition_penalty_can_change_it():
    logits = torch.tensor([0.0, 2.0, 1.9, 0.5])
    sampler = Sampler(eos_token_ids={0})
    assert sampler.sample(seq(SamplingParams()), logits) == (1, None)
    penalised = SamplingParams(repetition_penalty=2.0)
    assert sampler.sample(seq(penalised, outputs=[1]), logits)[0] == 2


def test_a_seeded_draw_depends_only_on_seed_and_index():
    logits = torch.randn(50, generator=torch.Generator().manual_seed(0))
    params = SamplingParams(temperature=1.0)
    a, b = Sampler(eos_token_ids=set()), Sampler(eos_token_ids=set())
    assert a.sample(seq(params, [7, 8]), logits) == b.sample(seq(params, [9, 9]), logits)
    draws = {a.sample(seq(params, [7] * n), logits)[0] for n in range(12)}
    assert len(draws) > 1  # other indices draw other tokens


def test_logprobs_are_the_raw_rows_even_when_min_tokens_masks_eos():
    logits = torch.tensor([3.0, 1.0, 0.0])
    token, logprobs = Sampler(eos_token_ids={0}).sample(seq(SamplingParams(min_tokens=2, logprobs=1)), logits)
    assert token == 1  # EOS (0) is masked before min_tokens
    raw = torch.log_softmax(logits, dim=-1)
    assert logprobs.logprob == float(raw[1]) and logprobs.top_token_ids == (0,)


def test_a_step_s_batched_row_facts_give_the_tokens_each_row_gives_alone():
    """The engine samples with facts computed over the whole logits matrix at once; greedy,
    penalised, seeded and non-finite rows give what sampling each row alone gives."""
    logits = torch.randn(4, 32)
    logits[3, 5] = float("nan")
    facts = row_facts(logits)
    sampler = Sampler(eos_token_ids={0})
    cases = [SamplingParams(), SamplingParams(repetition_penalty=1.5), SamplingParams(temperature=0.7, seed=3)]
    for row, params in enumerate(cases):
        s = seq(params, [int(logits[row].argmax())])
        assert sampler.sample(s, logits[row], facts[row]) == sampler.sample(s, logits[row])
    with pytest.raises(SamplingFailed):
        sampler.sample(seq(SamplingParams()), logits[3], facts[3])
