"""Exactness with the real SmolLM2-135M (fp32): KV shipping, relay handoff, prefix reuse."""

import pytest
import torch

from shared.engine.hf_engine import HfEngine
from shared.engine.sampling import SamplingParams
from shared.model_loader import load_model
from tests.helpers import prompt_of_length, reference_greedy, relay_with_main, run_to_end, ship

pytestmark = pytest.mark.real_model

PROMPT_LEN = 520
NEW_TOKENS = 88  # covers the longest relay (64) plus 24 tokens decoded after the handoff


@pytest.fixture(scope="module")
def prompt(smollm2):
    return prompt_of_length(smollm2, PROMPT_LEN)


@pytest.fixture(scope="module")
def reference(smollm2, prompt):
    return reference_greedy(smollm2, prompt, NEW_TOKENS)


def test_long_prompt_shipped_to_separately_loaded_engine(smollm2, prompt, reference):
    sampling = SamplingParams(max_tokens=40, ignore_eos=True)
    prefill = HfEngine(smollm2, num_blocks=64)
    decode = HfEngine(load_model("smollm2"), num_blocks=64)
    prefill.add_request("r", prompt, sampling)
    first = prefill.step()[0].token_id
    decode.begin_import("r", prompt, sampling)
    ship(prefill, decode, "r", 0, max_tokens_per_frame=128)
    prefill.free("r")
    decode.finish_import("r", [first])
    assert run_to_end(decode, "r") == reference[:40]
    assert decode.get("r").num_computed_tokens == 39


@pytest.mark.parametrize("num_relay_tokens", [16, 64])
def test_relay_handoff_by_token_ids(smollm2, prompt, reference, num_relay_tokens):
    sampling = SamplingParams(max_tokens=num_relay_tokens + 24, ignore_eos=True)
    relay, main = relay_with_main(smollm2, prompt, sampling)
    while len(relay.get("r").output_token_ids) < num_relay_tokens:
        relay.step()
    relay_seq = relay.get("r")
    main.extend("r", relay_seq.output_token_ids)
    assert run_to_end(main, "r") == reference[: sampling.max_tokens]
    relay_kv = relay.pool.export_tokens(relay_seq.block_ids, relay_seq.num_kv_tokens)
    main_kv = main.pool.export_tokens(main.get("r").block_ids, relay_seq.num_kv_tokens)
    torch.testing.assert_close(main_kv, relay_kv, rtol=1e-3, atol=1e-3)


def test_multi_turn_prefix_reuse(smollm2, prompt, reference):
    """A follow-up turn re-sends the first turn and its answer: only the new part is computed."""
    sampling = SamplingParams(max_tokens=24, ignore_eos=True)
    engine = HfEngine(smollm2, num_blocks=96)
    first_answer = engine.generate("t1", prompt, sampling)
    assert first_answer == reference[:24]
    follow_up = (
        prompt
        + first_answer
        + smollm2.tokenizer.encode("<|im_end|>\n<|im_start|>user\nShorter, please.<|im_end|>\n<|im_start|>assistant\n")
    )
    engine.add_request("t2", follow_up, sampling)
    seq = engine.get("t2")  # the live sequence, to watch its counters
    assert seq.num_cached_tokens >= PROMPT_LEN // 16 * 16
    assert run_to_end(engine, "t2") == reference_greedy(smollm2, follow_up, 24)
    assert seq.num_computed_tokens < len(follow_up) - PROMPT_LEN + 24


def test_stops_at_eos_like_transformers(smollm2):
    prompt = smollm2.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Say hello in three words."}],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
    )
    engine = HfEngine(smollm2, num_blocks=16)
    engine.add_request("r", prompt, SamplingParams(max_tokens=64))
    outputs = []
    while engine.has_work():
        outputs.extend(engine.step())
    tokens = [o.token_id for o in outputs]
    assert tokens == reference_greedy(smollm2, prompt, 64, stop_at_eos=True)
    assert tokens[-1] == smollm2.tokenizer.eos_token_id and len(tokens) < 64
    assert outputs[-1].finish_reason == "stop"
