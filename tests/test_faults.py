"""Faults a user will hit: clients leaving, a partitioned WAN, a main decoder dying.

Nothing may hang a client and nothing may leak: every engine ends with no sequence and no
block in use.
"""

import asyncio
import time

import aiohttp

from infra.wan_link import LinkProfile
from tests.helpers import SLOW_WAN, chat_body, chat_prompt, crash, engines_idle, expected_text, post, until
from tests.helpers import stream as stream_chunks


async def read_some_then_disconnect(stack, body: dict, num_chunks: int):
    session = aiohttp.ClientSession()
    response = await session.post(stack.base_url + "/chat/completions", json={**body, "stream": True})
    assert response.status == 200
    seen = 0
    async for line in response.content:
        if line.startswith(b"data: {"):
            seen += 1
            if seen == num_chunks:
                break
    response.close()
    await session.close()


async def test_client_disconnect_frees_kv_everywhere(make_stack):
    stack = await make_stack(profile=SLOW_WAN, router_settings={"pipeline_policy": "P-RLD-MD"})
    await read_some_then_disconnect(stack, chat_body("Tell a very long story. " * 20, 3000), 5)
    await until(lambda: engines_idle(stack), 15, "every engine to drop the request")
    status, body = await post(stack, "/chat/completions", chat_body("Still there?", 8))
    assert status == 200 and body["usage"]["completion_tokens"] == 8


async def test_non_streaming_disconnect_cancels_too(make_stack):
    stack = await make_stack(profile=SLOW_WAN, router_settings={"pipeline_policy": "P-MD"})
    session = aiohttp.ClientSession()
    request = asyncio.create_task(
        session.post(stack.base_url + "/chat/completions", json=chat_body("Go on forever. " * 10, 3000))
    )
    await until(lambda: stack.mains[0].engine.num_sequences == 1, 15, "main decode to start")
    request.cancel()
    await session.close()
    await until(lambda: engines_idle(stack), 15, "every engine to drop the request")


async def test_partitioned_wan_gives_a_clear_error_without_recoveries(make_stack):
    stack = await make_stack(
        profile=LinkProfile(bandwidth_bps=0, rtt_ms=10, jitter_ms=0),
        router_settings={"pipeline_policy": "P-MD", "first_token_timeout_s": 4, "max_recoveries": 0},
    )
    stack.link.set_profile(partitioned=True)
    started = time.monotonic()
    status, body = await post(stack, "/chat/completions", chat_body("Anyone there?", 8))
    assert status in (502, 504), body
    assert body["error"]["message"] and time.monotonic() - started < 10
    stack.link.set_profile(partitioned=False)
    await stack.wait_ready()
    status, body = await post(stack, "/chat/completions", chat_body("Back again?", 8))
    assert status == 200
    await until(lambda: engines_idle(stack), 15, "no leftover sequences")


async def test_a_partition_is_served_at_site_a_then_main_decode_returns(make_stack, tiny):
    stack = await make_stack(
        profile=LinkProfile(bandwidth_bps=0, rtt_ms=10, jitter_ms=0), router_settings={"partition_tolerance_s": 4}
    )
    stack.link.set_profile(partitioned=True)
    content = "Anyone there? " * 6
    status, body = await post(stack, "/chat/completions", chat_body(content, 24))
    assert status == 200, body
    assert body["choices"][0]["message"]["content"] == expected_text(tiny, chat_prompt(tiny, content), 24)
    pdd = body["pdd"]
    assert pdd["pipeline"] == "P-RLD" and pdd["finished_on"] == "RLD"
    assert [r["from"] for r in pdd["recoveries"]] == ["main-decode-0"]
    # Sent while site B is known to be unreachable: straight to the relay, nothing to recover.
    status, body = await post(stack, "/chat/completions", chat_body("Still cut off?", 8))
    assert status == 200 and body["pdd"]["pipeline"] == "P-RLD" and body["pdd"]["recoveries"] == []
    assert body["pdd"]["degraded"] == "site-b unreachable"
    stack.link.set_profile(partitioned=False)
    await stack.wait_ready()
    status, body = await post(stack, "/chat/completions", chat_body("Back again?", 8))
    assert status == 200 and body["pdd"]["pipeline"] == "P-MD"
    await until(lambda: engines_idle(stack), 15, "no leftover sequences")


async def test_main_decode_crash_mid_request_fails_fast_without_recoveries(make_stack):
    stack = await make_stack(profile=SLOW_WAN, router_settings={"pipeline_policy": "P-MD", "max_recoveries": 0})
    main = stack.mains[0]
    request = asyncio.create_task(post(stack, "/chat/completions", chat_body("A long answer please. " * 10, 3000)))

    def decoding():  # the import is over (else the prefill's transfer is what fails first)
        return any(
            len(main.engine.get(rid).output_token_ids) > 1
            for rid in main.engine.request_ids()
            if main.engine.holds(rid)
        )

    await until(decoding, 15, "main decode to be decoding")
    await crash(main)  # no goodbye on NATS, the bulk port closes, decoding stops mid-stream
    started = time.monotonic()
    status, body = await asyncio.wait_for(request, 20)
    assert status == 502 and "main-decode-0" in body["error"]["message"]
    assert time.monotonic() - started < 10
    stack.mains.clear()  # already stopped


async def test_a_dead_routers_requests_are_freed_everywhere_within_the_lease(make_stack, tiny):
    # A 2 s lease here (8 s by default): the request, far from done, must be freed by it.
    lease = {"request_lease_s": 2.0}
    stack = await make_stack(
        profile=SLOW_WAN, router_settings={"pipeline_policy": "P-RLD-MD"}, engine_settings=lease, decode_settings=lease
    )
    max_tokens = tiny.model.config.max_position_embeddings - 100
    request = asyncio.create_task(post(stack, "/chat/completions", chat_body("Go on forever. " * 4, max_tokens)))
    main = stack.mains[0]
    await until(lambda: main.engine.num_sequences, 15, "main decode to hold the request")
    await crash(stack.router)  # no cancel will ever come
    started = time.monotonic()
    await until(lambda: engines_idle(stack), 10, "every engine to free the dead router's request")
    elapsed = time.monotonic() - started
    assert elapsed < 5, f"freed after {elapsed:.1f} s: by the request ending, not by its lease"
    request.cancel()


async def health(stack) -> dict:
    async with aiohttp.ClientSession() as session:
        async with session.get(stack.base_url.removesuffix("/v1") + "/health") as response:
            return await response.json()


async def test_a_stall_shorter_than_the_partition_tolerance_costs_nothing(make_stack, tiny):
    stack = await make_stack(profile=SLOW_WAN, router_settings={"pipeline_policy": "P-MD", "partition_tolerance_s": 8})
    content = "Describe the canal in winter. " * 8
    request = asyncio.create_task(stream_chunks(stack, "/chat/completions", chat_body(content, 400)))
    main = stack.mains[0]
    await until(lambda: main.engine.num_sequences, 15, "main decode to decode")
    stack.link.set_profile(partitioned=True)  # frozen, not dropped: a stall
    await until(lambda: "site-b" in stack.router.site_health.unreachable(), 10, "site B to go silent")
    assert (await health(stack))["sites"] == {"site-b": "unreachable"}
    status, during = await post(stack, "/chat/completions", chat_body("Meanwhile?", 8))
    assert status == 200 and during["pdd"]["pipeline"] == "P-RLD"
    stack.link.set_profile(partitioned=False)
    chunks = await asyncio.wait_for(request, 60)
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text == expected_text(tiny, chat_prompt(tiny, content), 400)
    assert chunks[-1]["pdd"]["recoveries"] == [] and chunks[-1]["pdd"]["finished_on"] == "MD"
    await until(lambda: stack.router.site_health.states["site-b"].value == "healthy", 10, "site B healthy again")


async def test_a_nats_restart_at_site_a_costs_a_stall_not_the_stream(make_stack, tiny):
    stack = await make_stack(profile=SLOW_WAN, router_settings={"pipeline_policy": "P-MD"})
    content = "Tell the story of the night ferry. " * 8
    request = asyncio.create_task(stream_chunks(stack, "/chat/completions", chat_body(content, 400)))
    main = stack.mains[0]
    prompt_blocks = []
    await until(lambda: main.engine.num_sequences, 15, "main decode to decode")
    prompt_blocks.append(main.engine.blocks.num_used_blocks)
    await until(lambda: main.engine.blocks.num_used_blocks >= prompt_blocks[0] + 1, 15, "tokens to flow")
    await stack.restart_nats("site-a")  # tokens published meanwhile are lost on core NATS
    chunks = await asyncio.wait_for(request, 45)
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text == expected_text(tiny, chat_prompt(tiny, content), 400)
    assert chunks[-1]["pdd"]["finished_on"] == "MD"
    await until(lambda: engines_idle(stack), 15, "no leftover sequences")


async def test_site_b_nats_down_past_the_tolerance_finishes_at_site_a_and_leaks_nothing(make_stack, tiny):
    lease = {"request_lease_s": 3.0, "cut_off_lease_s": 3.0}
    stack = await make_stack(
        profile=SLOW_WAN,
        router_settings={"pipeline_policy": "P-MD", "partition_tolerance_s": 3},
        engine_settings=lease,
        decode_settings=lease,
    )
    content = "Describe the lock gates at dusk. " * 8
    request = asyncio.create_task(stream_chunks(stack, "/chat/completions", chat_body(content, 400)))
    main = stack.mains[0]
    await until(lambda: main.engine.num_sequences, 15, "main decode to decode")
    await stack.stop_nats("site-b")
    chunks = await asyncio.wait_for(request, 45)
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text == expected_text(tiny, chat_prompt(tiny, content), 400)
    pdd = chunks[-1]["pdd"]
    assert pdd["pipeline"] == "P-RLD" and [r["from"] for r in pdd["recoveries"]] == ["main-decode-0"]
    # Cut off from every router, main decode frees the request by its lease: no zombie.
    await until(lambda: main.engine.num_sequences == 0, 15, "main decode to free the orphan")
    assert main.failure is None
    await stack.start_nats("site-b")
    await stack.wait_ready(30)
    status, body = await post(stack, "/chat/completions", chat_body("Back?", 8))
    # Served by main decode at once: its lease counts the router as heard when the request arrives.
    assert status == 200 and body["pdd"]["pipeline"] == "P-MD" and body["pdd"]["recoveries"] == [], body["pdd"]
    await until(lambda: engines_idle(stack), 15, "no leftover sequences")
