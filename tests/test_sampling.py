"""Sampling and stopping: greedy, seeded, top-p, EOS, max tokens, stop strings."""

import pytest
import torch

from shared.engine.hf_engine import HfEngine
from shared.engine.sampler import sample_token
from shared.engine.sampling import SamplingParams
from tests.helpers import prompt_of_length, reference_greedy, ship


def test_greedy_is_argmax():
    logits = torch.tensor([0.1, 3.0, -1.0, 2.9])
    assert sample_token(logits, SamplingParams(), seed=1, token_index=0) == 1


def test_seeded_sampling_depends_only_on_seed_and_index():
    logits = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    params = SamplingParams(temperature=1.0)
    draws = [sample_token(logits, params, seed=42, token_index=i) for i in range(20)]
    assert draws == [sample_token(logits, params, seed=42, token_index=i) for i in range(20)]
    assert draws != [sample_token(logits, params, seed=43, token_index=i) for i in range(20)]
    assert len(set(draws)) > 5


def test_tiny_top_p_keeps_only_the_top_token():
    logits = torch.randn(1000, generator=torch.Generator().manual_seed(1))
    params = SamplingParams(temperature=1.0, top_p=1e-6)
    assert {sample_token(logits, params, seed=s, token_index=0) for s in range(10)} == {int(torch.argmax(logits))}


@pytest.mark.parametrize(
    "field,value",
    [
        ("max_tokens", 0),
        ("temperature", -0.5),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("stop", ("",)),
    ],
)
def test_invalid_sampling_names_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value}).validate()


def test_seeded_sampling_survives_a_relay_handoff(tiny):
    """Sampled (not just greedy) output is the same whether or not a relay produced a prefix."""
    prompt = prompt_of_length(tiny, 50)
    sampling = SamplingParams(max_tokens=30, temperature=0.9, top_p=0.95, seed=7, ignore_eos=True)
    alone = HfEngine(tiny, num_blocks=32).generate("r", prompt, sampling)
    relay, main = HfEngine(tiny, num_blocks=32), HfEngine(tiny, num_blocks=32)
    relay.add_request("r", prompt, sampling)
    for _ in range(10):
        relay.step()
    main.begin_import("r", prompt, sampling, seed=relay.get("r").seed)
    ship(relay, main, "r", 0)
    main.finish_import("r", relay.get("r").output_token_ids)
    while main.has_work():
        main.step()
    assert main.get("r").output_token_ids == alone


def test_max_tokens_and_finish_reasons(tiny):
    engine = HfEngine(tiny, num_blocks=32)
    prompt = prompt_of_length(tiny, 30)
    engine.add_request("r", prompt, SamplingParams(max_tokens=3, ignore_eos=True))
    outputs = []
    while engine.has_work():
        outputs.extend(engine.step())
    assert [o.token_index for o in outputs] == [0, 1, 2]
    assert [o.finished for o in outputs] == [False, False, True]
    assert outputs[-1].finish_reason == "length"


def test_stop_string(tiny):
    prompt = prompt_of_length(tiny, 30)
    free_run = HfEngine(tiny, num_blocks=32).generate("a", prompt, SamplingParams(max_tokens=12, ignore_eos=True))
    stop_text = tiny.tokenizer.decode(free_run[5:7], skip_special_tokens=True).strip()
    assert stop_text
    engine = HfEngine(tiny, num_blocks=32)
    engine.add_request("b", prompt, SamplingParams(max_tokens=12, ignore_eos=True, stop=(stop_text,)))
    outputs = []
    while engine.has_work():
        outputs.extend(engine.step())
    assert outputs[-1].finish_reason == "stop"
    assert len(outputs) <= 7
    text = tiny.tokenizer.decode([o.token_id for o in outputs], skip_special_tokens=True)
    assert stop_text in text
    assert reference_greedy(tiny, prompt, len(outputs)) == [o.token_id for o in outputs]
