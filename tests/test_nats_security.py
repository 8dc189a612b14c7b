"""The locked-down NATS of a deployment: no anonymous or plaintext client, each role held to
its own subjects, a leafnode that takes only our certificate. Each forged message an
outsider used to get into answers (injected tokens, a cancel, a handoff, a StartPrefill) is
refused by the server while a real request runs, and that request's text stays exact."""

import asyncio
import socket
import ssl
import time

import nats
import pytest

from infra.credentials import ensure_credentials
from shared import nats_client, subjects
from shared.tls import client_context
from shared.messages import CancelRequest, HandoffTokens, StartPrefill, TokensEmitted, encode
from shared.engine.sampling import SamplingParams
from tests.helpers import until
from tests.test_pipeline_e2e import SLOW_WAN, chat_body, chat_prompt, expected_text, post


@pytest.fixture
async def stack(make_stack):
    return await make_stack(profile=SLOW_WAN, router_settings={"pipeline_policy": "P-RLD-MD"})


@pytest.mark.parametrize("site", ["site-a", "site-b"])
async def test_anonymous_and_plaintext_clients_are_refused(stack, site):
    url = stack.sites[site].url
    with pytest.raises((nats.errors.Error, OSError, asyncio.TimeoutError, ssl.SSLError)):
        await nats.connect(url.replace("tls://", "nats://"), allow_reconnect=False, connect_timeout=3,
                           max_reconnect_attempts=0)  # plaintext
    with pytest.raises((nats.errors.Error, OSError, asyncio.TimeoutError)):
        await nats_client.connect(url, role="router", ca_file=str(stack.credentials.ca_file),
                                  allow_reconnect=False, connect_timeout=3, max_reconnect_attempts=0)  # no nkey


async def test_a_client_signed_by_another_deployment_is_refused(stack, tmp_path):
    foreign = ensure_credentials(tmp_path / "other")
    with pytest.raises((nats.errors.Error, OSError, asyncio.TimeoutError, ssl.SSLError)):
        await nats_client.connect(stack.sites["site-a"].url, role="router",
                                  seed_file=str(foreign.seed_file("router")), ca_file=str(foreign.ca_file),
                                  allow_reconnect=False, connect_timeout=3, max_reconnect_attempts=0)


def leaf_port(stack) -> int:
    return stack.sites["site-a"].leaf_listen_port


async def test_the_leafnode_port_takes_neither_plaintext_nor_a_foreign_certificate(stack, tmp_path):
    with socket.create_connection(("127.0.0.1", leaf_port(stack)), timeout=5) as sock:
        sock.sendall(b'CONNECT {"verbose":false}\r\nPING\r\n')
        sock.settimeout(5)
        try:
            answer = sock.recv(4096)
        except (ConnectionResetError, TimeoutError):
            answer = b""
    assert b"INFO" not in answer and b"PONG" not in answer  # no NATS protocol before TLS
    foreign = ensure_credentials(tmp_path / "other")
    context = client_context(str(stack.credentials.ca_file), str(foreign.cert_file), str(foreign.key_file))
    context.check_hostname = False
    with pytest.raises((ssl.SSLError, ConnectionResetError, BrokenPipeError, OSError)):
        with socket.create_connection(("127.0.0.1", leaf_port(stack)), timeout=5) as raw:
            with context.wrap_socket(raw) as tls:
                tls.sendall(b"PING\r\n")
                if not tls.recv(4096):
                    raise ConnectionResetError("closed after the handshake")


class Violations:
    """A client as ``role``, collecting the permission violations the server reports."""

    def __init__(self):
        self.errors: list[str] = []
        self.seen = asyncio.Event()

    async def error_cb(self, exc):
        self.errors.append(str(exc))
        if "permissions violation" in str(exc).lower():
            self.seen.set()


async def forge(stack, site: str, role: str, subject: str, payload: bytes) -> list[str]:
    """Publish as ``role``; return the server's complaints."""
    violations = Violations()
    creds = stack.security(role)
    nc = await nats_client.connect(stack.sites[site].url, role=role, seed_file=creds["nats_seed_file"],
                                   ca_file=creds["tls_ca_file"], error_cb=violations.error_cb)
    try:
        await nc.publish(subject, payload)
        await nc.flush()
        await asyncio.wait_for(violations.seen.wait(), 5)
    finally:
        await nc.close()
    return violations.errors


async def test_forged_messages_from_the_wrong_role_are_refused_and_the_answer_stays_exact(stack, tiny):
    content = "Name the rivers of the north. " * 12
    request = asyncio.create_task(post(stack, "/chat/completions", chat_body(content, 160)))
    await until(lambda: stack.router.mailbox.open_request_ids, 15, "the request to be dispatched")
    rid = next(iter(stack.router.mailbox.open_request_ids))
    main = stack.mains[0]
    forgeries = [
        # (who, where, subject, message): each role lacks the right to that subject.
        ("prefill", "site-a", subjects.tokens(rid), TokensEmitted(
            request_id=rid, start_index=0, token_ids=[1] * 50, producer="MD", instance_id="main-decode-0")),
        ("main_decode", "site-b", subjects.CANCEL, CancelRequest(request_id=rid, kind="stop", reason="forged")),
        ("router", "site-a", subjects.instance_work("site-b", "main_decode", main.instance_id, subjects.HANDOFF),
         HandoffTokens(request_id=rid, start_index=0, token_ids=[1] * 1000)),
        ("relay_decode", "site-a", subjects.shared_work("site-a", "prefill", subjects.START_PREFILL),
         StartPrefill(request_id=rid + "x", token_ids=[1, 2, 3], sampling=SamplingParams(max_tokens=2),
                      seed=1, pipeline="P-MD", main_decode=main.instance_ref(), deadline_unix_s=time.time() + 60)),
        ("cache_index", "site-a", subjects.request_events(rid), CancelRequest(request_id=rid, kind="kill")),
    ]
    for role, site, subject, message in forgeries:
        errors = await forge(stack, site, role, subject, encode(message))
        assert any("permissions violation" in e.lower() for e in errors), (role, subject, errors)
    status, body = await request
    assert status == 200, body
    assert body["choices"][0]["message"]["content"] == expected_text(tiny, chat_prompt(tiny, content), 160)


@pytest.mark.parametrize("role,subject", [
    ("main_decode", subjects.tokens_of_origin("router-0")),  # reading another role's replies
    ("prefill", subjects.instance_work("site-b", "main_decode", "main-decode-0", subjects.HANDOFF)),
    ("router", "_INBOX.prefill.>"),
])
async def test_a_role_cannot_subscribe_to_what_is_not_its_own(stack, role, subject):
    violations = Violations()
    creds = stack.security(role)
    site = "site-b" if role == "main_decode" else "site-a"
    nc = await nats_client.connect(stack.sites[site].url, role=role, seed_file=creds["nats_seed_file"],
                                   ca_file=creds["tls_ca_file"], error_cb=violations.error_cb)
    try:
        await nc.subscribe(subject)
        await nc.flush()
        await asyncio.wait_for(violations.seen.wait(), 5)
    finally:
        await nc.close()


async def test_a_decoder_role_still_cannot_write_a_stream_it_was_not_placed_on(stack, tiny):
    from shared.metrics import REFUSED_MESSAGES

    refused = REFUSED_MESSAGES.labels("router", "tokens_from_unplaced_instance")
    before = refused._value.get()
    content = "Describe the lighthouse keeper. " * 12
    request = asyncio.create_task(post(stack, "/chat/completions", chat_body(content, 160)))
    await until(lambda: stack.router.mailbox.open_request_ids, 15, "the request to be dispatched")
    rid = next(iter(stack.router.mailbox.open_request_ids))
    nc = await stack.connect("site-b", "main_decode")  # allowed to publish tokens, as some decoder
    try:
        await nc.publish(subjects.tokens(rid), encode(TokensEmitted(
            request_id=rid, start_index=0, token_ids=[7] * 100, producer="MD", instance_id="main-decode-7")))
        await nc.flush()
        await until(lambda: refused._value.get() > before, 10, "the router to refuse the tokens")
    finally:
        await nc.close()
    status, body = await request
    assert status == 200 and body["choices"][0]["message"]["content"] == expected_text(
        tiny, chat_prompt(tiny, content), 160)


@pytest.mark.parametrize("relay_id,num_tokens,why", [
    ("relay-decode-9", 3, "the request's relay is"),   # another relay (or someone holding relay credentials)
    ("relay-decode-0", 1000, "fit max_tokens"),        # the right relay's name, an impossible length
])
async def test_main_decode_takes_a_handoff_only_from_the_requests_relay_and_of_a_possible_length(
        stack, tiny, relay_id, num_tokens, why):
    from shared.messages import RequestFailed, decoder

    content = "Explain how tides work, in detail. " * 12
    request = asyncio.create_task(post(stack, "/chat/completions", chat_body(content, 160)))
    await until(lambda: stack.router.mailbox.open_request_ids, 15, "the request to be dispatched")
    rid = next(iter(stack.router.mailbox.open_request_ids))
    main = stack.mains[0]
    await until(lambda: rid in main._relays, 15, "main decode to hold the request's KV")
    nc = await stack.connect("site-a", "relay_decode")
    try:
        reply = await nc.request(subjects.instance_work("site-b", "main_decode", main.instance_id, subjects.HANDOFF),
                                 encode(HandoffTokens(request_id=rid, start_index=0, token_ids=[5] * num_tokens,
                                                      relay_instance_id=relay_id)), timeout=10)
    finally:
        await nc.close()
    answer = decoder(RequestFailed).decode(reply.data)
    assert answer.code == "handoff_refused" and why in answer.message, answer
    status, body = await request
    assert status == 200 and body["choices"][0]["message"]["content"] == expected_text(
        tiny, chat_prompt(tiny, content), 160)
