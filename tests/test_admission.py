"""Admission control at the routers, against a real stack: a burst beyond what the decoders
hold is queued or refused with 429 and Retry-After, never a 5xx; no engine holds more than its
max_sequences, also when two routers share it; /health keeps answering; what is admitted is
exact; queue time is reported."""

import asyncio
import time

import aiohttp
import pytest

from tests.helpers import chat_body, chat_prompt, expected_text, until

MAX_SEQUENCES = 3


async def post_status(session, stack, body, router: int = 0) -> tuple[int, dict, dict]:
    async with session.post(stack.router_url(router) + "/chat/completions", json=body) as response:
        return response.status, dict(response.headers), await response.json()


async def test_a_burst_over_two_routers_is_queued_or_refused_with_429_and_no_engine_exceeds_max_sequences(
    make_stack, tiny
):
    # Two routers share the one main decoder's 3 slots (2 + 1); each queues 4 more.
    stack = await make_stack(
        num_routers=2,
        engine_settings={"max_sequences": MAX_SEQUENCES},
        router_settings={"pipeline_policy": "P-MD", "max_queued": 4, "queue_timeout_s": 60},
    )
    engines = [stack.prefill, *stack.relays, *stack.mains]
    most_held = {e.instance_id: 0 for e in engines}
    most_admitted = 0  # by both routers together
    health_s: list[float] = []
    stop = asyncio.Event()

    async def watch():
        nonlocal most_admitted
        async with aiohttp.ClientSession() as session:
            while not stop.is_set():
                for engine in engines:
                    most_held[engine.instance_id] = max(most_held[engine.instance_id], engine.engine.num_sequences)
                most_admitted = max(most_admitted, sum(router.admission.in_flight for router in stack.routers))
                started = time.monotonic()
                async with session.get(stack.base_url.removesuffix("/v1") + "/health") as response:
                    await response.read()
                health_s.append(time.monotonic() - started)
                await asyncio.sleep(0.01)

    contents = [f"Burst request {i}: tell a story about boats." for i in range(30)]
    watcher = asyncio.create_task(watch())
    async with aiohttp.ClientSession() as session:
        results = await asyncio.gather(
            *(post_status(session, stack, chat_body(c, 24), router=i % 2) for i, c in enumerate(contents))
        )
    stop.set()
    await watcher
    statuses = [status for status, _, _ in results]
    assert set(statuses) <= {200, 429}, statuses
    assert statuses.count(200) >= MAX_SEQUENCES + 4  # the running ones and the queued ones
    assert statuses.count(429) >= 1
    for status, headers, body in results:
        if status == 429:
            assert int(headers["Retry-After"]) >= 1 and body["error"]["code"] == "rate_limit_exceeded"
    for (status, _, body), content in zip(results, contents):
        if status == 200:
            assert body["choices"][0]["message"]["content"] == expected_text(tiny, chat_prompt(tiny, content), 24)
    assert any(body["pdd"]["queue_ms"] > 0 for status, _, body in results if status == 200)
    assert max(most_held.values()) <= MAX_SEQUENCES, most_held
    assert most_admitted <= MAX_SEQUENCES  # the main decoder never had more to hold
    assert max(health_s) < 2.0


async def test_a_request_no_pool_can_hold_gets_400_before_dispatch(make_stack):
    stack = await make_stack(engine_settings={"kv_cache_mb": 1})
    pool = stack.mains[0].engine.blocks.num_blocks
    words = "word " * (pool * 16)
    async with aiohttp.ClientSession() as session:
        status, _, body = await post_status(
            session,
            stack,
            {"model": "tiny", "messages": [{"role": "user", "content": words[:3000]}], "max_tokens": pool * 16},
        )
    assert status == 400 and body["error"]["code"] in ("kv_capacity_exceeded", "context_length_exceeded"), body
    assert not stack.router.mailbox.open_request_ids


@pytest.mark.parametrize("queue_timeout_s", [0.5])
async def test_a_wait_longer_than_the_queue_timeout_gets_429(make_stack, queue_timeout_s):
    stack = await make_stack(
        router_settings={"pipeline_policy": "P-MD", "max_in_flight": 1, "queue_timeout_s": queue_timeout_s}
    )
    async with aiohttp.ClientSession() as session:
        # Long enough to outlast the queue timeout on a fast host (300 tiny tokens may not).
        long = asyncio.create_task(post_status(session, stack, chat_body("Long one. " * 5, 1500)))
        await until(lambda: stack.router.admission.in_flight == 1, 10, "the first request to run")
        status, headers, body = await post_status(session, stack, chat_body("Short one.", 2))
        assert status == 429 and "Retry-After" in headers, body
        assert (await long)[0] == 200


async def test_a_full_kv_pool_makes_flows_wait_and_decodes_preempt_instead_of_failing(make_stack, tiny):
    # Main decode's pool (128 blocks of 16 tokens) holds three of these prompts, not four,
    # and not three with their outputs: the fourth flow waits, and decoding preempts.
    stack = await make_stack(
        decode_settings={"kv_cache_mb": 1}, router_settings={"pipeline_policy": "P-MD", "max_recoveries": 0}
    )
    contents = [f"Case {i}: " + "summarise the tide tables of the northern coast. " * 55 for i in range(4)]
    async with aiohttp.ClientSession() as session:
        results = await asyncio.gather(*(post_status(session, stack, chat_body(c, 250)) for c in contents))
    for (status, _, body), content in zip(results, contents):
        assert status == 200, body
        assert body["choices"][0]["message"]["content"] == expected_text(tiny, chat_prompt(tiny, content), 250)
    main = stack.mains[0]
    assert main.importer.admission.num_waits_for_room >= 1 and main.engine.num_preemptions >= 1
