"""Bad messages are harmless: garbage or a message of the wrong type on any subject is
counted, dead-lettered at its site, and never fatal to an actor or a request."""

import asyncio

from shared import subjects
from shared.dead_letters import BAD_MESSAGES, STREAM_NAME
from shared.messages import TokensEmitted, encode
from tests.helpers import SLOW_WAN, chat_body, chat_prompt, expected_text, post, until


def bad_count(service: str) -> float:
    return sum(
        sample.value
        for metric in BAD_MESSAGES.collect()
        for sample in metric.samples
        if sample.name.endswith("_total") and sample.labels["service"] == service
    )


async def test_garbage_on_every_subject_leaves_a_running_request_exact(make_stack, tiny):
    stack = await make_stack(profile=SLOW_WAN, router_settings={"pipeline_policy": "P-RLD-MD"})
    content = "Count the boats in the harbour. " * 10
    services = ("router", "prefill", "relay_decode", "main_decode", "cache_index")
    before = {s: bad_count(s) for s in services}
    request = asyncio.create_task(post(stack, "/chat/completions", chat_body(content, 200)))
    await until(lambda: stack.relays[0].engine.num_sequences, 15, "the relay to decode")
    rid = next(iter(stack.router.mailbox.open_request_ids))
    wrong_type = encode(
        TokensEmitted(request_id=rid, start_index=0, token_ids=[1], producer="MD", instance_id="forger")
    )
    # Garbage from peers holding the role each subject needs (a buggy peer, not a forger).
    nc = await stack.connect("site-a", "router-0")
    nc_b = await stack.connect("site-b", "main-decode-0")
    nc_relay = await stack.connect("site-a", "relay-decode-0")
    try:
        for payload in (b"\xc1garbage", wrong_type):
            await nc.publish(subjects.cancel("router-0"), payload)
            await nc.publish(subjects.shared_work("site-a", "prefill", subjects.START_PREFILL), payload)
            await nc_b.publish(subjects.request_events(rid, "main-decode-0"), payload)
            await nc_b.publish(subjects.load("site-b", "main_decode", "main-decode-0"), payload)
            await nc.publish(subjects.shared_work("site-a", "cache_index", subjects.OVERLAP), payload)
            await nc_relay.publish(subjects.handoff("site-b", "main-decode-0", "relay-decode-0"), payload)
        await nc_b.publish(subjects.tokens(rid, "main-decode-0"), b"\xc1garbage")
        for client in (nc, nc_b, nc_relay):
            await client.flush()
        status, body = await request
        assert status == 200, body
        assert body["choices"][0]["message"]["content"] == expected_text(tiny, chat_prompt(tiny, content), 200)
        await until(
            lambda: all(bad_count(s) > before[s] for s in services),
            10,
            "every service to count what it could not decode",
        )
        admin = await stack.connect("site-a", "admin")  # only the deployment's admin reads streams
        try:
            info = await admin.jetstream().stream_info(STREAM_NAME)
        finally:
            await admin.close()
        assert info.state.messages >= 10
    finally:
        for client in (nc, nc_b, nc_relay):
            await client.close()
