"""Every way a request ends on relay decode and main decode leaves nothing behind.

Each decoding service holds a request as one object in ``service.requests``, closed in one
place. Here each exit is driven on a real stack (real nats-servers, the WAN link, every
service, the tiny model): finished, handed over, cancelled (``stop`` and ``finished``),
lease expiry, a broken or refused import, an engine error for one sequence, a refused
handoff, a recovery, and a service stopping. The client gets what it should, and afterwards
no table holds a request and no engine a sequence or block.
"""

import asyncio

import aiohttp
import pytest

from services.relay_decode.handoff import HandoffState
from shared.errors import HandoffRefused, InvalidPrompt, InvalidRequestState
from shared.messages import CancelRequest
from shared.metrics import HANDOFF_SECONDS, LEASES_EXPIRED, REFUSED_MESSAGES
from tests.helpers import (
    CATCH_UP_WAN,
    SLOW_WAN,
    chat_body,
    chat_prompt,
    crash,
    engines_idle,
    expected_text,
    post,
    stream,
    until,
)

CATCH_UP_FOREVER = {
    "catch_up_threshold_tokens": 16,
    "final_gap_tokens": 0,
    "max_chunk_tokens": 2,
    "max_catch_up_chunks": 1000,
}
"""Many small catch-up chunks: a relayed request stays in catch-up for as long as it runs."""
ONE_SHOT = {"catch_up_threshold_tokens": 10_000}
ESSAY = "Write a long essay about lighthouses. " * 15
OWLS = "Tell me about owls. " * 20


def held(stack) -> dict[str, list[str]]:
    """The requests each decoding service still holds, by instance (those holding any)."""
    decoders = [*stack.relays, *stack.mains]
    return {s.instance_id: sorted(r.request_id for r in s.requests.values()) for s in decoders if len(s.requests)}


async def nothing_left(stack, timeout_s: float = 15):
    """Wait until no decoding service holds a request and no engine a sequence or block."""
    try:
        await until(lambda: not held(stack) and engines_idle(stack), timeout_s, "every request closed")
    except AssertionError:
        engines = {s.instance_id: s.engine.num_sequences for s in [stack.prefill, *stack.relays, *stack.mains]}
        raise AssertionError(f"still held: requests {held(stack)}, sequences {engines}") from None


def in_catch_up(relay) -> bool:
    return any(r.machine.state is HandoffState.CATCH_UP and r.machine.chunks >= 2 for r in relay.requests.values())


def handoffs_timed() -> float:
    """Handoffs the relays recorded as done (``pdd_handoff_seconds`` observations)."""
    return sum(s.value for m in HANDOFF_SECONDS.collect() for s in m.samples if s.name.endswith("_count"))


def text_of(chunks: list[dict]) -> str:
    return "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])


def answer_of(body: dict) -> str:
    return body["choices"][0]["message"]["content"]


async def still_served(stack):
    status, body = await post(stack, "/chat/completions", chat_body("Still there?", 8))
    assert status == 200 and body["usage"]["completion_tokens"] == 8, body


# --- the request ends normally ---------------------------------------------------------


@pytest.mark.parametrize(
    "mode,profile,relay_settings",
    [
        ("one-shot", SLOW_WAN, ONE_SHOT),
        # at most 4 chunks: a relay that decodes faster than chunks cross still hands over in time
        ("catch-up", CATCH_UP_WAN, {"catch_up_threshold_tokens": 32, "final_gap_tokens": 8, "max_catch_up_chunks": 4}),
    ],
)
async def test_a_handed_over_request_is_released_by_the_relay_and_finished_by_main_decode(
    make_stack, tiny, spans, mode, profile, relay_settings
):
    stack = await make_stack(
        profile=profile, router_settings={"pipeline_policy": "P-RLD-MD"}, relay_settings=relay_settings
    )
    # 1,200 tokens: on a fast host the tiny relay decodes 600 in about the time the KV takes to
    # cross the catch-up link, and would finish before the handoff.
    status, body = await post(stack, "/chat/completions", chat_body(ESSAY, 1200))
    assert status == 200, body
    assert answer_of(body) == expected_text(tiny, chat_prompt(tiny, ESSAY), 1200)
    assert body["pdd"]["handoff_mode"] == mode and body["pdd"]["finished_on"] == "MD"
    await nothing_left(stack)

    def relay_span():
        found = [s for s in spans.get_finished_spans() if s.name == "relay.decode"]
        return next((s for s in found if s.attributes["request_id"] == body["id"]), None)

    await until(relay_span, 10, "the relay's span to end")
    span = relay_span()
    assert span.attributes["handoff_mode"] == mode and span.attributes["handoff_chunks"] >= 1
    events = [e.name for e in span.events]
    assert "handoff_state" in events and "handoff_chunk" in events  # the machine's decisions


@pytest.mark.parametrize("odd", [True, False])
async def test_a_request_the_relay_finishes_is_closed_on_both_decoders(make_stack, tiny, odd):
    # 1 Mbit/s: the prompt's KV is still crossing when the relay has its 4 tokens. Main decode
    # gets a "stop" (odd traffic: the transfer is cut) or a "finished" cancel (the transfer
    # goes on for its cache) while it imports.
    narrow = {"ttft_target_ms": 100, "wan_bandwidth_mbit": 1, "wan_rtt_ms": 4, "relay_step_ms": 80}
    policy = {} if odd else {"odd_traffic_filter": False, "pipeline_policy": "P-RLD-MD"}
    stack = await make_stack(profile=CATCH_UP_WAN, router_settings={**narrow, **policy})
    content = "Summarise this log line by line. " * 40
    status, body = await post(stack, "/chat/completions", chat_body(content, 4))
    assert status == 200, body
    assert answer_of(body) == expected_text(tiny, chat_prompt(tiny, content), 4)
    assert body["pdd"]["finished_on"] == "RLD" and body["pdd"]["odd_traffic"] is odd
    await nothing_left(stack, 30)


# --- cancels, leases -----------------------------------------------------------------------


async def test_a_client_leaving_mid_catch_up_closes_the_request_on_both_decoders(make_stack):
    # The "stop" cancel reaches both while chunks go back and forth: the relay's handoff task
    # is cancelled, and a chunk main decode is absorbing is answered at once.
    stack = await make_stack(
        profile=CATCH_UP_WAN, router_settings={"pipeline_policy": "P-RLD-MD"}, relay_settings=CATCH_UP_FOREVER
    )
    async with aiohttp.ClientSession() as session:
        response = await session.post(
            stack.base_url + "/chat/completions", json={**chat_body(ESSAY, 600), "stream": True}
        )
        assert response.status == 200
        await until(lambda: in_catch_up(stack.relays[0]), 30, "catch-up to be under way")
        response.close()
    await nothing_left(stack)
    await still_served(stack)


@pytest.mark.parametrize("letting_go", ["finished", "stop", "service stop"])
async def test_a_relay_letting_go_during_its_final_handoff_still_gives_the_whole_answer(make_stack, tiny, letting_go):
    """Main decode holds its answer to the relay's final chunk while the relay lets go of the
    request: a "finished" cancel (as when the request ended elsewhere) leaves the handoff to
    hear the answer and record it; "stop" and a stopping relay cancel it. Main decode owns the
    request either way and the client gets the whole answer."""
    stack = await make_stack(profile=SLOW_WAN, router_settings={"pipeline_policy": "P-RLD-MD"}, relay_settings=ONE_SHOT)
    relay, main = stack.relays[0], stack.mains[0]
    answering, release = asyncio.Event(), asyncio.Event()
    answer = main.handoffs._answer

    async def answer_once_released(msg, handoff, seq):
        answering.set()
        await release.wait()
        await answer(msg, handoff, seq)

    main.handoffs._answer = answer_once_released  # the fault: a slow answer from main decode
    request = asyncio.create_task(post(stack, "/chat/completions", chat_body(OWLS, 150)))
    await until(answering.is_set, 30, "main decode to hold its answer to the final chunk")
    (relayed,) = relay.requests.values()
    timed = handoffs_timed()
    if letting_go == "service stop":
        await relay.stop()
        stack.relays.clear()
    else:
        await relay.on_cancel(CancelRequest(request_id=relayed.request_id, kind=letting_go, reason="test"))
    assert relayed.closed and len(relay.requests) == 0 and relay.engine.num_sequences == 0
    if letting_go == "finished":
        assert relayed.handing_over
    else:
        await until(lambda: not relayed.handing_over, 5, "the handoff to be cancelled")
    release.set()
    status, body = await asyncio.wait_for(request, 60)
    assert status == 200, body
    assert answer_of(body) == expected_text(tiny, chat_prompt(tiny, OWLS), 150)
    assert body["pdd"]["finished_on"] == "MD" and body["pdd"]["handoff_mode"] == "one-shot"
    await until(lambda: not relayed.handing_over, 10, "the handoff to hear main decode's answer")
    assert handoffs_timed() == timed + (1 if letting_go == "finished" else 0)
    await nothing_left(stack)


async def test_a_dead_routers_request_mid_catch_up_is_freed_by_the_leases(make_stack, tiny):
    lease = {"request_lease_s": 2.0}
    stack = await make_stack(
        profile=CATCH_UP_WAN,
        router_settings={"pipeline_policy": "P-RLD-MD"},
        engine_settings=lease,
        decode_settings=lease,
        relay_settings=CATCH_UP_FOREVER,
    )
    expired = {s: LEASES_EXPIRED.labels(s, "kill")._value.get() for s in ("relay_decode", "main_decode")}
    max_tokens = tiny.model.config.max_position_embeddings - 400
    request = asyncio.create_task(post(stack, "/chat/completions", chat_body(ESSAY, max_tokens)))
    await until(lambda: in_catch_up(stack.relays[0]), 30, "catch-up to be under way")
    await crash(stack.router)  # no cancel will ever come
    await nothing_left(stack, 10)
    assert all(LEASES_EXPIRED.labels(s, "kill")._value.get() == n + 1 for s, n in expired.items())
    assert all(s.failure is None for s in [*stack.relays, *stack.mains])
    request.cancel()


# --- failures --------------------------------------------------------------------------


async def test_a_broken_import_fails_the_request_and_main_decode_closes_it(make_stack):
    stack = await make_stack(profile=SLOW_WAN, router_settings={"pipeline_policy": "P-MD", "max_recoveries": 0})
    engine = stack.mains[0].engine
    finish_import = engine.finish_import

    def failing_once(*args, **kwargs):
        engine.finish_import = finish_import
        raise InvalidRequestState("injected: the KV does not fit the sequence")

    engine.finish_import = failing_once
    status, body = await post(stack, "/chat/completions", chat_body(OWLS, 40))
    assert status == 502 and "kv_flow_broken" in body["error"]["message"], body
    await nothing_left(stack)
    await still_served(stack)


async def test_a_flow_the_relay_refuses_leaves_no_request_behind(make_stack):
    stack = await make_stack(router_settings={"pipeline_policy": "P-RLD-MD", "max_recoveries": 0})
    engine = stack.relays[0].engine
    begin_import = engine.begin_import

    def refusing_once(*args, **kwargs):
        engine.begin_import = begin_import
        raise InvalidPrompt("injected: the relay cannot take this prompt")

    engine.begin_import = refusing_once
    status, body = await post(stack, "/chat/completions", chat_body(OWLS, 40))
    assert status == 502 and "refused flow: invalid_prompt" in body["error"]["message"], body
    await nothing_left(stack)
    await still_served(stack)


@pytest.mark.parametrize("role", ["relay_decode", "main_decode"])
async def test_an_engine_error_for_one_sequence_fails_that_request_and_closes_it(make_stack, role):
    relayed = role == "relay_decode"
    stack = await make_stack(
        profile=CATCH_UP_WAN
        if relayed
        else SLOW_WAN,  # relayed: the relay samples long before main decode holds the KV
        router_settings={"pipeline_policy": "P-RLD-MD" if relayed else "P-MD", "max_recoveries": 0},
    )
    sampler = (stack.relays[0] if relayed else stack.mains[0]).engine.sampler
    sample = sampler.sample

    def failing_once(seq, logits, facts=None):
        sampler.sample = sample
        raise RuntimeError("injected: the sampler broke")

    sampler.sample = failing_once
    status, body = await post(stack, "/chat/completions", chat_body(ESSAY, 40))
    assert status == 502 and "sampling_failed" in body["error"]["message"], body
    await nothing_left(stack)
    await still_served(stack)


async def test_a_refused_handoff_lets_the_relay_finish_and_closes_the_request_on_both(make_stack, tiny):
    stack = await make_stack(profile=SLOW_WAN, router_settings={"pipeline_policy": "P-RLD-MD"}, relay_settings=ONE_SHOT)
    engine = stack.mains[0].engine
    refused = REFUSED_MESSAGES.labels("main_decode", "handoff")._value.get()

    def refusing(request_id, token_ids, sample=True):
        raise HandoffRefused("injected: main decode cannot take this handoff")

    engine.extend = refusing
    # 600 tokens: the relay must still be decoding when the KV lands and the handoff is tried
    # (a fast host's tiny relay can finish 120 before).
    status, body = await post(stack, "/chat/completions", chat_body(OWLS, 600))
    assert status == 200, body
    assert answer_of(body) == expected_text(tiny, chat_prompt(tiny, OWLS), 600)
    assert body["pdd"]["finished_on"] == "RLD"
    assert REFUSED_MESSAGES.labels("main_decode", "handoff")._value.get() == refused + 1
    await nothing_left(stack)


# --- recovery, stopping ----------------------------------------------------------------


async def test_a_relay_dying_mid_catch_up_resumes_on_main_decode_and_leaves_nothing(make_stack, tiny):
    # Main decode holds the failed attempt with chunks absorbed (killed), then imports the new
    # attempt and recomputes every token the client already has.
    stack = await make_stack(
        profile=CATCH_UP_WAN, router_settings={"pipeline_policy": "P-RLD-MD"}, relay_settings=CATCH_UP_FOREVER
    )
    relay = stack.relays[0]
    request = asyncio.create_task(stream(stack, "/chat/completions", chat_body(ESSAY, 600)))
    await until(lambda: in_catch_up(relay), 30, "catch-up to be under way")
    await crash(relay)
    stack.relays.clear()
    chunks = await asyncio.wait_for(request, 60)
    assert text_of(chunks) == expected_text(tiny, chat_prompt(tiny, ESSAY), 600)
    pdd = chunks[-1]["pdd"]
    assert [(r["from"], r["to"]) for r in pdd["recoveries"]] == [("relay-decode-0", "main-decode-0")]
    await nothing_left(stack)


async def test_a_main_decoder_stopping_closes_what_it_holds_and_the_relay_finishes(make_stack, tiny):
    stack = await make_stack(profile=SLOW_WAN, router_settings={"pipeline_policy": "P-RLD-MD"})
    relay, main = stack.relays[0], stack.mains[0]

    async def never_ready(request):
        """The fault: the relay never learns main decode holds the prompt."""

    relay._main_decode_ready = never_ready
    request = asyncio.create_task(post(stack, "/chat/completions", chat_body(OWLS, 150)))
    await until(lambda: any(r.relay_id for r in main.requests.values()), 30, "main decode to wait for a handoff")
    # Stopped once its KV events are out: cancelling a publish that awaits its JetStream ack
    # can lose the cancel (asyncio.wait_for in Python 3.11) and hang Service.stop, a known
    # problem of the service base this test is not about.
    index = stack.cache_index.instances[main.instance_id]
    num_blocks = len(chat_prompt(tiny, OWLS)) // 16
    await until(lambda: len(index.block_hashes) >= num_blocks, 15, "main decode's KV events to be out")
    await main.stop()
    stack.mains.clear()
    assert len(main.requests) == 0 and main.engine.num_sequences == 0
    status, body = await asyncio.wait_for(request, 60)
    assert status == 200, body
    assert answer_of(body) == expected_text(tiny, chat_prompt(tiny, OWLS), 150)
    assert body["pdd"]["finished_on"] == "RLD"
    await nothing_left(stack)
