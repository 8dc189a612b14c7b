"""SmolLM2 through both pipelines of a two-site stack, under the default slow WAN profile.

A long cold first turn goes P→RLD→MD with eager tokens; its follow-up goes P→MD on the main
decoder's cached blocks. Every answer equals transformers' greedy output.
"""

import pytest
import torch

from infra.wan_link import LinkProfile
from loadtest.demo_conversation import long_tool_output
from shared.model_loader import load_metadata
from tests.helpers import (
    chat_prompt_ids,
    post,
    reference_chat_answer,
    reference_greedy,
    reference_greedy_with_logprobs,
    reference_penalised,
    until,
)

pytestmark = pytest.mark.real_model
DEFAULT_WAN = LinkProfile(bandwidth_bps=100e6, rtt_ms=40, jitter_ms=5, seed=0)


async def test_agent_turns_through_both_pipelines_are_exact(make_stack, smollm2):
    # The references first: computed while the stack runs, they would hold its event loop (and
    # its heartbeats) for seconds, and the router would find no live main decoder for the next turn.
    messages = [
        {"role": "system", "content": "You are a careful coding agent. Answer briefly."},
        {
            "role": "user",
            "content": "Tool output:\n" + long_tool_output(30) + "\nSummarise what the project does in two sentences.",
        },
    ]
    first_expected, prompt_len = reference_chat_answer(smollm2, messages, 40)
    follow_up = messages + [
        {"role": "assistant", "content": first_expected},
        {"role": "user", "content": "Name one risk of that design."},
    ]
    tokens, logprobs = reference_greedy_with_logprobs(smollm2, chat_prompt_ids(smollm2, follow_up), 24)
    until_eos = next((i + 1 for i, t in enumerate(tokens) if t in smollm2.eos_token_ids), len(tokens))
    second_expected = smollm2.tokenizer.decode(tokens[:until_eos], skip_special_tokens=True)

    stack = await make_stack(
        loaded=smollm2,
        metadata=load_metadata("smollm2"),
        profile=DEFAULT_WAN,
        engine_settings={"kv_cache_mb": 256},
        router_settings={"served_model_name": "smollm2"},
    )
    status, first = await post(
        stack, "/chat/completions", {"model": "smollm2", "messages": messages, "max_tokens": 40, "temperature": 0}
    )
    assert status == 200, first
    assert first["choices"][0]["message"]["content"] == first_expected
    assert prompt_len >= 1000 and first["pdd"]["pipeline"] == "P-RLD-MD"
    assert first["pdd"]["eager_tokens"] >= 1
    block_bytes = 16 * stack.prefill.engine.layout.kv_bytes_per_token
    assert first["pdd"]["wan_kv_bytes"] >= prompt_len // 16 * block_bytes

    await until(
        lambda: len(stack.cache_index.instances["main-decode-0"].block_hashes) >= prompt_len // 16,
        60,
        "the first turn's blocks on the main decoder",
    )
    status, second = await post(
        stack,
        "/chat/completions",
        {
            "model": "smollm2",
            "messages": follow_up,
            "max_tokens": 24,
            "temperature": 0,
            "logprobs": True,
            "top_logprobs": 3,
        },
    )
    assert status == 200, second
    assert second["choices"][0]["message"]["content"] == second_expected
    assert second["pdd"]["pipeline"] == "P-MD"
    assert second["pdd"]["cached_blocks_md"] >= prompt_len // 16
    assert second["pdd"]["wan_kv_bytes"] < 0.2 * first["pdd"]["wan_kv_bytes"]
    assert_logprobs_equal_transformers(smollm2, second["choices"][0]["logprobs"]["content"], tokens, logprobs)


def assert_logprobs_equal_transformers(loaded, content: list[dict], output: list[int], reference: torch.Tensor):
    """Each token's log-probability and top 3 equal transformers' log-softmax (``reference``,
    for its greedy ``output``) within 1e-4; the chosen token is the likeliest."""
    assert [e["token"] for e in content] == [loaded.tokenizer.decode([t]) for t in output[: len(content)]]
    for i, (token_id, entry) in enumerate(zip(output, content)):
        assert abs(entry["logprob"] - float(reference[i, token_id])) < 1e-4, i
        assert entry["top_logprobs"][0]["logprob"] == entry["logprob"]
        values = torch.topk(reference[i], 3).values.tolist()
        assert [t["logprob"] for t in entry["top_logprobs"]] == pytest.approx(values, abs=1e-4)


@pytest.fixture
async def smol_stack(make_stack, smollm2):
    return await make_stack(
        loaded=smollm2,
        metadata=load_metadata("smollm2"),
        profile=DEFAULT_WAN,
        engine_settings={"kv_cache_mb": 256},
        router_settings={"served_model_name": "smollm2"},
    )


async def test_long_prompt_short_output_is_odd_traffic(smol_stack, smollm2):
    messages = [{"role": "user", "content": "Tool output:\n" + long_tool_output(30) + "\nOne word: ok?"}]
    status, body = await post(
        smol_stack, "/chat/completions", {"model": "smollm2", "messages": messages, "max_tokens": 4, "temperature": 0}
    )
    assert status == 200, body
    expected, prompt_len = reference_chat_answer(smollm2, messages, 4)
    assert body["choices"][0]["message"]["content"] == expected
    pdd = body["pdd"]
    assert pdd["odd_traffic"] is True and pdd["finished_on"] == "RLD"
    prompt_kv = prompt_len * smol_stack.prefill.engine.layout.kv_bytes_per_token
    assert pdd["wan_kv_bytes"] < 0.5 * prompt_kv


async def test_long_cold_prompt_with_long_output_catches_up(make_stack, smollm2):
    messages = [
        {
            "role": "user",
            "content": "Tool output:\n" + long_tool_output(30) + "\nExplain every line of this output in detail.",
        }
    ]
    expected, _ = reference_chat_answer(smollm2, messages, 160, ignore_eos=True)
    # The backlog at handoff is the relay's tokens while the WAN copy lands after the prefill.
    # The prompt is computed in one step, so its ~62 MB leave after it and take ~2.5 s at
    # 200 Mbit/s: dozens of relayed tokens on a quiet machine, and well before the relay's 160th
    # token (at 40 Mbit/s the copy took 16 s and an unloaded relay finished first). On a machine
    # busy with other work the relay had made exactly 16 by then: a backlog above 4 catches up.
    stack = await make_stack(
        loaded=smollm2,
        metadata=load_metadata("smollm2"),
        profile=LinkProfile(bandwidth_bps=200e6, rtt_ms=40, jitter_ms=5, seed=0),
        engine_settings={"kv_cache_mb": 256, "max_batch_tokens": 4096, "first_chunk_tokens": 0},
        relay_settings={"catch_up_threshold_tokens": 4},
        router_settings={"served_model_name": "smollm2"},
    )
    status, body = await post(
        stack,
        "/chat/completions",
        {"model": "smollm2", "messages": messages, "max_tokens": 160, "temperature": 0, "ignore_eos": True},
    )
    assert status == 200, body
    assert body["choices"][0]["message"]["content"] == expected
    pdd = body["pdd"]
    assert pdd["pipeline"] == "P-RLD-MD" and pdd["finished_on"] == "MD", str(pdd)
    assert pdd["handoff_mode"] == "catch-up" and pdd["handoff_chunks"] >= 2, pdd


async def test_penalties_min_tokens_and_logprobs_are_exact_across_a_handoff(make_stack, smollm2):
    """vLLM's penalty rules (computed by transformers with a reference logits processor) and
    the model's own log-probabilities, through the relay → main-decode handoff."""
    messages = [
        {"role": "user", "content": "Write the word 'tea' five times, then say why tea is good. " + long_tool_output(4)}
    ]
    prompt = chat_prompt_ids(smollm2, messages)
    # The references first: computed while the stack runs, they would hold its event loop (and
    # its heartbeats) for seconds, and the router would find no live decoder for the next request.
    expected = reference_penalised(smollm2, prompt, 32, repetition=1.3, frequency=0.5, presence=0.3, min_tokens=20)
    greedy = reference_greedy(smollm2, prompt, 32, stop_at_eos=True)
    greedy_with_logprobs = reference_greedy_with_logprobs(smollm2, prompt, 20)
    # A fast link: the prompt's KV must land before the relay's 32nd token, which a fast host
    # reached first at 100 Mbit/s.
    stack = await make_stack(
        loaded=smollm2,
        metadata=load_metadata("smollm2"),
        profile=LinkProfile(bandwidth_bps=1e9, rtt_ms=40, jitter_ms=5, seed=0),
        engine_settings={"kv_cache_mb": 256},
        router_settings={"served_model_name": "smollm2", "pipeline_policy": "P-RLD-MD"},
    )
    penalties = {"repetition_penalty": 1.3, "frequency_penalty": 0.5, "presence_penalty": 0.3, "min_tokens": 20}
    status, answer = await post(
        stack,
        "/chat/completions",
        {"model": "smollm2", "messages": messages, "max_tokens": 32, "temperature": 0, **penalties},
    )
    assert status == 200, answer
    assert answer["pdd"]["eager_tokens"] >= 1 and answer["pdd"]["finished_on"] == "MD", answer["pdd"]
    assert answer["choices"][0]["message"]["content"] == smollm2.tokenizer.decode(expected, skip_special_tokens=True)
    assert expected != greedy  # the penalties did change it

    status, answer = await post(
        stack,
        "/chat/completions",
        {
            "model": "smollm2",
            "messages": messages,
            "max_tokens": 20,
            "temperature": 0,
            "ignore_eos": True,
            "logprobs": True,
            "top_logprobs": 3,
        },
    )
    assert status == 200 and answer["pdd"]["eager_tokens"] >= 1, answer
    content = answer["choices"][0]["logprobs"]["content"]
    assert len(content) == 20
    assert_logprobs_equal_transformers(smollm2, content, *greedy_with_logprobs)
