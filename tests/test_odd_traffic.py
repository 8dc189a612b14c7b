"""The odd-traffic filter end to end, and its decision rule."""

from infra.wan_link import LinkProfile
from services.router.odd_traffic import OddTrafficRule
from tests.helpers import until
from tests.test_faults import engines_idle
from tests.test_pipeline_e2e import chat_body, chat_prompt, expected_text, post

# 1 Mbit/s: a 300-token tiny-model prompt (~150 KB of KV) takes over a second to cross.
NARROW_WAN = LinkProfile(bandwidth_bps=1e6, rtt_ms=4, jitter_ms=0, seed=3)
ROUTER = {"ttft_target_ms": 100, "wan_bandwidth_mbit": 1, "wan_rtt_ms": 4, "relay_step_ms": 80}
LONG = "Summarise this log line by line. " * 40


def test_rule_marks_only_long_prompts_with_short_outputs():
    rule = OddTrafficRule(enabled=True, max_output_tokens=8, relay_step_s=0.08, min_wan_s=0.5)
    assert rule.is_odd(max_tokens=4, predicted_wan_s=2.0)
    assert not rule.is_odd(max_tokens=64, predicted_wan_s=2.0)   # output too long
    assert not rule.is_odd(max_tokens=4, predicted_wan_s=0.2)    # prompt's KV crosses fast
    assert not rule.is_odd(max_tokens=8, predicted_wan_s=0.6)    # the KV would land first
    assert not OddTrafficRule(False, 8, 0.08, 0.5).is_odd(4, 2.0)


async def test_odd_request_finishes_on_relay_and_cancels_the_wan_transfer(make_stack, tiny):
    stack = await make_stack(profile=NARROW_WAN, router_settings=ROUTER,
                             engine_settings={"frame_tokens": 16})
    status, body = await post(stack, "/chat/completions", chat_body(LONG, 4))
    assert status == 200, body
    pdd = body["pdd"]
    prompt = chat_prompt(tiny, LONG)
    assert body["choices"][0]["message"]["content"] == expected_text(tiny, prompt, 4)
    assert pdd["odd_traffic"] is True and pdd["pipeline"] == "P-RLD-MD" and pdd["finished_on"] == "RLD"
    prompt_kv_bytes = len(prompt) * stack.prefill.engine.layout.kv_bytes_per_token
    assert pdd["wan_kv_bytes"] < 0.5 * prompt_kv_bytes
    await until(lambda: engines_idle(stack), 10, "partial KV discarded everywhere")


async def test_non_odd_request_the_relay_finishes_still_completes_its_transfer(make_stack, tiny):
    stack = await make_stack(profile=NARROW_WAN, router_settings={**ROUTER, "odd_traffic_filter": False,
                                                                    "pipeline_policy": "P-RLD-MD"})
    status, body = await post(stack, "/chat/completions", chat_body(LONG, 4))
    assert status == 200 and body["pdd"]["finished_on"] == "RLD" and not body["pdd"]["odd_traffic"]
    num_blocks = len(chat_prompt(tiny, LONG)) // 16
    index = stack.cache_index.instances["main-decode-0"]
    await until(lambda: len(index.block_hashes) >= num_blocks, 20, "main decode to cache every block")
    await until(lambda: engines_idle(stack), 10, "the finished import to be freed")
