"""The odd-traffic filter end to end, and its decision rule."""

from infra.wan_link import LinkProfile
from services.router.odd_traffic import OddTrafficRule
from tests.helpers import chat_body, chat_prompt, engines_idle, expected_text, post, until

# 1 Mbit/s: a 300-token tiny-model prompt (~150 KB of KV) takes over a second to cross.
NARROW_WAN = LinkProfile(bandwidth_bps=1e6, rtt_ms=4, jitter_ms=0, seed=3)
# A quarter of that for the cancel test: the relay's few steps and the cancel then cover a small
# share of the transfer (~6 s), so a loaded machine (or a slow TLS start on the local path) does
# not let half the KV cross before the cancel lands.
NARROWER_WAN = LinkProfile(bandwidth_bps=0.25e6, rtt_ms=4, jitter_ms=0, seed=3)
ROUTER = {"ttft_target_ms": 100, "wan_bandwidth_mbit": 1, "wan_rtt_ms": 4, "relay_step_ms": 80}
LONG = "Summarise this log line by line. " * 40


def test_rule_marks_only_long_prompts_with_short_outputs():
    rule = OddTrafficRule(enabled=True, max_output_tokens=8, relay_step_s=0.08, min_wan_s=0.5)
    assert rule.is_odd(max_tokens=4, predicted_wan_s=2.0)
    assert not rule.is_odd(max_tokens=64, predicted_wan_s=2.0)  # output too long
    assert not rule.is_odd(max_tokens=4, predicted_wan_s=0.2)  # prompt's KV crosses fast
    assert not rule.is_odd(max_tokens=8, predicted_wan_s=0.6)  # the KV would land first
    assert not OddTrafficRule(False, 8, 0.08, 0.5).is_odd(4, 2.0)


async def test_odd_request_finishes_on_relay_and_cancels_the_wan_transfer(make_stack, tiny):
    stack = await make_stack(profile=NARROWER_WAN, router_settings=ROUTER, engine_settings={"frame_tokens": 16})
    status, body = await post(stack, "/chat/completions", chat_body(LONG, 4))
    assert status == 200, body
    pdd = body["pdd"]
    prompt = chat_prompt(tiny, LONG)
    assert body["choices"][0]["message"]["content"] == expected_text(tiny, prompt, 4)
    assert pdd["odd_traffic"] is True and pdd["pipeline"] == "P-RLD-MD" and pdd["finished_on"] == "RLD"
    prompt_kv_bytes = len(prompt) * stack.prefill.engine.layout.kv_bytes_per_token
    assert pdd["wan_kv_bytes"] < 0.5 * prompt_kv_bytes, pdd
    await until(lambda: engines_idle(stack), 10, "partial KV discarded everywhere")


async def test_non_odd_request_the_relay_finishes_still_completes_its_transfer(make_stack, tiny):
    stack = await make_stack(
        profile=NARROW_WAN, router_settings={**ROUTER, "odd_traffic_filter": False, "pipeline_policy": "P-RLD-MD"}
    )
    status, body = await post(stack, "/chat/completions", chat_body(LONG, 4))
    assert status == 200 and body["pdd"]["finished_on"] == "RLD" and not body["pdd"]["odd_traffic"]
    num_blocks = len(chat_prompt(tiny, LONG)) // 16
    index = stack.cache_index.instances["main-decode-0"]
    await until(lambda: len(index.block_hashes) >= num_blocks, 20, "main decode to cache every block")
    await until(lambda: engines_idle(stack), 10, "the finished import to be freed")


async def test_a_transfer_kept_for_the_cache_is_not_taken_for_a_lost_cancel(make_stack, tiny):
    """The relay finishes a request whose KV crosses for seconds more: the router's "finished"
    cancel reaches prefill and main decode, which ship and import on for the cache. Their
    leases must not then free it as a request whose cancel was lost: that counter is what
    tells an operator cancels go missing."""
    from tests.helpers import lost_cancels

    stack = await make_stack(
        profile=NARROW_WAN, router_settings={**ROUTER, "odd_traffic_filter": False, "pipeline_policy": "P-RLD-MD"}
    )
    before = lost_cancels()
    prompt = chat_prompt(tiny, LONG * 2)
    status, body = await post(stack, "/chat/completions", chat_body(LONG * 2, 4))
    assert status == 200 and body["pdd"]["finished_on"] == "RLD", body
    # Several heartbeats and the lease's grace pass while the KV crosses (1 Mbit/s, 0.25 s beats).
    kv_s = len(prompt) * stack.prefill.engine.layout.kv_bytes_per_token * 8 / NARROW_WAN.bandwidth_bps
    assert kv_s > 2, kv_s  # the grace is two beats and a half: 1 s
    index = stack.cache_index.instances["main-decode-0"]
    await until(lambda: len(index.block_hashes) >= len(prompt) // 16, 30, "main decode to cache every block")
    await until(lambda: engines_idle(stack), 10, "the finished import to be freed")
    assert lost_cancels() == before


async def test_a_finished_cancel_arriving_while_main_decode_begins_the_import_keeps_it(make_stack, tiny):
    """The router's "finished" cancel can reach main decode while its engine thread is creating
    the import's sequence. The import must go on (it fills the cache), not be freed under the
    importer so that its frames find no import."""
    import asyncio
    import threading

    from shared.messages import CancelRequest

    stack = await make_stack(
        profile=NARROW_WAN, router_settings={**ROUTER, "odd_traffic_filter": False, "pipeline_policy": "P-RLD-MD"}
    )
    main = stack.mains[0]
    in_begin, release, request_ids = threading.Event(), threading.Event(), []
    begin_import = main.engine.begin_import

    def slow_begin_import(request_id, *args, **kwargs):
        request_ids.append(request_id)
        in_begin.set()
        release.wait(30)  # the engine thread is here while the cancel is handled on the loop
        return begin_import(request_id, *args, **kwargs)

    main.engine.begin_import = slow_begin_import
    answer = asyncio.create_task(post(stack, "/chat/completions", chat_body(LONG, 4)))
    try:
        assert await asyncio.to_thread(in_begin.wait, 30)
        cancel = asyncio.create_task(main.on_cancel(CancelRequest(request_id=request_ids[0], kind="finished")))
        await asyncio.sleep(0)  # one loop turn: the cancel runs up to its first wait, before the begin ends
    finally:
        release.set()
    await asyncio.wait_for(cancel, 30)
    status, body = await answer
    assert status == 200 and body["pdd"]["finished_on"] == "RLD", body
    num_blocks = len(chat_prompt(tiny, LONG)) // 16
    index = stack.cache_index.instances["main-decode-0"]
    await until(lambda: len(index.block_hashes) >= num_blocks, 20, "main decode to cache every block")
    await until(lambda: engines_idle(stack), 10, "the finished import to be freed")
