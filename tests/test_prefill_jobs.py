"""Every way a prefill request ends frees what it held at the prefill.

A prefill job holds a prefill slot, an engine sequence, its KV flows (one per receiver) and
its trace spans. Each test drives one way out on a real stack: served (both pipelines), the
client leaving mid-request, a receiver refusing the flow or unreachable, a request cancelled
while it waits for a slot or computes, its router dying (the lease), its router finishing it
while its KV still has to reach main decode. Afterwards the prefill holds no job and no
engine holds a sequence or a block; where a leak would show, the next request is served.

Two injections stand for slow parts: main decode answering a flow late (as it does while
blocks the prompt needs are still arriving on another flow), and prefill's engine steps
held (a long prompt computing).
"""

import asyncio
import threading

import aiohttp
import pytest

from shared.errors import OutOfKvBlocks
from tests.helpers import chat_body, chat_prompt, crash, engines_idle, expected_text, held_engine_step, post, until


async def all_freed(stack):
    await until(
        lambda: not stack.prefill.jobs and engines_idle(stack), 15, "prefill's jobs to close and every engine to idle"
    )


class LateAcceptance:
    """Main decode answers flows only once ``release`` is set."""

    def __init__(self, main, monkeypatch):
        self.release = asyncio.Event()
        self.waiting = asyncio.Event()
        open_flow = main.importer.open_flow

        async def late_open_flow(flow_open, stats):
            self.waiting.set()
            await self.release.wait()
            return await open_flow(flow_open, stats)

        monkeypatch.setattr(main.importer, "open_flow", late_open_flow)


class HeldSteps:
    """Prefill's engine steps wait (on the engine thread) until ``release`` is set."""

    def __init__(self, prefill):
        self.release = threading.Event()
        self.added: list[str] = []
        """Request ids of the prompts added to the engine, in order."""
        submit = prefill.worker.submit

        def held_submit(fn, *args, **kwargs):
            if getattr(fn, "__name__", "") == "add_request":
                self.added.append(args[0])
            return submit(held_engine_step(fn, args, kwargs, lambda: self.release.wait(30)))

        prefill.worker.submit = held_submit


class Client:
    """A client sending one non-streaming request, who may leave before the answer."""

    def __init__(self, stack, body: dict):
        self.session = aiohttp.ClientSession()
        self.request = asyncio.create_task(self.session.post(stack.base_url + "/chat/completions", json=body))

    async def leave(self):
        self.request.cancel()
        await self.session.close()


@pytest.mark.parametrize("policy", ["P-MD", "P-RLD-MD"])
async def test_a_served_request_leaves_no_job_behind(make_stack, tiny, policy):
    stack = await make_stack(router_settings={"pipeline_policy": policy})
    content = "Describe the harbour at dawn. " * 6
    status, body = await post(stack, "/chat/completions", chat_body(content, 24))
    assert status == 200 and body["pdd"]["pipeline"] == policy, body
    assert body["choices"][0]["message"]["content"] == expected_text(tiny, chat_prompt(tiny, content), 24)
    await all_freed(stack)


async def test_a_client_leaving_while_its_kv_waits_for_main_decode_frees_everything(make_stack, tiny, monkeypatch):
    # The relay streams eager tokens while the WAN flow still waits for main decode's answer:
    # the prefill still holds the sequence, the slot and both flows when the client leaves.
    stack = await make_stack(router_settings={"pipeline_policy": "P-RLD-MD"})
    late = LateAcceptance(stack.mains[0], monkeypatch)
    try:
        async with aiohttp.ClientSession() as session:
            body = {**chat_body("Tell a very long story. " * 20, 3000), "stream": True}
            async with session.post(stack.base_url + "/chat/completions", json=body) as response:
                assert response.status == 200
                chunks = 0
                async for line in response.content:
                    chunks += line.startswith(b"data: {")
                    if chunks == 5:
                        break
                assert late.waiting.is_set() and len(stack.prefill.jobs) == 1  # mid-request at the prefill
                response.close()
        await until(lambda: not stack.prefill.jobs, 15, "the prefill to drop the request")
    finally:
        late.release.set()
    await all_freed(stack)
    content = "Still there?"
    status, body = await post(stack, "/chat/completions", chat_body(content, 8))
    assert status == 200 and body["choices"][0]["message"]["content"] == expected_text(
        tiny, chat_prompt(tiny, content), 8
    )


async def test_a_main_decoder_refusing_the_flow_fails_the_request_cleanly(make_stack, monkeypatch):
    stack = await make_stack(router_settings={"pipeline_policy": "P-MD", "max_recoveries": 0})

    async def refuse(flow_open, stats):
        raise OutOfKvBlocks("no room for this prompt")

    monkeypatch.setattr(stack.mains[0].importer, "open_flow", refuse)
    status, body = await post(stack, "/chat/completions", chat_body("Anyone with room? " * 6, 16))
    assert status == 502, body
    assert "bulk_flow_refused" in body["error"]["message"] and "no room" in body["error"]["message"], body
    await all_freed(stack)


async def test_an_unreachable_relay_fails_the_request_and_frees_main_decodes_copy(make_stack):
    stack = await make_stack(router_settings={"pipeline_policy": "P-RLD-MD", "max_recoveries": 0})
    await stack.relays[0].receiver.stop()  # heart-beating, but its bulk port is closed
    status, body = await post(stack, "/chat/completions", chat_body("Is the relay there? " * 6, 16))
    assert status == 502 and "bulk_unreachable" in body["error"]["message"], body
    await all_freed(stack)


async def test_requests_cancelled_while_waiting_for_a_slot_or_computing_give_the_slot_back(make_stack, tiny):
    stack = await make_stack(
        engine_settings={"max_sequences": 1},  # one prompt at a time at the prefill
        decode_settings={"max_sequences": 4},
        router_settings={"pipeline_policy": "P-MD"},
    )
    prefill = stack.prefill
    steps = HeldSteps(prefill)
    computing = waiting = None
    try:
        computing = Client(stack, chat_body("The first prompt. " * 8, 16))
        await until(lambda: len(steps.added) == 1, 15, "the first prompt to be computing")
        job = prefill.jobs[steps.added[0]]
        waiting = Client(stack, chat_body("The second prompt. " * 8, 16))
        await until(lambda: len(prefill.jobs) == 2, 15, "the second prompt to wait for the slot")
        await waiting.leave()
        await until(lambda: list(prefill.jobs) == steps.added, 15, "the waiting request's job to close")
        await computing.leave()
        await until(lambda: job.first_token.cancelled(), 15, "the computing request to be cancelled")
    finally:
        steps.release.set()
        for client in (computing, waiting):
            if client is not None:
                await client.leave()
    await all_freed(stack)
    assert len(steps.added) == 1  # the second prompt never reached the engine
    content = "The third prompt."
    status, body = await post(stack, "/chat/completions", chat_body(content, 8))
    assert status == 200 and body["choices"][0]["message"]["content"] == expected_text(
        tiny, chat_prompt(tiny, content), 8
    )


async def test_a_dead_routers_request_is_freed_by_its_lease(make_stack, monkeypatch):
    # Main decode does not answer the flow: only the lease can end the prefill's job.
    stack = await make_stack(engine_settings={"request_lease_s": 2.0}, router_settings={"pipeline_policy": "P-MD"})
    late = LateAcceptance(stack.mains[0], monkeypatch)
    request = asyncio.create_task(post(stack, "/chat/completions", chat_body("Anyone there? " * 6, 16)))
    try:
        await until(lambda: late.waiting.is_set() and stack.prefill.jobs, 15, "the prefill to wait for main decode")
        await crash(stack.router)  # no cancel will ever come
        await until(lambda: not stack.prefill.jobs, 15, "the lease to end the prefill's job")
    finally:
        late.release.set()
        request.cancel()
    await all_freed(stack)


async def test_a_request_finished_on_the_relay_still_ships_to_main_decode_then_closes(make_stack, tiny, monkeypatch):
    # The relay finishes a short answer while main decode has not yet taken the WAN flow:
    # the prefill ships on for main decode's cache, and no lease counts it as held meanwhile.
    stack = await make_stack(router_settings={"pipeline_policy": "P-RLD-MD", "odd_traffic_filter": False})
    late = LateAcceptance(stack.mains[0], monkeypatch)
    content = "Summarise this line. " * 12
    try:
        status, body = await post(stack, "/chat/completions", chat_body(content, 4))
        assert status == 200 and body["pdd"]["finished_on"] == "RLD", body
        assert body["choices"][0]["message"]["content"] == expected_text(tiny, chat_prompt(tiny, content), 4)
        (request_id,) = stack.prefill.jobs
        await until(lambda: stack.prefill.jobs[request_id].ships_for_cache, 15, "the router's finished cancel")
        assert request_id not in await stack.prefill.held_request_ids()
    finally:
        late.release.set()
    num_blocks = len(chat_prompt(tiny, content)) // 16
    index = stack.cache_index.instances["main-decode-0"]
    await until(lambda: len(index.block_hashes) >= num_blocks, 15, "main decode to cache every block")
    await all_freed(stack)
