"""Exactness of the engine against transformers' own greedy generate (tiny model, fp32).

These are the properties PDD rests on: KV shipped between instances resumes exactly, a
decoder holding only prompt KV takes over from a relay given token IDs, shared prefixes
are reused block by block, and continuous batching does not change anyone's tokens.
"""

import pytest
import torch

from shared.engine import paged_kernel
from shared.engine.hf_engine import HfEngine
from shared.engine.sampling import SamplingParams
from shared.kv_layout import KvLayout
from shared.kv_wire import decode_frame, frame_bytes
from shared.model_loader import load_model
from tests.helpers import prompt_of_length, reference_greedy, relay_with_main, run_to_end, ship

GREEDY = SamplingParams(max_tokens=48, ignore_eos=True)


# The in-place kernel as the engine picks it (the widest build), every narrower build this CPU
# also runs (AVX2 on an AVX-512 machine), and gather + SDPA (where no build can be had).
KERNEL_PATHS = ["in_place_kernel", *(f"in_place_{isa.name}" for isa in paged_kernel.cpu_isas()[1:]), "gather_sdpa"]


@pytest.fixture(autouse=True, params=KERNEL_PATHS)
def attention_path(request, monkeypatch):
    """Every test runs on every attention path this machine has."""
    monkeypatch.delenv("PDD_PAGED_KERNEL", raising=False)
    if request.param == "gather_sdpa":
        monkeypatch.setenv("PDD_PAGED_KERNEL", "0")
    elif not any(paged_kernel.load(isa.name) for isa in paged_kernel.cpu_isas()):
        pytest.skip("the in-place kernel cannot be built here")
    else:
        if request.param != "in_place_kernel":
            monkeypatch.setenv("PDD_PAGED_KERNEL", request.param.removeprefix("in_place_"))
        # The build the engines of this test will run, for the tiny model's head size.
        expected = request.param.removeprefix("in_place_") if request.param != "in_place_kernel" else None
        head_dim = KvLayout.from_model(request.getfixturevalue("tiny").model, 16).head_dim
        chosen = paged_kernel.kernel_for(torch.zeros(1, 1, 16, head_dim), head_dim)
        assert chosen is not None and chosen.isa.name == (expected or paged_kernel.cpu_isas()[0].name)
    return request.param


@pytest.mark.parametrize("prompt_len", [5, 16, 33, 200])
def test_engine_generate_matches_transformers(tiny, prompt_len):
    prompt = prompt_of_length(tiny, prompt_len, seed=prompt_len)
    engine = HfEngine(tiny, num_blocks=64)
    assert engine.generate("r", prompt, GREEDY) == reference_greedy(tiny, prompt, GREEDY.max_tokens)


@pytest.mark.parametrize("tokens_per_frame", [16, 48, 512])
def test_prefill_export_import_decode_on_separately_loaded_engine(tiny, tokens_per_frame):
    prompt = prompt_of_length(tiny, 150)
    engine_a = HfEngine(tiny, num_blocks=64)
    engine_b = HfEngine(load_model("tiny"), num_blocks=64)
    engine_a.add_request("r", prompt, GREEDY)
    first = engine_a.step()[0].token_id
    assert engine_b.begin_import("r", prompt, GREEDY) == 0
    num_frames = ship(engine_a, engine_b, "r", 0, tokens_per_frame)
    assert num_frames == -(-len(prompt) // max(16, tokens_per_frame - tokens_per_frame % 16))
    engine_b.finish_import("r", [first])
    output = run_to_end(engine_b, "r")
    assert output == reference_greedy(tiny, prompt, GREEDY.max_tokens)
    seq_b = engine_b.get("r")
    assert seq_b.num_imported_tokens == len(prompt)
    # B computed only the decode steps, never the prompt.
    assert seq_b.num_computed_tokens == GREEDY.max_tokens - 1


def test_import_with_held_back_tail_recomputes_it(tiny):
    """The sender may ship only full blocks; the receiver extends over the tail itself."""
    prompt = prompt_of_length(tiny, 70)  # 4 full blocks + 6-token tail
    engine_a, engine_b = HfEngine(tiny, num_blocks=32), HfEngine(tiny, num_blocks=32)
    engine_a.add_request("r", prompt, GREEDY)
    first = engine_a.step()[0].token_id
    engine_b.begin_import("r", prompt, GREEDY)
    full_frames = engine_a.export_frames("r", 0, max_tokens_per_frame=64)[:1]
    engine_b.import_frame(decode_frame(bytearray(frame_bytes(full_frames[0])), engine_b.frame_expectation))
    engine_b.finish_import("r", [first])
    assert run_to_end(engine_b, "r") == reference_greedy(tiny, prompt, GREEDY.max_tokens)
    assert engine_b.get("r").num_imported_tokens == 64


@pytest.mark.parametrize("num_relay_tokens", [1, 16, 64, 100])
def test_relay_handoff_by_token_ids(tiny, num_relay_tokens):
    prompt = prompt_of_length(tiny, 90)
    sampling = SamplingParams(max_tokens=num_relay_tokens + 24, ignore_eos=True)
    relay, main = HfEngine(tiny, num_blocks=64), HfEngine(tiny, num_blocks=64)
    relay.add_request("r", prompt, sampling)
    main.begin_import("r", prompt, sampling)
    while len(relay.get("r").output_token_ids) < num_relay_tokens:
        relay.step()
        if len(relay.get("r").output_token_ids) == 1:
            ship(relay, main, "r", 0)
    relay_tokens = relay.get("r").output_token_ids
    main.finish_import("r", [])
    main.extend("r", relay_tokens)
    outputs = main.step()
    # The handed-over tokens are absorbed in one forward pass that also samples the next.
    assert [o.token_index for o in outputs] == [num_relay_tokens]
    assert main.get("r").num_computed_tokens == num_relay_tokens
    output = run_to_end(main, "r")
    assert output == reference_greedy(tiny, prompt, sampling.max_tokens)
    relay_kv = relay.pool.export_tokens(relay.get("r").block_ids, relay.get("r").num_kv_tokens)
    main_kv = main.pool.export_tokens(main.get("r").block_ids, relay.get("r").num_kv_tokens)
    torch.testing.assert_close(main_kv, relay_kv, rtol=1e-3, atol=1e-3)


def test_prefix_reuse_computes_only_the_suffix(tiny):
    engine = HfEngine(tiny, num_blocks=64)
    shared_prefix = prompt_of_length(tiny, 160)
    first = shared_prefix + prompt_of_length(tiny, 20, seed=1)
    second = shared_prefix + prompt_of_length(tiny, 37, seed=2)
    assert engine.generate("a", first, GREEDY) == reference_greedy(tiny, first, GREEDY.max_tokens)
    common = next(i for i, (x, y) in enumerate(zip(first, second)) if x != y)
    engine.add_request("b", second, GREEDY)
    seq = engine.get("b")  # the live sequence, to watch its counters
    assert seq.num_cached_tokens == common // 16 * 16 >= 160
    assert run_to_end(engine, "b") == reference_greedy(tiny, second, GREEDY.max_tokens)
    assert seq.num_computed_tokens == len(second) - seq.num_cached_tokens + GREEDY.max_tokens - 1
    assert engine.prefix_cache.stats.hit_blocks >= 10


def test_identical_prompt_reuses_all_but_the_last_block(tiny):
    engine = HfEngine(tiny, num_blocks=64)
    prompt = prompt_of_length(tiny, 64)  # exactly 4 blocks
    expected = engine.generate("a", prompt, GREEDY)
    engine.add_request("b", prompt, GREEDY)
    seq = engine.get("b")  # the live sequence, to watch its counters
    assert seq.num_cached_tokens == 48  # the block with the last prompt token is recomputed
    assert run_to_end(engine, "b") == expected


def test_eviction_under_small_capacity_keeps_outputs_correct(tiny):
    engine = HfEngine(tiny, num_blocks=14)  # room for one request at a time, barely
    prompts = [prompt_of_length(tiny, 150, seed=s) for s in range(4)]
    for round_ in range(2):
        for i, prompt in enumerate(prompts):
            output = engine.generate(f"{round_}-{i}", prompt, GREEDY)
            assert output == reference_greedy(tiny, prompt, GREEDY.max_tokens)
    assert engine.prefix_cache.stats.evicted_blocks > 0
    assert engine.blocks.num_used_blocks == 0
    assert engine.blocks.num_available_blocks == 14


def test_continuous_batching_joins_at_different_steps(tiny):
    engine = HfEngine(tiny, num_blocks=128)
    prompts = {f"r{i}": prompt_of_length(tiny, n, seed=i) for i, n in enumerate([12, 70, 33, 140])}
    join_at_step = {"r0": 0, "r1": 0, "r2": 3, "r3": 9}
    outputs: dict[str, list[int]] = {rid: [] for rid in prompts}
    batch_sizes = []
    step = 0
    while step < 10 or engine.has_work():
        for rid, at in join_at_step.items():
            if at == step:
                engine.add_request(rid, prompts[rid], GREEDY)
        produced = engine.step()
        batch_sizes.append(len(produced))
        for out in produced:
            assert out.token_index == len(outputs[out.request_id])
            outputs[out.request_id].append(out.token_id)
        step += 1
    assert max(batch_sizes) == 4
    for rid, prompt in prompts.items():
        assert outputs[rid] == reference_greedy(tiny, prompt, GREEDY.max_tokens), rid


def test_chunked_prefill_under_token_budget_is_exact(tiny):
    engine = HfEngine(tiny, num_blocks=64, max_batch_tokens=40)
    prompt = prompt_of_length(tiny, 200)
    assert engine.generate("r", prompt, GREEDY) == reference_greedy(tiny, prompt, GREEDY.max_tokens)


def test_load_reports_the_prompt_tokens_still_to_compute(tiny):
    """The heartbeat's ``pending_tokens``: the router weighs a prefill by its queued work."""
    engine = HfEngine(tiny, num_blocks=64, max_batch_tokens=40)
    prompt = prompt_of_length(tiny, 200)
    engine.add_request("r", prompt, GREEDY)
    pending = [engine.load().num_pending_tokens]
    while engine.get("r").num_kv_tokens < len(prompt):
        engine.step()
        pending.append(engine.load().num_pending_tokens)
    assert pending == [200, 160, 120, 80, 40, 0]
    engine.step()  # decoding: one known token at a time is not queued work
    assert engine.load().num_pending_tokens == 0


def test_load_counts_a_finished_prompts_cached_blocks_as_neither_used_nor_free(tiny):
    """The heartbeat's ``free_blocks``: routers break placement ties towards the most."""
    engine = HfEngine(tiny, num_blocks=64)
    engine.generate("r", prompt_of_length(tiny, 100), GREEDY)
    load = engine.load()
    assert load.num_used_blocks == 0
    cached = engine.cached_block_hashes()
    assert len(cached) >= 100 // engine.block_size  # its full blocks stay cached
    assert load.num_free_blocks == 64 - len(cached)


def test_import_converts_dtype_between_heterogeneous_instances(tiny):
    """An fp32 sender and a bf16 receiver of the same model exchange KV."""
    bf16 = load_model("tiny", dtype="bfloat16")
    assert bf16.fingerprint == tiny.fingerprint
    prompt = prompt_of_length(tiny, 40)
    sender, receiver = HfEngine(tiny, num_blocks=16), HfEngine(bf16, num_blocks=16)
    sender.add_request("r", prompt, GREEDY)
    sender.step()
    receiver.begin_import("r", prompt, GREEDY)
    ship(sender, receiver, "r", 0)
    sent = sender.pool.export_tokens(sender.get("r").block_ids, len(prompt))
    got = receiver.pool.export_tokens(receiver.get("r").block_ids, len(prompt))
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), sent, rtol=1e-2, atol=1e-2)


def test_catch_up_handoff_in_chunks_is_exact(tiny):
    """Main decode absorbs the relay's tokens in several held chunks, then takes over."""
    prompt = prompt_of_length(tiny, 90)
    sampling = SamplingParams(max_tokens=130, ignore_eos=True)
    relay, main = relay_with_main(tiny, prompt, sampling)
    handed = 0
    for chunk_end in (70, 95, 100):  # two held chunks while the relay keeps going, then final
        while len(relay.get("r").output_token_ids) < chunk_end:
            relay.step()
        tokens = relay.get("r").output_token_ids[handed:chunk_end]
        final = chunk_end == 100
        main.extend("r", tokens, sample=final)
        outputs = main.step()
        if final:
            assert [o.token_index for o in outputs] == [100] and outputs[0].token_id is not None
        else:
            assert [(o.absorbed, o.token_index, o.token_id) for o in outputs] == [(True, chunk_end, None)]
        handed = chunk_end
    assert main.get("r").num_computed_tokens == 100
    assert run_to_end(main, "r") == reference_greedy(tiny, prompt, sampling.max_tokens)


def test_disabled_prefix_cache_recomputes_everything(tiny):
    engine = HfEngine(tiny, num_blocks=64, enable_prefix_cache=False)
    prompt = prompt_of_length(tiny, 100)
    first = engine.generate("a", prompt, GREEDY)
    engine.add_request("b", prompt, GREEDY)
    seq = engine.get("b")  # the live sequence, to watch its counters
    assert seq.num_cached_tokens == 0 and len(engine.prefix_cache) == 0
    assert run_to_end(engine, "b") == first
    assert engine.begin_import("c", prompt, GREEDY) == 0
