"""Site B compromised: a script holding only what a main decoder's container holds (its own
nkey seed, the CA, its certificate, the FlowOpen verify key) attacks a live ``pdd up --detach
--md 2`` (separate processes, tiny model) while other users' greedy requests run. It learns the
live request ids from the router's heartbeat and the decoders' ids from theirs, as an
attacker would, and tries every forgery of the threat model. The servers refuse what the
credential may not publish (permissions violations), the receivers drop and count what it may
publish but cannot prove, and every victim's answer is still transformers' own.
"""

import asyncio
import json
import time
import urllib.request

import aiohttp
import msgspec
import nats

from infra.launcher import load_state
from shared import nats_client, subjects
from shared.bulk.sender import FlowRefused, open_flow
from shared.engine.sampling import SamplingParams
from shared.messages import (
    CancelRequest,
    FlowOpen,
    InstanceRef,
    KvBlocksStored,
    LoadReported,
    RequestFailed,
    StepTokens,
    TokensEmitted,
    decoder,
    encode,
)
from shared.tls import client_context
from tests.helpers import chat_prompt_ids, reference_greedy, until

THIEF = "main-decode-1"
SERVED_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"  # the tiny model, under the default id
MAX_TOKENS = 500
"""Long enough that the victims still run when the router's heartbeat lists them."""
PROMPTS = [
    "Tell the story of the lighthouse keeper. " * 10,
    "List the rivers of the north and their sources. " * 10,
    "Describe the old mill by the river. " * 10,
    "Explain how the harbour tides are read. " * 10,
]


async def ask(base_url: str, content: str) -> tuple[str, str | None]:
    """A greedy request; returns its answer and the main decoder it was placed on, or, when it
    failed, the error's message and None."""
    body = {
        "model": SERVED_MODEL,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
    }
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        async with session.post(base_url + "/v1/chat/completions", json=body) as response:
            answer = await response.json()
    if response.status != 200:
        return answer["error"]["message"], None
    return answer["choices"][0]["message"]["content"], answer["pdd"]["instances"]["main_decode"]


class Heartbeats:
    """What the thief's credential may read: every instance's heartbeat."""

    def __init__(self):
        self.reports: dict[str, LoadReported] = {}

    async def on(self, msg):
        report = decoder(LoadReported).decode(msg.data)
        self.reports[report.instance.instance_id] = report

    def live_request_ids(self) -> list[str]:
        return [rid for r in self.reports.values() if r.service == "router" for rid in r.live_request_ids]

    def decoders(self) -> list[InstanceRef]:
        return [r.instance for r in self.reports.values() if r.service in ("main_decode", "relay_decode")]


def refused_total(deployment) -> float:
    """Lies refused by every router (each counts those on the requests it minted)."""
    total = 0.0
    for name, url in deployment.metrics_urls.items():
        if name.startswith("router-"):
            text = urllib.request.urlopen(url, timeout=5).read().decode()
            total += sum(
                float(line.rsplit(" ", 1)[1])
                for line in text.splitlines()
                if line.startswith("pdd_refused_messages_total{")
            )
    return total


def forgeries(rid: str, victim: str) -> list[tuple[str, object, bool]]:
    """(subject, message, refused by the server): tokens, a finish, a failure, heartbeats,
    KV events and a cancel, under the victim decoder's name or as itself."""
    router = subjects.origin_of(rid)
    return [
        (
            subjects.tokens(rid, victim),
            TokensEmitted(request_id=rid, start_index=0, token_ids=[5] * 40, producer="MD", instance_id=victim),
            True,
        ),
        (
            subjects.tokens(rid, victim),
            TokensEmitted(
                request_id=rid, start_index=3, token_ids=[6], producer="MD", instance_id=victim, finish_reason="stop"
            ),
            True,
        ),
        (
            subjects.request_events(rid, victim),
            RequestFailed(request_id=rid, instance_id=victim, code="forged", message="forged", retryable=False),
            True,
        ),
        (
            subjects.load("site-a", "router", router),
            LoadReported(instance=InstanceRef(instance_id=router, site="site-a"), service="router", unix_s=time.time()),
            True,
        ),
        (
            subjects.load("site-b", "main_decode", victim),
            LoadReported(
                instance=InstanceRef(instance_id=victim, site="site-b", bulk_endpoint="127.0.0.1:1"),
                service="main_decode",
                unix_s=time.time(),
            ),
            True,
        ),
        (
            subjects.kv_events("site-b", victim),
            KvBlocksStored(publisher_id=victim, epoch="x", seq=1, block_hashes=[1, 2, 3]),
            True,
        ),
        (
            subjects.step_tokens(router, victim),
            StepTokens(producer="MD", request_ids=[rid] * 3, indices=[0, 1, 2], token_ids=[5, 5, 5]),
            True,
        ),
        (subjects.cancel(router), CancelRequest(request_id=rid, kind="kill", reason="forged"), True),
        # On its own subjects: its name in the subject, another's in the body, or not placed.
        (
            subjects.tokens(rid, THIEF),
            TokensEmitted(request_id=rid, start_index=0, token_ids=[5] * 40, producer="MD", instance_id=victim),
            False,
        ),
        (
            subjects.tokens(rid, THIEF),
            TokensEmitted(
                request_id=rid,
                start_index=0,
                token_ids=[5] * 40,
                producer="MD",
                instance_id=THIEF,
                finish_reason="stop",
            ),
            False,
        ),
        (
            subjects.step_tokens(router, THIEF),
            StepTokens(producer="MD", request_ids=[rid] * 3, indices=[0, 1, 2], token_ids=[5, 5, 5]),
            False,
        ),
        (
            subjects.request_events(rid, THIEF),
            RequestFailed(request_id=rid, instance_id=THIEF, code="forged", message="forged", retryable=False),
            False,
        ),
        (
            subjects.load("site-b", "main_decode", THIEF),
            LoadReported(
                instance=InstanceRef(instance_id=THIEF, site="site-b"),
                service="router",
                unix_s=time.time(),
                live_request_ids=[],
            ),
            False,
        ),
    ]


async def test_a_main_decoders_files_change_fail_and_stall_no_other_users_answer(tiny, tiny_deployment):
    run_dir, ports = tiny_deployment
    base_url = f"http://127.0.0.1:{ports['--http-port']}"
    deployment = load_state(run_dir)
    secrets = run_dir / "secrets"
    expected = [
        tiny.tokenizer.decode(
            reference_greedy(tiny, chat_prompt_ids(tiny, [{"role": "user", "content": content}]), MAX_TOKENS),
            skip_special_tokens=True,
        )
        for content in PROMPTS
    ]
    violations: list[str] = []

    async def on_error(exc):
        violations.append(str(exc).lower())

    thief = await nats_client.connect(
        deployment.nats_urls["site-b"],
        role="main_decode",
        instance_id=THIEF,
        seed_file=str(secrets / f"{THIEF}.nk"),
        ca_file=str(secrets / "ca.pem"),
        error_cb=on_error,
    )
    heartbeats = Heartbeats()
    await thief.subscribe(subjects.LOAD_ALL, cb=heartbeats.on)
    refused_before = refused_total(deployment)
    victims = [asyncio.create_task(ask(base_url, content)) for content in PROMPTS]
    try:
        await until(
            lambda: heartbeats.live_request_ids() and {d.instance_id for d in heartbeats.decoders()} - {THIEF},
            30,
            "a live request in the router's heartbeat, and the other decoders' heartbeats",
        )
        live, decoders = heartbeats.live_request_ids(), heartbeats.decoders()
        refused_by_server = 0
        for rid in live:
            for victim in {d.instance_id for d in decoders} - {THIEF}:
                for subject, message, server_refuses in forgeries(rid, victim):
                    await thief.publish(subject, encode(message))
                    refused_by_server += server_refuses
        await thief.publish(
            "$JS.API.STREAM.UPDATE.PDD_DEAD_LETTERS",
            json.dumps(
                {
                    "name": "PDD_DEAD_LETTERS",
                    "subjects": ["pdd.>"],
                    "republish": {"src": ">", "dest": subjects.cancel("router-0")},
                }
            ).encode(),
        )
        await thief.flush()
        await until(
            lambda: sum("permissions violation" in v for v in violations) >= refused_by_server + 1,
            15,
            "the server to refuse every forgery under another's name",
        )
        # What its own subjects allowed reached the router, which dropped and counted it.
        await until(
            lambda: refused_total(deployment) > refused_before,
            15,
            f"the router to count the lies ({refused_before}, {len(live)} live, {[d.instance_id for d in decoders]})",
        )
        # The bulk channel: the verify key it holds cannot open a flow into another decoder.
        target = next(d for d in decoders if d.instance_id != THIEF and d.bulk_endpoint)
        tls = client_context(
            str(secrets / "ca.pem"), str(secrets / "main-decode.pem"), str(secrets / "main-decode.key")
        )
        flow_open = FlowOpen(
            request_id=live[0] + "x",
            role="main_decode",
            token_ids=[1, 2, 3],
            sampling=SamplingParams(max_tokens=2),
            seed=0,
            sender_id="prefill-0",
            receiver_id=target.instance_id,
            receiver_incarnation=target.incarnation,
            unix_s=0.0,
            nonce="",
        )
        try:
            flow = await open_flow(
                target.bulk_endpoint,
                flow_open,
                (secrets / "bulk-verify.pub").read_text().strip(),
                path="local",
                timeout_s=10,
                tls=tls,
                tls_name="main-decode",
            )
            raise AssertionError(f"a flow opened with the verify key: {flow}")
        except (FlowRefused, ConnectionError, OSError, asyncio.IncompleteReadError, msgspec.DecodeError):
            pass
        answers = await asyncio.wait_for(asyncio.gather(*victims), 120)  # none stalls
    finally:
        for task in victims:
            task.cancel()
        await thief.close()
    # Requests placed on the thief are its to answer or fail (what a compromised decoder can
    # always do: the router names it); every other user's answer is transformers' own.
    failed = [message for message, placed in answers if placed is None]
    assert all(message.startswith(f"{THIEF}: ") for message in failed), failed
    others = [(answer, want) for (answer, placed), want in zip(answers, expected) if placed not in (THIEF, None)]
    assert others and all(answer == want for answer, want in others), (answers, expected)
    assert any(subjects.cancel("router-0") in v or "stream.update" in v for v in violations), violations


async def test_the_leafnode_seed_is_not_a_client_credential(tiny_deployment):
    """The leafnode user may join only as a leafnode: as a client it is refused."""
    run_dir, _ = tiny_deployment
    deployment, secrets = load_state(run_dir), run_dir / "secrets"
    for site in ("site-a", "site-b"):
        try:
            nc = await nats_client.connect(
                deployment.nats_urls[site],
                role="main_decode",
                instance_id="leafnode",
                seed_file=str(secrets / "leafnode.nk"),
                ca_file=str(secrets / "ca.pem"),
                allow_reconnect=False,
                connect_timeout=5,
                max_reconnect_attempts=0,
            )
        except (TimeoutError, nats.errors.Error, OSError):
            continue
        await nc.close()
        raise AssertionError(f"the leafnode seed connected as a client at {site}")
