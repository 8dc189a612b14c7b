"""SmolLM2 through both pipelines of a two-site stack, under the default slow WAN profile.

A long cold first turn goes P→RLD→MD with eager tokens; its follow-up goes P→MD on the main
decoder's cached blocks. Every answer equals transformers' greedy output.
"""

import pytest

from infra.wan_link import LinkProfile
from loadtest.demo_conversation import long_tool_output
from shared.model_loader import load_metadata
from tests.helpers import reference_greedy, until
from tests.test_pipeline_e2e import post

pytestmark = pytest.mark.real_model
DEFAULT_WAN = LinkProfile(bandwidth_bps=100e6, rtt_ms=40, jitter_ms=5, seed=0)


def reference_answer(smollm2, messages, max_tokens):
    prompt = list(smollm2.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                        tokenize=True, return_dict=False))
    tokens = reference_greedy(smollm2, prompt, max_tokens, stop_at_eos=True)
    return smollm2.tokenizer.decode(tokens, skip_special_tokens=True), len(prompt)


async def test_agent_turns_through_both_pipelines_are_exact(make_stack, smollm2):
    stack = await make_stack(loaded=smollm2, metadata=load_metadata("smollm2"), profile=DEFAULT_WAN,
                             engine_settings={"kv_cache_mb": 256},
                             router_settings={"served_model_name": "smollm2"})
    messages = [{"role": "system", "content": "You are a careful coding agent. Answer briefly."},
                {"role": "user", "content": "Tool output:\n" + long_tool_output(30) +
                 "\nSummarise what the project does in two sentences."}]
    status, first = await post(stack, "/chat/completions", {
        "model": "smollm2", "messages": messages, "max_tokens": 40, "temperature": 0})
    assert status == 200, first
    expected, prompt_len = reference_answer(smollm2, messages, 40)
    assert first["choices"][0]["message"]["content"] == expected
    assert prompt_len >= 1000 and first["pdd"]["pipeline"] == "P-RLD-MD"
    assert first["pdd"]["eager_tokens"] >= 1
    block_bytes = 16 * stack.prefill.engine.layout.kv_bytes_per_token
    assert first["pdd"]["wan_kv_bytes"] >= prompt_len // 16 * block_bytes

    await until(lambda: len(stack.cache_index.instances["main-decode-0"].block_hashes) >= prompt_len // 16,
                60, "the first turn's blocks on the main decoder")
    messages += [{"role": "assistant", "content": first["choices"][0]["message"]["content"]},
                 {"role": "user", "content": "Name one risk of that design."}]
    status, second = await post(stack, "/chat/completions", {
        "model": "smollm2", "messages": messages, "max_tokens": 24, "temperature": 0})
    assert status == 200, second
    assert second["choices"][0]["message"]["content"] == reference_answer(smollm2, messages, 24)[0]
    assert second["pdd"]["pipeline"] == "P-MD"
    assert second["pdd"]["cached_blocks_md"] >= prompt_len // 16
    assert second["pdd"]["wan_kv_bytes"] < 0.2 * first["pdd"]["wan_kv_bytes"]


@pytest.fixture
async def smol_stack(make_stack, smollm2):
    return await make_stack(loaded=smollm2, metadata=load_metadata("smollm2"), profile=DEFAULT_WAN,
                            engine_settings={"kv_cache_mb": 256},
                            router_settings={"served_model_name": "smollm2"})


async def test_long_prompt_short_output_is_odd_traffic(smol_stack, smollm2):
    messages = [{"role": "user", "content": "Tool output:\n" + long_tool_output(30) + "\nOne word: ok?"}]
    status, body = await post(smol_stack, "/chat/completions", {
        "model": "smollm2", "messages": messages, "max_tokens": 4, "temperature": 0})
    assert status == 200, body
    expected, prompt_len = reference_answer(smollm2, messages, 4)
    assert body["choices"][0]["message"]["content"] == expected
    pdd = body["pdd"]
    assert pdd["odd_traffic"] is True and pdd["finished_on"] == "RLD"
    prompt_kv = prompt_len * smol_stack.prefill.engine.layout.kv_bytes_per_token
    assert pdd["wan_kv_bytes"] < 0.5 * prompt_kv


async def test_long_cold_prompt_with_long_output_catches_up(smol_stack, smollm2):
    messages = [{"role": "user", "content": "Tool output:\n" + long_tool_output(54) +
                 "\nExplain every line of this output in detail."}]
    status, body = await post(smol_stack, "/chat/completions", {
        "model": "smollm2", "messages": messages, "max_tokens": 160, "temperature": 0,
        "ignore_eos": True})
    assert status == 200, body
    prompt = list(smollm2.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                        tokenize=True, return_dict=False))
    expected = smollm2.tokenizer.decode(reference_greedy(smollm2, prompt, 160), skip_special_tokens=True)
    assert body["choices"][0]["message"]["content"] == expected
    pdd = body["pdd"]
    assert pdd["pipeline"] == "P-RLD-MD" and pdd["finished_on"] == "MD"
    assert pdd["handoff_mode"] == "catch-up" and pdd["handoff_chunks"] >= 2, pdd
