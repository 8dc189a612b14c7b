"""The locked-down NATS of a deployment, attacked from inside: no anonymous or plaintext
client, a leafnode that takes only our certificate, and every instance held to subjects of its
own. Each attack uses a *valid* credential of another instance or role (a stolen one) against
a request that runs meanwhile: what the server's permissions do not refuse, the receivers drop
and count, and the victim's greedy answer stays equal to transformers'."""

import asyncio
import json
import socket
import ssl
import subprocess
import time

import aiohttp
import nats
import pytest

from infra.credentials import ensure_credentials
from infra.nats_server import free_port, leafnode_count, nats_server_binary
from infra.wan_link import LinkProfile
from shared import nats_client, subjects
from shared.engine.sampling import SamplingParams
from shared.messages import (
    CancelRequest,
    HandoffTokens,
    InstanceRef,
    KvBlocksStored,
    KvReady,
    LoadReported,
    RequestFailed,
    StartPrefill,
    StepTokens,
    TokensEmitted,
    decoder,
    encode,
)
from shared.metrics import REFUSED_MESSAGES
from shared.tls import client_context
from tests.helpers import chat_prompt_ids, reference_greedy, until

SLOW_WAN = LinkProfile(bandwidth_bps=50e6, rtt_ms=40, jitter_ms=2, seed=1)
MAX_TOKENS = 160


@pytest.fixture
async def stack(make_stack):
    return await make_stack(profile=SLOW_WAN, num_main=2, router_settings={"pipeline_policy": "P-RLD-MD"})


async def start_victim(stack, content: str) -> tuple[asyncio.Task, str, str]:
    """A long greedy request; returns (its task, its request id, the main decoder it was placed on)."""
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
    }
    request = asyncio.create_task(post(stack, body))
    await until(lambda: stack.router.mailbox.open_request_ids, 15, "the request to be dispatched")
    rid = next(iter(stack.router.mailbox.open_request_ids))

    def holds_relayed(main) -> bool:
        held = main.requests.get(rid)
        return held is not None and bool(held.relay_id)

    await until(lambda: any(holds_relayed(m) for m in stack.mains), 15, "a main decoder to hold the request")
    return request, rid, next(m.instance_id for m in stack.mains if holds_relayed(m))


async def post(stack, body: dict):
    async with aiohttp.ClientSession() as session:
        async with session.post(stack.base_url + "/chat/completions", json=body) as response:
            return response.status, await response.json()


async def assert_exact(request: asyncio.Task, tiny, content: str):
    status, body = await request
    expected = tiny.tokenizer.decode(
        reference_greedy(tiny, chat_prompt_ids(tiny, [{"role": "user", "content": content}]), MAX_TOKENS),
        skip_special_tokens=True,
    )
    assert status == 200 and body["choices"][0]["message"]["content"] == expected, body


@pytest.mark.parametrize("site", ["site-a", "site-b"])
async def test_anonymous_and_plaintext_clients_are_refused(stack, site):
    url = stack.sites[site].url
    with pytest.raises((nats.errors.Error, OSError, asyncio.TimeoutError, ssl.SSLError)):
        await nats.connect(
            url.replace("tls://", "nats://"), allow_reconnect=False, connect_timeout=3, max_reconnect_attempts=0
        )  # plaintext
    with pytest.raises((nats.errors.Error, OSError, asyncio.TimeoutError)):
        await nats_client.connect(
            url,
            role="router",
            ca_file=str(stack.credentials.ca_file),
            allow_reconnect=False,
            connect_timeout=3,
            max_reconnect_attempts=0,
        )  # no nkey


async def test_a_client_signed_by_another_deployment_is_refused(stack, tmp_path):
    foreign = ensure_credentials(tmp_path / "other")
    with pytest.raises((nats.errors.Error, OSError, asyncio.TimeoutError, ssl.SSLError)):
        await nats_client.connect(
            stack.sites["site-a"].url,
            role="router",
            seed_file=str(foreign.seed_file("router")),
            ca_file=str(foreign.ca_file),
            allow_reconnect=False,
            connect_timeout=3,
            max_reconnect_attempts=0,
        )


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
    context = client_context(
        str(stack.credentials.ca_file), str(foreign.cert_file("nats-b")), str(foreign.key_file("nats-b"))
    )
    context.check_hostname = False
    with pytest.raises((ssl.SSLError, ConnectionResetError, BrokenPipeError, OSError)):
        with socket.create_connection(("127.0.0.1", leaf_port(stack)), timeout=5) as raw:
            with context.wrap_socket(raw) as tls:
                tls.sendall(b"PING\r\n")
                if not tls.recv(4096):
                    raise ConnectionResetError("closed after the handshake")


class Violations:
    """A client's error callback, collecting the permission violations the server reports."""

    def __init__(self):
        self.errors: list[str] = []
        self.seen = asyncio.Event()

    async def error_cb(self, exc):
        self.errors.append(str(exc))
        if "permissions violation" in str(exc).lower():
            self.seen.set()


async def connect_as(stack, instance_id: str, **options) -> nats.NATS:
    """A client holding instance ``instance_id``'s credential, at that instance's site."""
    site = "site-b" if instance_id.startswith("main-decode") else "site-a"
    role = {i: r for r, i in stack.identities}[instance_id]
    creds = stack.security(instance_id)
    return await nats_client.connect(
        stack.sites[site].url,
        role=role,
        instance_id=instance_id,
        seed_file=creds["nats_seed_file"],
        ca_file=creds["tls_ca_file"],
        **options,
    )


async def test_a_credential_is_admitted_only_at_its_own_sites_server(stack):
    """A compromised main decoder at site B holds a valid credential, but site A's server does
    not admit it: it cannot publish site A's subjects there (a heartbeat naming site A would
    make placement take it for a decoder beside the prefill). Nor is a site A instance admitted
    at site B's server. At home each is."""
    for instance_id, away in (("main-decode-0", "site-a"), ("router-0", "site-b"), ("prefill-0", "site-b")):
        creds = stack.security(instance_id)
        try:
            nc = await nats_client.connect(
                stack.sites[away].url,
                role={i: r for r, i in stack.identities}[instance_id],
                instance_id=instance_id,
                seed_file=creds["nats_seed_file"],
                ca_file=creds["tls_ca_file"],
                allow_reconnect=False,
                connect_timeout=5,
                max_reconnect_attempts=0,
            )
        except (TimeoutError, nats.errors.Error, OSError):
            home = await connect_as(stack, instance_id)
            assert home.is_connected
            await home.close()
            continue
        await nc.close()
        raise AssertionError(f"{instance_id}'s credential was admitted at {away}")


async def forge(stack, instance_id: str, subject: str, payload: bytes) -> list[str]:
    """Publish with ``instance_id``'s credential; return the server's complaints."""
    violations = Violations()
    nc = await connect_as(stack, instance_id, error_cb=violations.error_cb)
    try:
        await nc.publish(subject, payload)
        await nc.flush()
        await asyncio.wait_for(violations.seen.wait(), 5)
    finally:
        await nc.close()
    return violations.errors


def server_refused_forgeries(rid: str, victim: str, thief: str) -> list[tuple[str, str, object]]:
    """(credential, subject, message): each publishes as someone else, which its permissions forbid."""
    victim_ref = InstanceRef(instance_id=victim, site="site-b")
    return [
        (
            thief,
            subjects.tokens(rid, victim),
            TokensEmitted(  # tokens under the placed decoder's name
                request_id=rid, start_index=0, token_ids=[1] * 50, producer="MD", instance_id=victim
            ),
        ),
        (
            thief,
            subjects.tokens(rid, victim),
            TokensEmitted(  # a finish_reason for it
                request_id=rid, start_index=1, token_ids=[2], producer="MD", instance_id=victim, finish_reason="stop"
            ),
        ),
        (
            thief,
            subjects.step_tokens(subjects.origin_of(rid), victim),
            StepTokens(  # a step's tokens under the placed decoder's name
                producer="MD", request_ids=[rid], indices=[0], token_ids=[1]
            ),
        ),
        (
            "relay-decode-0",
            subjects.step_tokens(subjects.origin_of(rid), "main-decode-0"),
            StepTokens(producer="MD", request_ids=[rid], indices=[0], token_ids=[1]),  # a relay as a main decoder
        ),
        (
            thief,
            subjects.request_events(rid, victim),
            RequestFailed(request_id=rid, instance_id=victim, code="forged", message="forged"),
        ),
        (
            thief,
            subjects.load("site-a", "router", "router-0"),
            LoadReported(  # a router heartbeat
                instance=InstanceRef(instance_id="router-0", site="site-a"), service="router", unix_s=time.time()
            ),
        ),
        (
            thief,
            subjects.load("site-b", "main_decode", victim),
            LoadReported(  # the victim's heartbeat
                instance=victim_ref, service="main_decode", unix_s=time.time(), total_blocks=0
            ),
        ),
        (
            thief,
            subjects.kv_events("site-b", victim),
            KvBlocksStored(  # the victim's KV events
                publisher_id=victim, epoch="x", seq=1, block_hashes=[1, 2, 3]
            ),
        ),
        (thief, subjects.cancel("router-0"), CancelRequest(request_id=rid, kind="kill", reason="forged")),
        (
            thief,
            subjects.handoff("site-b", victim, "relay-decode-0"),
            HandoffTokens(request_id=rid, start_index=0, token_ids=[1] * 10, relay_instance_id="relay-decode-0"),
        ),
        (
            "prefill-0",
            subjects.shared_work("site-a", "prefill", subjects.START_PREFILL),
            StartPrefill(
                request_id=rid + "x",
                token_ids=[1, 2, 3],
                sampling=SamplingParams(max_tokens=2),
                seed=1,
                pipeline="P-MD",
                main_decode=victim_ref,
                deadline_unix_s=time.time() + 60,
            ),
        ),
        (
            "relay-decode-0",
            subjects.tokens(rid, "main-decode-0"),
            TokensEmitted(  # a relay as a main decoder
                request_id=rid, start_index=0, token_ids=[1], producer="MD", instance_id="main-decode-0"
            ),
        ),
        ("cache-index-0", subjects.request_events(rid, victim), CancelRequest(request_id=rid, kind="kill")),
    ]


async def test_a_stolen_instance_credential_cannot_speak_for_another_and_the_answer_stays_exact(stack, tiny):
    content = "Name the rivers of the north. " * 12
    request, rid, victim = await start_victim(stack, content)
    thief = next(m.instance_id for m in stack.mains if m.instance_id != victim)
    for credential, subject, message in server_refused_forgeries(rid, victim, thief):
        errors = await forge(stack, credential, subject, encode(message))
        assert any("permissions violation" in e.lower() for e in errors), (credential, subject, errors)
    await assert_exact(request, tiny, content)


async def test_lies_on_a_credential_own_subjects_are_dropped_and_counted(stack, tiny):
    """What a thief may publish (its own heartbeat, tokens, events) cannot claim another sender,
    and tokens from an instance the request was not placed on are refused."""
    mismatch = REFUSED_MESSAGES.labels("router", "sender_mismatch")
    unplaced = REFUSED_MESSAGES.labels("router", "tokens_from_unplaced_instance")
    other_ready = REFUSED_MESSAGES.labels("relay_decode", "kv_ready_from_another_main_decode")
    before = mismatch._value.get(), unplaced._value.get(), other_ready._value.get()
    content = "Describe the lighthouse keeper. " * 12
    request, rid, victim = await start_victim(stack, content)
    thief = next(m.instance_id for m in stack.mains if m.instance_id != victim)
    lies = [
        (
            subjects.tokens(rid, thief),
            TokensEmitted(request_id=rid, start_index=0, token_ids=[7] * 100, producer="MD", instance_id=victim),
        ),
        (
            subjects.request_events(rid, thief),
            RequestFailed(request_id=rid, instance_id=victim, code="forged", message="forged", retryable=True),
        ),
        (  # an event for a request of the thief's own naming, whose body names the victim's
            subjects.request_events(f"{subjects.origin_of(rid)}-forged", thief),
            RequestFailed(request_id=rid, instance_id=thief, code="forged", message="forged", retryable=True),
        ),
        (
            subjects.load("site-b", "main_decode", thief),
            LoadReported(  # claims to be the victim
                instance=InstanceRef(instance_id=victim, site="site-b", bulk_endpoint="127.0.0.1:1"),
                service="main_decode",
                unix_s=time.time(),
            ),
        ),
        (
            subjects.load("site-b", "main_decode", thief),
            LoadReported(  # claims to be a router
                instance=InstanceRef(instance_id=thief, site="site-b"), service="router", unix_s=time.time()
            ),
        ),
    ]
    nc = await connect_as(stack, thief)
    try:
        for subject, message in lies:
            await nc.publish(subject, encode(message))
        # Honest about itself, for a request it was not placed on: its tokens, and a KvReady
        # that would make the relay hand the request over to it.
        await nc.publish(
            subjects.tokens(rid, thief),
            encode(TokensEmitted(request_id=rid, start_index=0, token_ids=[7] * 100, producer="MD", instance_id=thief)),
        )
        for index in range(3):  # a step's tokens, entry by entry refused
            await nc.publish(
                subjects.step_tokens(subjects.origin_of(rid), thief),
                encode(StepTokens(producer="MD", request_ids=[rid, rid + "x"], indices=[index, 0], token_ids=[7, 7])),
            )
        await nc.publish(
            subjects.request_events(rid, thief),
            encode(
                KvReady(
                    request_id=rid,
                    instance_id=thief,
                    site="site-b",
                    cached_tokens=0,
                    imported_tokens=0,
                    wan_kv_bytes=0,
                    transfer_s=0.0,
                    throughput_bps=0.0,
                )
            ),
        )
        await nc.flush()
        await until(
            lambda: (
                mismatch._value.get() >= before[0] + 5
                and unplaced._value.get() >= before[1] + 4  # the TokensEmitted, and 3 step entries
                and other_ready._value.get() > before[2]
            ),
            10,
            "every lie to be refused",
        )
    finally:
        await nc.close()
    await assert_exact(request, tiny, content)
    assert stack.router.registry.live("main_decode")  # the victim's endpoint was not redirected
    victim_report = next(
        s.report for s in stack.router.registry.live("main_decode") if s.report.instance.instance_id == victim
    )
    assert victim_report.instance.bulk_endpoint != "127.0.0.1:1"


@pytest.mark.parametrize(
    "instance_id,subject",
    [
        ("main-decode-0", subjects.tokens_of_origin("router-0")),  # reading a router's streams
        ("main-decode-0", subjects.step_tokens_of_origin("router-0")),
        ("relay-decode-0", subjects.step_tokens_of_origin("router-0")),
        ("prefill-0", subjects.handoff("site-b", "main-decode-0", "*")),
        ("main-decode-1", subjects.handoff("site-b", "main-decode-0", "*")),  # another decoder's handoffs
        ("router-0", "_INBOX.prefill.>"),
        ("relay-decode-0", "_INBOX.relay_decode.relay-decode-1.>"),
    ],
)
async def test_an_instance_cannot_subscribe_to_what_is_not_its_own(stack, instance_id, subject):
    violations = Violations()
    nc = await connect_as(stack, instance_id, error_cb=violations.error_cb)
    try:
        await nc.subscribe(subject)
        await nc.flush()
        await asyncio.wait_for(violations.seen.wait(), 5)
    finally:
        await nc.close()


async def test_main_decode_takes_a_handoff_only_of_a_possible_length(stack, tiny):
    content = "Explain how tides work, in detail. " * 12
    request, rid, victim = await start_victim(stack, content)
    nc = await connect_as(stack, "relay-decode-0")
    try:
        reply = await nc.request(
            subjects.handoff("site-b", victim, "relay-decode-0"),
            encode(
                HandoffTokens(request_id=rid, start_index=0, token_ids=[5] * 1000, relay_instance_id="relay-decode-0")
            ),
            timeout=10,
        )
    finally:
        await nc.close()
    answer = decoder(RequestFailed).decode(reply.data)
    assert answer.code == "handoff_refused" and "fit max_tokens" in answer.message, answer
    await assert_exact(request, tiny, content)


@pytest.mark.parametrize(
    "instance_id,api",
    [
        ("main-decode-1", "$JS.API.STREAM.UPDATE.PDD_DEAD_LETTERS"),  # republish: publishing on any subject
        ("main-decode-0", "$JS.API.STREAM.UPDATE.PDD_KV_EVENTS"),
        ("prefill-0", "$JS.API.STREAM.CREATE.CAPTURE"),  # a stream over other traffic
        ("router-0", "$JS.API.STREAM.DELETE.PDD_DEAD_LETTERS"),
        ("relay-decode-0", "$JS.API.STREAM.PURGE.PDD_DEAD_LETTERS"),
        ("cache-index-0", "$JS.API.STREAM.UPDATE.PDD_KV_EVENTS"),
        ("cache-index-0", "$JS.API.CONSUMER.CREATE.PDD_DEAD_LETTERS"),  # consumers of its own stream only
    ],
)
async def test_no_service_identity_can_administer_jetstream(stack, instance_id, api):
    """Streams are made by the deployment step as ``admin``; a service's valid credential
    cannot change, create, purge or delete one."""
    config = {
        "name": api.rsplit(".", 1)[-1],
        "subjects": ["pdd.>"],
        "republish": {"src": ">", "dest": "pdd.cancel.router-0"},
    }
    errors = await forge(stack, instance_id, api, json.dumps(config).encode())
    assert any("permissions violation" in e.lower() for e in errors), (instance_id, api, errors)
    admin = await nats_client.connect(
        stack.sites["site-a"].url,
        role="admin",
        instance_id="admin",
        seed_file=str(stack.credentials.seed_file("admin")),
        ca_file=str(stack.credentials.ca_file),
    )
    try:  # the stream keeps the deployment step's configuration
        info = await admin.jetstream().stream_info("PDD_DEAD_LETTERS")
    finally:
        await admin.close()
    assert info.config.subjects == [subjects.dead_letters_of_site("site-a")] and not info.config.republish


class RogueLeaf:
    """A nats-server of our own that dials site A's leafnode port with a given nkey seed and
    the certificate of ``peer``; its clients connect without credentials."""

    def __init__(self, stack, seed: str, peer: str, workdir):
        creds = stack.credentials
        self.client_port, self.monitor_port = free_port(), free_port()
        self.log = workdir / "rogue.log"
        config = workdir / "rogue.conf"
        config.write_text(
            f'server_name: "rogue-{self.client_port}"\nlisten: 127.0.0.1:{self.client_port}\n'
            f"http: 127.0.0.1:{self.monitor_port}\n"
            f'leafnodes {{ remotes: [ {{ url: "tls://127.0.0.1:{leaf_port(stack)}", nkey: "{seed}", '
            f'tls {{ cert_file: "{creds.cert_file(peer)}", key_file: "{creds.key_file(peer)}", '
            f'ca_file: "{creds.ca_file}", handshake_first: true }} }} ] }}\n'
        )
        with open(self.log, "ab") as log:
            self.process = subprocess.Popen(
                [nats_server_binary(), "-c", str(config)], stdout=log, stderr=subprocess.STDOUT
            )

    def stop(self):
        self.process.kill()
        self.process.wait()


async def test_a_service_credential_cannot_join_as_a_leafnode(stack, tmp_path):
    """A main decoder's seed and the certificate its container holds: site A refuses it as a
    leafnode (service users may connect only as clients)."""
    rogue = RogueLeaf(stack, stack.credentials.seed_file("main-decode-0").read_text().strip(), "main-decode", tmp_path)
    try:
        await until(
            lambda: "authorization violation" in rogue.log.read_text().lower(), 15, "site A to refuse the leafnode"
        )
        assert leafnode_count(stack.sites["site-a"]) == 1  # site B's own, nothing more
    finally:
        rogue.stop()


async def test_a_compromised_site_b_server_carries_only_what_must_cross(stack, tiny, tmp_path):
    """The leafnode's own seed (what site B's server holds): the link works, but site A sends it
    no prompt, no token stream and no request event, and takes from it nothing that speaks
    for a site A instance; the victim's answer stays exact."""
    content = "Recount the voyage of the grain ship. " * 12
    request, rid, victim = await start_victim(stack, content)
    rogue = RogueLeaf(stack, stack.credentials.seed_file("leafnode").read_text().strip(), "nats-b", tmp_path)
    try:
        await until(lambda: leafnode_count(stack.sites["site-a"]) == 2, 15, "the rogue leafnode to join")
        nc = await nats.connect(f"nats://127.0.0.1:{rogue.client_port}", no_echo=True)  # only what A sends
        seen: dict[str, list[str]] = {"leak": [], "allowed": []}

        async def leak(msg):
            seen["leak"].append(msg.subject)

        async def allowed(msg):
            seen["allowed"].append(msg.subject)

        for subject in (
            "pdd.tokens.>",
            "pdd.req.>",
            "pdd.*.prefill.>",
            "pdd.*.relay_decode.>",
            "pdd.dlq.>",
            "$JS.API.>",
            "_INBOX.router.>",
        ):
            await nc.subscribe(subject, cb=leak)
        await nc.subscribe(subjects.LOAD_ALL, cb=allowed)
        await nc.flush()
        for subject, message in [  # site A instances' subjects: the hub drops them
            (
                subjects.tokens(rid, "relay-decode-0"),
                TokensEmitted(
                    request_id=rid, start_index=0, token_ids=[3] * 80, producer="RLD", instance_id="relay-decode-0"
                ),
            ),
            (
                subjects.request_events(rid, "relay-decode-0"),
                RequestFailed(request_id=rid, instance_id="relay-decode-0", code="forged", message="forged"),
            ),
            (
                subjects.shared_work("site-a", "prefill", subjects.START_PREFILL),
                StartPrefill(
                    request_id=rid + "x",
                    token_ids=[1, 2, 3],
                    sampling=SamplingParams(max_tokens=2),
                    seed=1,
                    pipeline="P-MD",
                    main_decode=InstanceRef(instance_id=victim, site="site-b"),
                    deadline_unix_s=time.time() + 60,
                ),
            ),
            (
                subjects.load("site-a", "router", "router-0"),
                LoadReported(
                    instance=InstanceRef(instance_id="router-0", site="site-a"), service="router", unix_s=time.time()
                ),
            ),
        ]:
            await nc.publish(subject, encode(message))
        await nc.flush()
        await until(
            lambda: any(".site-a." in s for s in seen["allowed"]), 10, "site A's heartbeats over the rogue link"
        )
        await assert_exact(request, tiny, content)
        await nc.close()
        assert seen["leak"] == []
    finally:
        rogue.stop()


@pytest.mark.parametrize("one_identity_per", ["instance", "role"])
async def test_a_main_decoders_heartbeats_tokens_and_events_cross_the_leafnode(tmp_path, one_identity_per):
    """Per instance (``pdd up``) or per role (compose and Kubernetes replicas sharing one
    credential, the leafnode's permissions naming any main decoder): what a main decoder
    must send site A crosses."""
    from infra.local_stack import SITE_A, SITE_B, start_site_pair
    from infra.wan_link import WanLink

    main_id, router_id = "main-decode-host-7", "router-0"
    identities = (("main_decode", main_id), ("router", router_id)) if one_identity_per == "instance" else ()
    creds = ensure_credentials(tmp_path / "secrets", instance_ids=(main_id, router_id))
    link, processes = WanLink(), []
    try:
        sites = await start_site_pair(link, tmp_path, processes, credentials=creds, identities=identities)

        def seed(role: str, instance_id: str) -> str:
            return str(creds.seed_file(instance_id if identities else role))

        router = await nats_client.connect(
            sites[SITE_A].url,
            role="router",
            instance_id=router_id,
            seed_file=seed("router", router_id),
            ca_file=str(creds.ca_file),
        )
        main = await nats_client.connect(
            sites[SITE_B].url,
            role="main_decode",
            instance_id=main_id,
            seed_file=seed("main_decode", main_id),
            ca_file=str(creds.ca_file),
        )
        request_id = subjects.new_request_id(router_id, "r1")
        sent = [
            subjects.load(SITE_B, "main_decode", main_id),
            subjects.tokens(request_id, main_id),
            subjects.request_events(request_id, main_id),
        ]
        received: set[str] = set()

        async def heard(msg):
            received.add(msg.subject)

        for subject in (subjects.LOAD_ALL, subjects.tokens(request_id, "*"), subjects.request_events(request_id, "*")):
            await router.subscribe(subject, cb=heard)
        await router.flush()

        async def send_all():
            for subject in sent:
                await main.publish(subject, b"{}")
            await main.flush()
            return received >= set(sent)

        deadline = time.monotonic() + 15
        while not await send_all() and time.monotonic() < deadline:
            await asyncio.sleep(0.2)  # the interest takes a moment to reach site B
        assert received >= set(sent), sorted(set(sent) - received)
        await router.close()
        await main.close()
    finally:
        await link.close()
        for process in processes:
            process.terminate()
            process.wait(timeout=5)


def test_a_request_id_is_checked_against_request_subjects_only_and_no_site_takes_a_subject_word():
    from shared.config import CommonConfig, build_config
    from shared.dead_letters import sender_problem
    from shared.errors import ConfigError

    failed = RequestFailed(request_id="router-0-a", instance_id="main-decode-0", code="x", message="x")
    assert sender_problem(failed, subjects.request_events("router-0-a", "main-decode-0")) is None
    assert "names request" in sender_problem(failed, subjects.request_events("router-0-b", "main-decode-0"))
    # A work subject is not a request subject, whatever its site is called.
    assert sender_problem(failed, "pdd.req.main_decode.main-decode-0.handoff.main-decode-0") is None
    # A heartbeat cannot move its instance to another site than its subject's (a main decoder
    # claiming site A would have its KV counted as never crossing the WAN).
    site_a = InstanceRef(instance_id="main-decode-0", site="site-a")
    beat = LoadReported(instance=site_a, service="main_decode", unix_s=time.time())
    assert "claims site" in sender_problem(beat, subjects.load("site-b", "main_decode", "main-decode-0"))
    assert sender_problem(beat, subjects.load("site-a", "main_decode", "main-decode-0")) is None
    with pytest.raises(ConfigError, match="site.*a word of the subjects"):
        build_config(CommonConfig, {"site": "req"}, {})
    assert build_config(CommonConfig, {"site": "site-b"}, {}).site == "site-b"
