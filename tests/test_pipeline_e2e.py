"""Both PDD pipelines end to end: real nats-servers, the WAN link, every service, the tiny model.

Every response is compared with transformers' greedy output for the same prompt; streams
must carry every token index exactly once, in order, across the relay → main handoff.
"""

import asyncio
import threading

import pytest

from tests.helpers import (
    CATCH_UP_WAN,
    SLOW_WAN,
    chat_body,
    chat_prompt,
    expected_text,
    held_engine_step,
    post,
    stream,
    until,
)


@pytest.mark.parametrize("policy", ["P-MD", "P-RLD-MD"])
async def test_chat_is_token_exact_through_each_pipeline(make_stack, tiny, policy):
    # KV striped over three connections on the WAN and two on the local path, in 32-token frames
    striped = {"bulk_streams": 3, "bulk_streams_local": 2, "frame_tokens": 32}
    stack = await make_stack(profile=SLOW_WAN, router_settings={"pipeline_policy": policy}, engine_settings=striped)
    assert stack.prefill.path_streams["wan"].streams == 3 and stack.prefill.path_streams["local"].streams == 2
    content = "Describe the sea at night. " * 20
    # As many tokens as the streaming test below asks, for the same reason: the relay must still be
    # decoding when the handoff comes (with 120, a run's relay had made them all).
    max_tokens = 1000
    status, body = await post(stack, "/chat/completions", chat_body(content, max_tokens))
    assert status == 200, body
    prompt = chat_prompt(tiny, content)
    assert body["choices"][0]["message"]["content"] == expected_text(tiny, prompt, max_tokens)
    assert body["usage"] == {
        "prompt_tokens": len(prompt),
        "completion_tokens": max_tokens,
        "total_tokens": len(prompt) + max_tokens,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    pdd = body["pdd"]
    assert pdd["pipeline"] == policy and pdd["prompt_tokens"] == len(prompt)
    assert pdd["wan_kv_bytes"] >= len(prompt) * stack.prefill.engine.layout.kv_bytes_per_token
    if policy == "P-RLD-MD":
        assert pdd["eager_tokens"] >= 1 and pdd["handoff_mode"] in ("one-shot", "catch-up")
        assert pdd["finished_on"] == "MD" and pdd["handoff_chunks"] >= 1
    else:
        assert pdd["eager_tokens"] == 0 and pdd["finished_on"] == "MD" and pdd["handoff_mode"] is None


@pytest.mark.parametrize("policy", ["P-MD", "P-RLD-MD"])
async def test_stream_holds_every_token_once_in_order(make_stack, tiny, policy):
    stack = await make_stack(profile=SLOW_WAN, router_settings={"pipeline_policy": policy})
    content = "List facts about rivers. " * 15
    # Enough tokens that the relay hands over before it is done: the tiny model decodes a token
    # in ~2 ms, and its catch-up chunks chase it for 300-430 tokens (150 were too few).
    max_tokens = 1000
    body = chat_body(content, max_tokens, stream_options={"include_usage": True})
    chunks = await stream(stack, "/chat/completions", body)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == expected_text(tiny, chat_prompt(tiny, content), max_tokens)
    final = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert len(final) == 1 and final[0]["choices"][0]["finish_reason"] == "length"
    assert final[0]["pdd"]["pipeline"] == policy
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == max_tokens
    if policy == "P-RLD-MD":
        assert 1 <= final[0]["pdd"]["eager_tokens"] < max_tokens


async def test_completions_endpoint_and_token_id_prompts(make_stack, tiny):
    stack = await make_stack(router_settings={"pipeline_policy": "P-MD"})
    prompt_text = "Once upon a time, in a city by the sea,"
    status, body = await post(
        stack,
        "/completions",
        {"model": "tiny", "prompt": prompt_text, "max_tokens": 30, "temperature": 0, "ignore_eos": True},
    )
    assert status == 200, body
    ids = tiny.tokenizer.encode(prompt_text, add_special_tokens=False)
    assert body["object"] == "text_completion"
    assert body["choices"][0]["text"] == expected_text(tiny, ids, 30)
    status, by_ids = await post(
        stack, "/completions", {"model": "tiny", "prompt": ids, "max_tokens": 30, "temperature": 0, "ignore_eos": True}
    )
    assert by_ids["choices"][0]["text"] == body["choices"][0]["text"]


async def test_follow_up_turn_reuses_main_decode_cache(make_stack, tiny):
    stack = await make_stack(profile=SLOW_WAN, router_settings={"pipeline_policy": "P-MD"})
    first_turn = [{"role": "user", "content": "Tell me about trains. " * 30}]
    status, first = await post(
        stack, "/chat/completions", {"model": "tiny", "messages": first_turn, "max_tokens": 16, "temperature": 0}
    )
    assert status == 200
    await until(lambda: stack.cache_index.instances["main-decode-0"].block_hashes, what="KV events")
    second_turn = first_turn + [
        {"role": "assistant", "content": first["choices"][0]["message"]["content"]},
        {"role": "user", "content": "And about ships?"},
    ]
    status, second = await post(
        stack, "/chat/completions", {"model": "tiny", "messages": second_turn, "max_tokens": 16, "temperature": 0}
    )
    assert status == 200
    first_blocks = first["pdd"]["prompt_tokens"] // 16
    assert second["pdd"]["cached_blocks_md"] >= first_blocks
    assert second["pdd"]["wan_kv_bytes"] < first["pdd"]["wan_kv_bytes"] / 3
    # Prefill computed the first turn's prompt again from its own cache: the client is told.
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= (first_blocks - 1) * 16


async def test_auto_policy_relays_long_cold_prompts_only(make_stack, tiny):
    # At 5 Mbit/s a tiny-model token's KV (512 B) crosses in ~0.8 ms: the cold prompt's ~1,200
    # tokens are predicted to land ~1.1 s after its prefill, past the 400 ms target; the warm
    # turn's ~70 uncached tokens ~0.15 s (twice that if the measured RTT doubles on a busy machine).
    stack = await make_stack(
        profile=SLOW_WAN, router_settings={"ttft_target_ms": 400, "wan_bandwidth_mbit": 5, "wan_rtt_ms": 40}
    )
    long_chat = [{"role": "user", "content": "Explain how tides work in great detail. " * 150}]
    status, cold = await post(
        stack,
        "/chat/completions",
        {"model": "tiny", "messages": long_chat, "max_tokens": 40, "temperature": 0, "ignore_eos": True},
    )
    assert status == 200 and cold["pdd"]["prompt_tokens"] > 1200
    assert cold["pdd"]["pipeline"] == "P-RLD-MD" and cold["pdd"]["eager_tokens"] >= 1
    await until(
        lambda: len(stack.cache_index.instances["main-decode-0"].block_hashes) >= cold["pdd"]["prompt_tokens"] // 16,
        what="main decode blocks indexed",
    )
    follow = long_chat + [
        {"role": "assistant", "content": cold["choices"][0]["message"]["content"]},
        {"role": "user", "content": "Shorter?"},
    ]
    status, warm = await post(
        stack, "/chat/completions", {"model": "tiny", "messages": follow, "max_tokens": 10, "temperature": 0}
    )
    assert status == 200 and warm["pdd"]["pipeline"] == "P-MD"


async def test_requests_spread_over_two_main_decoders(make_stack, tiny):
    import asyncio

    stack = await make_stack(num_main=2, router_settings={"pipeline_policy": "P-MD"})
    bodies = [chat_body(f"Question number {i}: what is {i} squared?", 30) for i in range(6)]
    results = await asyncio.gather(*(post(stack, "/chat/completions", b) for b in bodies))
    used = {body["pdd"]["instances"]["main_decode"] for status, body in results if status == 200}
    assert len(results) == 6 and all(status == 200 for status, _ in results)
    assert used == {"main-decode-0", "main-decode-1"}
    for (_, body), request in zip(results, bodies):
        prompt = chat_prompt(tiny, request["messages"][0]["content"])
        assert body["choices"][0]["message"]["content"] == expected_text(tiny, prompt, 30)


async def test_two_routers_send_cold_prompts_one_after_another_to_different_decoders(make_stack, tiny):
    """Each router breaks placement ties by the spare KV blocks the decoders report, a fact both
    routers read, not by a rotation of its own (with which both would start on main-decode-0)."""
    import aiohttp

    stack = await make_stack(num_main=2, num_routers=2, router_settings={"pipeline_policy": "P-MD"})

    async def complete(router: int, first_token: int) -> str:
        ids = list(range(first_token, first_token + 48))  # three blocks, none shared with the other prompt
        body = {"model": "tiny", "prompt": ids, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        async with aiohttp.ClientSession() as session:
            async with session.post(stack.router_url(router) + "/completions", json=body) as response:
                assert response.status == 200
                answer = await response.json()
        assert answer["choices"][0]["text"] == expected_text(tiny, ids, 8)
        return answer["pdd"]["instances"]["main_decode"]

    first = await complete(0, 1000)

    def both_routers_see_its_cache() -> bool:
        spare = [
            {s.report.instance.instance_id: s.report.free_blocks for s in r.registry.live("main_decode")}
            for r in stack.routers
        ]
        return all(len(seen) == 2 and seen[first] < max(seen.values()) for seen in spare)

    await until(both_routers_see_its_cache, 10, "heartbeats showing the first prompt's cached blocks")
    second = await complete(1, 2000)
    assert {first, second} == {"main-decode-0", "main-decode-1"}


async def test_seeded_sampling_is_the_same_through_both_pipelines(make_stack, tiny):
    """A seeded request samples token i from (seed, i): which instance produced it is invisible."""
    from shared.engine.hf_engine import HfEngine
    from shared.engine.sampling import SamplingParams

    body = chat_body("Invent a name for a boat. " * 10, 80, temperature=0.8, top_p=0.9, seed=1234)
    texts = []
    for policy in ("P-MD", "P-RLD-MD"):
        stack = await make_stack(profile=SLOW_WAN, router_settings={"pipeline_policy": policy})
        status, answer = await post(stack, "/chat/completions", body)
        assert status == 200 and answer["pdd"]["pipeline"] == policy
        texts.append(answer["choices"][0]["message"]["content"])
    prompt = chat_prompt(tiny, body["messages"][0]["content"])
    alone = HfEngine(tiny, num_blocks=32).generate(
        "r", prompt, SamplingParams(max_tokens=80, temperature=0.8, top_p=0.9, seed=1234, ignore_eos=True)
    )
    assert texts[0] == texts[1] == tiny.tokenizer.decode(alone, skip_special_tokens=True)


async def test_big_backlog_hands_over_in_catch_up_chunks(make_stack, tiny):
    # At 1 Mbit/s the prompt's KV (~85 KB) takes ~0.7 s to cross: the relay emits hundreds of
    # tokens meanwhile, far above the 32-token threshold even on a busy machine. The tiny model
    # may decode more tokens per step than a chunk's round trip takes to absorb (a fast host),
    # so catch-up hands over for good after 4 chunks; 1,200 tokens leave it time to, where a fast
    # host's relay decodes 600 in about the time the KV takes to cross.
    stack = await make_stack(
        profile=CATCH_UP_WAN,
        router_settings={"pipeline_policy": "P-RLD-MD"},
        relay_settings={"catch_up_threshold_tokens": 32, "final_gap_tokens": 8, "max_catch_up_chunks": 4},
    )
    content = "Write a long essay about lighthouses. " * 15
    status, body = await post(stack, "/chat/completions", chat_body(content, 1200))
    assert status == 200, body
    pdd = body["pdd"]
    assert pdd["handoff_mode"] == "catch-up" and pdd["handoff_chunks"] >= 2
    assert pdd["finished_on"] == "MD" and pdd["eager_tokens"] > 32
    assert body["choices"][0]["message"]["content"] == expected_text(tiny, chat_prompt(tiny, content), 1200)


async def test_loaded_relay_hands_over_one_shot(make_stack, tiny):
    import asyncio

    stack = await make_stack(
        profile=CATCH_UP_WAN, router_settings={"pipeline_policy": "P-RLD-MD"}, engine_settings={"max_sequences": 2}
    )
    bodies = [chat_body(f"Essay {i} about harbours. " * 15, 600) for i in range(3)]
    results = await asyncio.gather(*(post(stack, "/chat/completions", b) for b in bodies))
    modes = [body["pdd"]["handoff_mode"] for status, body in results if status == 200]
    assert len(modes) == 3 and "one-shot" in modes
    for (_, body), request in zip(results, bodies):
        expected = expected_text(tiny, chat_prompt(tiny, request["messages"][0]["content"]), 600)
        assert body["choices"][0]["message"]["content"] == expected


async def test_finished_prompt_ships_before_the_next_prompt_prefills(make_stack, tiny, monkeypatch):
    # Two prompts that cannot share a step: the first one's KV must leave prefill before the
    # second one's step, not wait behind it (on a real model that step takes seconds).
    import services.prefill.service as prefill_module

    stack = await make_stack(router_settings={"pipeline_policy": "P-MD"})
    stack.prefill.engine.scheduler.max_batch_tokens = 96
    stack.prefill.engine.scheduler.first_chunk_tokens = 0  # each prompt in one step
    both_open, opened, open_flow = threading.Event(), [], prefill_module.open_flow

    async def counted_open_flow(*args, **kwargs):
        flow = await open_flow(*args, **kwargs)
        opened.append(flow)
        if len(opened) % 2 == 0:
            both_open.set()
        return flow

    monkeypatch.setattr(prefill_module, "open_flow", counted_open_flow)
    calls: list[list] = []
    submit = stack.prefill.worker.submit

    def recording(fn, *args, **kwargs):
        call = [fn.__name__, args[0] if args else None]
        calls.append(call)
        # a pair's first step waits for both flows, as a real model's long steps let them open
        future = submit(held_engine_step(fn, args, kwargs, lambda: both_open.wait(timeout=30)))
        if fn.__name__ == "step_if_work":
            future.add_done_callback(
                lambda done: call.__setitem__(1, {o.request_id for o in done.result() or [] if o.token_id is not None})
            )
        return future

    stack.prefill.worker.submit = recording
    for pair in range(3):  # the old order was a race: three pairs make a pass by luck unlikely
        both_open.clear()
        calls.clear()
        # No block in common: a flow bringing blocks another flow already brings would wait for it.
        prompts = [
            tiny.tokenizer.encode(
                f"{start} {pair}: " + " ".join(f"item {i} is {i * 7 % 13}" for i in range(60)), add_special_tokens=False
            )[:96]
            for start in ("Apples", "Rivers and roads")
        ]
        assert prompts[0][:16] != prompts[1][:16]
        answers = await asyncio.gather(
            *(
                post(
                    stack,
                    "/completions",
                    {"model": "tiny", "prompt": ids, "max_tokens": 8, "temperature": 0, "ignore_eos": True},
                )
                for ids in prompts
            )
        )
        for ids, (status, body) in zip(prompts, answers):
            assert status == 200, body
            assert body["choices"][0]["text"] == expected_text(tiny, ids, 8)
        steps = [(index, done) for index, (name, done) in enumerate(calls) if name == "step_if_work" and done]
        assert len(steps) == 2, calls  # one prompt per step
        (first_step, (first_id,)), (second_step, _) = steps
        export = next(i for i, (name, rid) in enumerate(calls) if name == "export_frames" and rid == first_id)
        assert first_step < export < second_step, calls
