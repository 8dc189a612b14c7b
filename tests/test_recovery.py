"""Recovery by token replay: an instance dies mid-stream, the request resumes elsewhere.

The crashed actor drops everything without a goodbye (engine loop, heartbeats, bulk port,
NATS connection) while real nats-servers, the WAN link and every other service go on. The
client must get the text transformers' greedy decoding gives, every token index once, and
the ``pdd`` object must say who failed and who took over.
"""

import asyncio

from services.relay_decode.handoff import HandoffState
from tests.helpers import CATCH_UP_WAN, SLOW_WAN, chat_body, chat_prompt, crash, engines_idle, expected_text, until
from tests.helpers import stream as stream_chunks


def streamed_text(chunks: list[dict]) -> str:
    return "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])


async def busy_main_decoder(stack):
    """The main decoder the request runs on, once it decodes."""
    await until(lambda: any(m.engine.num_sequences for m in stack.mains), 15, "decoding to start")
    return next(m for m in stack.mains if m.engine.num_sequences)


async def stream_while(stack, body: dict, during) -> list[dict]:
    """Stream ``body`` and run ``during()`` concurrently; return the chunks."""
    request = asyncio.create_task(stream_chunks(stack, "/chat/completions", body))
    await during()
    return await asyncio.wait_for(request, 60)


async def test_a_main_decoder_dying_mid_stream_is_replaced_by_the_other(make_stack, tiny):
    stack = await make_stack(profile=SLOW_WAN, num_main=2, router_settings={"pipeline_policy": "P-MD"})
    content = "Tell me about the harbour at dawn. " * 8
    victim = []

    async def kill_the_busy_decoder():
        busy = await busy_main_decoder(stack)
        prompt_blocks = busy.engine.blocks.num_used_blocks
        await until(
            lambda: busy.engine.blocks.num_used_blocks >= prompt_blocks + 2, 15, "over a block of tokens streamed"
        )
        victim.append(busy.instance_id)
        await crash(busy)

    chunks = await stream_while(stack, chat_body(content, 300), kill_the_busy_decoder)
    assert streamed_text(chunks) == expected_text(tiny, chat_prompt(tiny, content), 300)
    pdd = chunks[-1]["pdd"]
    survivor = ({"main-decode-0", "main-decode-1"} - set(victim)).pop()
    assert [(r["from"], r["to"], r["reason"]) for r in pdd["recoveries"]] == [
        (victim[0], survivor, "instance_unresponsive")
    ]
    assert pdd["recoveries"][0]["at_token"] > 0 and pdd["instances"]["main_decode"] == survivor
    stack.mains[:] = [m for m in stack.mains if m.instance_id != victim[0]]
    await until(lambda: engines_idle(stack), 15, "every survivor to free the request")


async def test_a_relay_dying_mid_catch_up_hands_the_stream_to_main_decode(make_stack, tiny):
    # Many small catch-up chunks keep the relay in catch-up long enough to die in it.
    stack = await make_stack(
        profile=CATCH_UP_WAN,
        router_settings={"pipeline_policy": "P-RLD-MD"},
        relay_settings={
            "catch_up_threshold_tokens": 16,
            "final_gap_tokens": 0,
            "max_chunk_tokens": 2,
            "max_catch_up_chunks": 1000,
        },
    )
    relay = stack.relays[0]
    content = "Write a long essay about lighthouses. " * 15

    async def kill_the_relay_in_catch_up():
        await until(
            lambda: any(
                m.state is HandoffState.CATCH_UP and m.chunks >= 2 for m in (r.machine for r in relay.requests.values())
            ),
            30,
            "catch-up to be under way",
        )
        await crash(relay)

    chunks = await stream_while(stack, chat_body(content, 600), kill_the_relay_in_catch_up)
    assert streamed_text(chunks) == expected_text(tiny, chat_prompt(tiny, content), 600)
    pdd = chunks[-1]["pdd"]
    assert [(r["from"], r["to"]) for r in pdd["recoveries"]] == [("relay-decode-0", "main-decode-0")]
    assert pdd["finished_on"] == "MD" and pdd["pipeline"] == "P-MD" and pdd["eager_tokens"] > 16
    stack.relays.clear()
    await until(lambda: engines_idle(stack), 15, "main decode and prefill to free the request")


async def test_recoveries_are_bounded(make_stack):
    stack = await make_stack(profile=SLOW_WAN, router_settings={"pipeline_policy": "P-MD", "max_recoveries": 1})
    main, relay = stack.mains[0], stack.relays[0]

    async def kill_main_decode_then_the_relay():
        # Decoding, not still importing: a crash mid-import fails the prefill's shipping instead.
        await until(
            lambda: main.engine.num_sequences == 1 and not main.importer.request_ids,
            15,
            "main decode to start decoding",
        )
        await crash(main)
        # No main decoder left: the one recovery goes to the relay, which then dies too.
        await until(
            lambda: relay.engine.num_sequences == 1 and not relay.importer.request_ids,
            15,
            "the relay to take over and decode",
        )
        await crash(relay)

    chunks = await stream_while(stack, chat_body("A long answer please. " * 10, 3000), kill_main_decode_then_the_relay)
    error = chunks[-1]["error"]
    assert error["code"] == "upstream_failed" and "relay-decode-0" in error["message"], error
    stack.mains.clear()
    stack.relays.clear()


async def test_a_dead_engine_loop_fails_its_service_and_the_request_recovers(make_stack, tiny):
    stack = await make_stack(profile=SLOW_WAN, num_main=2, router_settings={"pipeline_policy": "P-MD"})
    content = "Tell me about the lock keeper's day. " * 8
    broken = []

    async def break_the_busy_engine():
        busy = await busy_main_decoder(stack)

        def step():
            raise RuntimeError("injected: device lost")

        busy.engine.step = step
        broken.append(busy)

    chunks = await stream_while(stack, chat_body(content, 300), break_the_busy_engine)
    assert streamed_text(chunks) == expected_text(tiny, chat_prompt(tiny, content), 300)
    dead = broken[0]
    assert [r["from"] for r in chunks[-1]["pdd"]["recoveries"]] == [dead.instance_id]
    assert "engine-loop died" in dead.failure and dead.failed.is_set()
    assert stack.router.registry.is_dead(dead.instance_ref())  # it stopped heart-beating


async def test_a_failed_service_process_exits_non_zero(make_stack):
    from services.cache_index.service import CacheIndexService
    from shared.service import run_service

    stack = await make_stack()
    service = CacheIndexService(stack.cache_index.config)
    running = asyncio.create_task(run_service(service))
    await until(lambda: service.failure is None and service._tasks, 10, "the service to start")
    service.fail("injected failure")
    assert await asyncio.wait_for(running, 10) == 1
