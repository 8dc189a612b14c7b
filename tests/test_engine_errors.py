"""Misuse of the engine gets typed errors, and nothing leaks: every freed request returns its blocks."""

import pytest

from shared.engine.hf_engine import HfEngine
from shared.engine.sampling import SamplingParams
from shared.errors import ContextLengthExceeded, InvalidRequestState, OutOfKvBlocks, UnknownRequest
from tests.helpers import prompt_of_length

SAMPLING = SamplingParams(max_tokens=8, ignore_eos=True)


def test_prompt_longer_than_context(tiny):
    engine = HfEngine(tiny, num_blocks=8)
    with pytest.raises(ContextLengthExceeded):
        engine.add_request("r", [1] * 4090, SamplingParams(max_tokens=10))
    assert engine.num_sequences == 0


def test_duplicate_and_unknown_request_ids(tiny):
    engine = HfEngine(tiny, num_blocks=8)
    engine.add_request("r", [1, 2, 3], SAMPLING)
    with pytest.raises(InvalidRequestState):
        engine.add_request("r", [1, 2, 3], SAMPLING)
    with pytest.raises(UnknownRequest):
        engine.free("nope")
    with pytest.raises(ValueError):
        engine.add_request("empty", [], SAMPLING)


def test_extend_requires_an_idle_running_sequence(tiny):
    engine = HfEngine(tiny, num_blocks=12)
    engine.add_request("r", [1, 2, 3], SAMPLING)
    with pytest.raises(InvalidRequestState):
        engine.extend("r", [4])  # prompt still pending
    engine.begin_import("m", [1, 2, 3], SAMPLING)
    with pytest.raises(InvalidRequestState, match="importing"):
        engine.extend("m", [4])
    engine.finish_import("m", [])  # the prompt tail was not imported: it is pending now
    engine.step()
    assert engine.get("m").num_kv_tokens == 3
    engine.free("m")
    engine.step()
    with pytest.raises(InvalidRequestState, match="pending"):
        engine.extend("r", [4])  # r has its sampled token pending
    engine.add_request("src", [7] * 17, SAMPLING)
    engine.step()  # caches the block of sixteen 7s
    assert engine.begin_import("i", [7] * 16, SAMPLING) == 16  # whole prompt from the cache
    engine.finish_import("i", [])  # parked: idle until a relay hands tokens over
    with pytest.raises(InvalidRequestState, match="max_tokens"):
        engine.extend("i", [4] * 9)
    with pytest.raises(ValueError):
        engine.extend("i", [])
    engine.extend("i", [4, 5])
    assert engine.get("i").num_pending_tokens == 2


def test_import_reserve_fails_cleanly_when_pool_is_full(tiny):
    engine = HfEngine(tiny, num_blocks=4)
    with pytest.raises(OutOfKvBlocks):
        engine.begin_import("r", prompt_of_length(tiny, 100), SAMPLING)
    assert engine.num_sequences == 0
    assert engine.blocks.num_free_blocks == 4


def test_request_that_can_never_fit_fails_with_error_output(tiny):
    engine = HfEngine(tiny, num_blocks=2)
    engine.add_request("r", prompt_of_length(tiny, 60), SAMPLING)
    outputs = engine.step()
    assert len(outputs) == 1 and outputs[0].finish_reason == "error"
    assert "out of KV blocks" in outputs[0].error
    assert not engine.has_work()
    engine.free("r")
    assert engine.blocks.num_free_blocks == 2


def test_starved_request_waits_for_blocks_instead_of_failing(tiny):
    engine = HfEngine(tiny, num_blocks=6)
    engine.add_request("a", prompt_of_length(tiny, 60), SAMPLING)  # 4 blocks + growth
    engine.add_request("b", prompt_of_length(tiny, 60, seed=1), SAMPLING)
    finished = {}
    while engine.has_work():
        for out in engine.step():
            assert out.finish_reason != "error"
            if out.finished:
                finished[out.request_id] = out.finish_reason
                engine.free(out.request_id)
    assert finished == {"a": "length", "b": "length"}


def test_freeing_every_request_returns_every_block(tiny):
    engine = HfEngine(tiny, num_blocks=40)
    for i in range(5):
        engine.add_request(f"r{i}", prompt_of_length(tiny, 30 + 7 * i, seed=i), SAMPLING)
    for _ in range(3):
        engine.step()
    for i in range(5):
        engine.free(f"r{i}")
    assert engine.blocks.num_used_blocks == 0
    assert engine.blocks.num_available_blocks == 40


def test_a_pool_that_runs_out_mid_decode_preempts_and_every_output_stays_exact(tiny):
    from shared.engine.sampling import SamplingParams
    from tests.helpers import prompt_of_length, reference_greedy

    # 12 blocks of 16 tokens: three 40-token prompts fit, their 60 outputs each do not.
    engine = HfEngine(tiny, num_blocks=12, block_size=16)
    prompts = [prompt_of_length(tiny, 40, seed=i) for i in range(3)]
    params = SamplingParams(max_tokens=60, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
    done = {}
    while len(done) < len(prompts):
        for out in engine.step():
            assert out.finish_reason != "error", out.error
            if out.finished:
                done[out.request_id] = engine.get(out.request_id).output_token_ids
                engine.free(out.request_id)
    assert engine.num_preemptions >= 1
    for i, prompt in enumerate(prompts):
        assert done[f"r{i}"] == reference_greedy(tiny, prompt, 60)
