"""Tokens published at the other site right after a request starts reach the router.

Two real nats-servers joined by a leafnode through the WAN link with a long RTT, so that
interest made at request time could not cross in time: the main decoder publishing the
first token the moment it holds the KV must still be heard.
"""

import asyncio

import msgspec
import nats
import pytest_asyncio

from infra.local_stack import SITE_A, SITE_B, start_site_pair
from infra.wan_link import LinkProfile, WanLink
from services.router.mailbox import RequestMailbox
from shared import subjects
from shared.dead_letters import BadMessageSink
from shared.messages import KvReady, StepTokens, TokensEmitted, encode

RTT_MS = 400


@pytest_asyncio.fixture
async def two_sites(tmp_path):
    link, processes = WanLink(LinkProfile(bandwidth_bps=0, rtt_ms=RTT_MS, jitter_ms=0)), []
    try:
        sites = await start_site_pair(link, tmp_path, processes)
        router_nc = await nats.connect(sites[SITE_A].url)
        main_nc = await nats.connect(sites[SITE_B].url)
        yield router_nc, main_nc
        await router_nc.close()
        await main_nc.close()
    finally:
        await link.close()
        for process in processes:
            process.terminate()
            process.wait(timeout=5)


def kv_ready(request_id: str) -> KvReady:
    """main-decode-0's ``KvReady`` for ``request_id``."""
    return KvReady(
        request_id=request_id,
        instance_id="main-decode-0",
        site=SITE_B,
        cached_tokens=0,
        imported_tokens=0,
        wan_kv_bytes=0,
        transfer_s=0.0,
        throughput_bps=0.0,
    )


async def started_mailbox(router_nc, main_nc) -> RequestMailbox:
    """A router's mailbox whose standing interest has reached site B (as at router start-up)."""
    mailbox = RequestMailbox(router_nc, "router-0", BadMessageSink(router_nc, SITE_A, "router", "router-0"))
    await mailbox.start()
    probe_id = subjects.new_request_id("router-0", "probe")
    probe = mailbox.open(probe_id)
    while True:
        await main_nc.publish(subjects.request_events(probe_id, "main-decode-0"), encode(kv_ready(probe_id)))
        try:
            await asyncio.wait_for(probe.take(), 0.2)
            break
        except TimeoutError:
            pass
    mailbox.close(probe_id)
    return mailbox


async def test_first_token_published_at_once_by_the_other_site_arrives(two_sites):
    router_nc, main_nc = two_sites
    mailbox = await started_mailbox(router_nc, main_nc)
    request_id = subjects.new_request_id("router-0", "abc123")
    inbox = mailbox.open(request_id)
    await main_nc.publish(
        subjects.tokens(request_id, "main-decode-0"),
        encode(
            TokensEmitted(
                request_id=request_id, start_index=0, token_ids=[7], producer="MD", instance_id="main-decode-0"
            )
        ),
    )
    [(kind, message)] = await asyncio.wait_for(inbox.take(), 5 * RTT_MS / 1000)
    assert kind == "tokens" and message.token_ids == [7]


async def test_messages_go_only_to_their_own_request(two_sites):
    router_nc, main_nc = two_sites
    mailbox = await started_mailbox(router_nc, main_nc)
    first, second = (subjects.new_request_id("router-0", n) for n in ("aaa", "bbb"))
    inboxes = {rid: mailbox.open(rid) for rid in (first, second)}
    mailbox.close(second)
    for rid, index in ((second, 5), (first, 0)):
        await main_nc.publish(
            subjects.tokens(rid, "main-decode-0"),
            encode(
                TokensEmitted(
                    request_id=rid, start_index=index, token_ids=[index], producer="MD", instance_id="main-decode-0"
                )
            ),
        )
    [(_, message)] = await asyncio.wait_for(inboxes[first].take(), 5 * RTT_MS / 1000)
    assert message.request_id == first
    assert inboxes[first].empty() and inboxes[second].empty()


async def test_a_message_that_does_not_decode_is_counted_and_never_queued(two_sites):
    from shared.dead_letters import BAD_MESSAGES

    router_nc, main_nc = two_sites
    mailbox = await started_mailbox(router_nc, main_nc)
    request_id = subjects.new_request_id("router-0", "ccc")
    inbox = mailbox.open(request_id)
    label = BAD_MESSAGES.labels("router", subjects.tokens_of_origin("router-0"))
    before = label._value.get()
    await main_nc.publish(subjects.tokens(request_id, "main-decode-0"), b"\xc1 not msgpack")
    await main_nc.publish(
        subjects.tokens(request_id, "main-decode-0"),
        encode(
            TokensEmitted(
                request_id=request_id, start_index=0, token_ids=[3], producer="MD", instance_id="main-decode-0"
            )
        ),
    )
    [(_, message)] = await asyncio.wait_for(inbox.take(), 5 * RTT_MS / 1000)
    assert message.token_ids == [3] and inbox.empty()
    assert label._value.get() == before + 1


async def test_a_step_message_is_split_to_the_open_requests_it_names_with_its_subjects_sender(two_sites):
    router_nc, main_nc = two_sites
    mailbox = await started_mailbox(router_nc, main_nc)
    first, second, closed = (subjects.new_request_id("router-0", n) for n in ("s1", "s2", "s3"))
    inboxes = {rid: mailbox.open(rid) for rid in (first, second, closed)}
    mailbox.close(closed)
    elsewhere = subjects.new_request_id("router-1", "s4")  # another router's request: not ours
    await main_nc.publish(
        subjects.step_tokens("router-0", "main-decode-0"),
        encode(
            StepTokens(
                producer="MD",
                request_ids=[first, closed, elsewhere, second],
                indices=[4, 0, 0, 9],
                token_ids=[40, 1, 2, 90],
            )
        ),
    )
    assert await asyncio.wait_for(inboxes[first].take(), 5 * RTT_MS / 1000) == [("step", 4, 40, "MD", "main-decode-0")]
    assert await asyncio.wait_for(inboxes[second].take(), 1) == [("step", 9, 90, "MD", "main-decode-0")]
    assert inboxes[closed].empty()


async def test_a_step_message_with_arrays_of_unequal_length_is_bad_and_never_queued(two_sites):
    from shared.dead_letters import BAD_MESSAGES

    router_nc, main_nc = two_sites
    mailbox = await started_mailbox(router_nc, main_nc)
    request_id = subjects.new_request_id("router-0", "s5")
    inbox = mailbox.open(request_id)
    label = BAD_MESSAGES.labels("router", subjects.step_tokens_of_origin("router-0"))
    before = label._value.get()
    subject = subjects.step_tokens("router-0", "main-decode-0")
    lopsided = {
        "type": "steptokens",
        "producer": "MD",
        "request_ids": [request_id],
        "indices": [0, 1],
        "token_ids": [5],
    }
    await main_nc.publish(subject, msgspec.msgpack.encode(lopsided))
    await main_nc.publish(
        subject, encode(StepTokens(producer="MD", request_ids=[request_id], indices=[0], token_ids=[6]))
    )
    assert await asyncio.wait_for(inbox.take(), 5 * RTT_MS / 1000) == [("step", 0, 6, "MD", "main-decode-0")]
    assert label._value.get() == before + 1


def test_step_subjects_name_their_router_and_sender():
    assert subjects.step_tokens("router-1", "main-decode-0") == "pdd.steps.router-1.main-decode-0"
    assert subjects.sender_of(subjects.step_tokens("router-1", "relay-decode-0")) == "relay-decode-0"
    assert subjects.step_tokens_of_origin("router-1") == "pdd.steps.router-1.*"
    assert subjects.step_tokens_by("main-decode-0") == "pdd.steps.*.main-decode-0"


def test_request_ids_name_their_router():
    request_id = subjects.new_request_id("router-1", "00ff")
    assert subjects.origin_of(request_id) == "router-1"
    assert subjects.tokens(request_id, "main-decode-0") == f"pdd.tokens.router-1.{request_id}.main-decode-0"
    assert subjects.sender_of(subjects.tokens(request_id, "main-decode-0")) == "main-decode-0"
    assert subjects.request_of(subjects.tokens(request_id, "main-decode-0")) == request_id


async def test_an_event_for_a_request_no_longer_collected_goes_to_the_late_handler_with_its_sender(two_sites):
    """The relay answered the request; the main decoder's KvReady comes afterwards. The router
    still hears it (its flow has left the link), naming the sender its subject proves."""
    router_nc, main_nc = two_sites
    late: list[tuple[object, str]] = []
    heard = asyncio.Event()
    request_id = subjects.new_request_id("router-0", "done1")

    def on_late(event, sender):  # the probe's KvReadys come late here too
        if event.request_id == request_id:
            late.append((event, sender))
            heard.set()

    await started_mailbox(router_nc, main_nc)  # the interest has crossed to site B
    mailbox = RequestMailbox(router_nc, "router-0", BadMessageSink(router_nc, SITE_A, "router", "router-0"), on_late)
    await mailbox.start()
    ready = kv_ready(request_id)
    while not heard.is_set():  # until this mailbox's interest has crossed too
        await main_nc.publish(subjects.request_events(request_id, "main-decode-0"), encode(ready))
        try:
            await asyncio.wait_for(heard.wait(), 0.2)
        except TimeoutError:
            pass
    event, sender = late[0]
    assert isinstance(event, KvReady) and event.request_id == request_id and sender == "main-decode-0"
