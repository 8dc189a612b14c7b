"""``pdd chaos``: inject faults into a running deployment and check that nothing is lost.

Each scenario computes the reference text of a bounded set of greedy streams with
transformers (``generate(do_sample=False)``), runs the streams against the router, injects
its fault into the real processes while they run (or before, for a partition), and reports
one row: requests, identical to the reference, recovered, failed with a clear error, lost or
duplicated tokens, the longest stall a client saw, and the KV blocks every engine still
holds 10 s after the streams ended (read sooner once every engine holds none). Killed
processes are brought back by ``pdd up``'s supervisor; each scenario starts once the router
sees every instance again.

``router-kill`` kills the busiest router; with several (``pdd up --routers 2``) it then sends
new requests to the same address at once: the row adds the clients affected (streams not
answered exactly), how soon a new request's first token came after the kill and how many of a
second round of new requests were served.
"""

import asyncio
import json
import os
import signal
import time
import urllib.request
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import NamedTuple

import aiohttp
import torch

from infra import launcher, wan_control
from infra.http_probe import get_json
from loadtest.client import RequestRecord, stream_chat

SETTLE_S = 10.0
"""How long after the streams end the engines must have freed their blocks (a leak is what is held then)."""
HEARTBEAT_S = 1.0
"""The services' heartbeat (``--heartbeat-s`` default): how often an engine's gauges are refreshed."""
SCENARIOS = (
    "md-kill",
    "relay-kill",
    "prefill-kill",
    "router-kill",
    "nats-a-restart",
    "nats-b-outage",
    "partition",
    "stalls",
    "slow-wan",
    "redeploy",
)
WARM = {"md-kill", "nats-a-restart", "nats-b-outage", "partition", "stalls", "redeploy"}
"""Scenarios whose prompts are cached on main decode first, so the streams run P-MD there
(the common agentic case); the others stream cold prompts, relayed while their KV crosses."""
AT_DISPATCH_S = {"prefill-kill": 0.5}
"""Scenarios whose fault strikes this long after the streams are sent (mid-prefill), not
once every stream has its first token."""


@dataclass
class ChaosRow:
    """One scenario's outcome (the columns of the table in docs/reliability.md)."""

    scenario: str
    requests: int
    identical: int
    recovered: int
    failed_clear: int
    lost_or_duplicated_tokens: int
    longest_stall_s: float
    blocks_held_after_10s: int
    cache_fill_blocks_after_10s: int = 0
    pipelines: dict[str, int] = field(default_factory=dict)
    pipeline_after: str = ""
    notes: str = ""
    seconds: float = 0.0
    """Wall time of the scenario, from its start to its last check."""
    clients_affected: int = 0
    """Streams not answered exactly (failed, or text other than the reference)."""
    first_served_after_fault_s: float = -1.0
    """Seconds from the fault until a new request's first token (-1: not measured)."""
    served_after_fault: int = 0
    """New requests, sent once one had been served after the fault, that were served."""


@dataclass
class ChaosContext:
    """What a scenario needs: the deployment, the model, the knobs."""

    run_dir: Path
    model_name: str
    loaded: object
    streams: int
    max_tokens: int
    prompt_words: int
    outage_s: float
    partition_s: float = 60.0
    saved_bandwidth_bps: float = 0.0
    fault_started_s: float = 0.0
    after_fault: "AfterFault | None" = None

    @property
    def deployment(self) -> launcher.Deployment:
        return launcher.load_state(self.run_dir)


def references(loaded, prompts: list[list[int]], max_tokens: int) -> list[str]:
    """Greedy text per prompt from transformers itself (left-padded batch, fp32: exact)."""
    tokenizer, width = loaded.tokenizer, max(len(p) for p in prompts)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=loaded.device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=loaded.device)
    with torch.inference_mode():
        out = loaded.model.generate(
            ids, attention_mask=mask, max_new_tokens=max_tokens, do_sample=False, pad_token_id=pad
        )
    eos = set(loaded.eos_token_ids)
    texts = []
    for row in out[:, width:].tolist():
        end = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
        texts.append(tokenizer.decode(row[:end], skip_special_tokens=True))
    return texts


def conversations(ctx: ChaosContext, scenario: str) -> list[list[dict]]:
    """Cold prompts of their own per scenario and stream (no cached block is shared)."""
    words = " ".join(f"item{i}" for i in range(ctx.prompt_words))
    return [
        [
            {"role": "system", "content": f"Chaos run {scenario}, stream {i}."},
            {"role": "user", "content": f"Summarise this log: {words}"},
        ]
        for i in range(ctx.streams)
    ]


def prompt_ids(loaded, messages: list[dict]) -> list[int]:
    return list(
        loaded.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    )


async def run_scenario(ctx: ChaosContext, scenario: str) -> ChaosRow:
    """Run one scenario end to end and return its row."""
    inject, before_streams = FAULTS[scenario]
    await wait_healthy(ctx)
    chats = conversations(ctx, scenario)
    expected = references(ctx.loaded, [prompt_ids(ctx.loaded, c) for c in chats], ctx.max_tokens)
    records = [RequestRecord(session=i, turn=0, kind=scenario) for i in range(len(chats))]
    started = [asyncio.Event() for _ in chats]
    url = ctx.deployment.router_url
    async with aiohttp.ClientSession() as session:
        if scenario in WARM:
            await asyncio.gather(*(_warm(session, url, ctx, chat) for chat in chats))
        notes = await before_streams(ctx) if before_streams else ""
        streams = [
            asyncio.create_task(_stream(session, url, ctx, chat, record, event))
            for chat, record, event in zip(chats, records, started)
        ]
        if scenario in AT_DISPATCH_S:
            await asyncio.sleep(AT_DISPATCH_S[scenario])  # the fault's timing
            notes = await inject(ctx) or notes
        elif inject is not None:
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 300)
            notes = await inject(ctx) or notes
        await asyncio.gather(*streams)
        after = AFTER.get(scenario)
        if after is not None:
            notes = await after(ctx) or notes
        # Once the fault is over a warm prompt must take its usual path again (P-MD).
        probe = RequestRecord(0, 0, "after") if scenario in WARM else None
        if probe is not None:
            await _cache_fills_landed(ctx)
            await stream_chat(session, url, ctx.model_name, chats[0], 16, probe)
    ended_s = time.monotonic()
    held, filling = await _settled_blocks(ctx)
    if filling:  # imports kept for the cache may still be crossing: say when they are done
        notes = "; ".join(filter(None, [notes, await _fills_landed_note(ctx, filling, ended_s)]))
    row = _row(scenario, records, expected, held, notes)
    row.cache_fill_blocks_after_10s = filling
    row.clients_affected = row.requests - row.identical
    if ctx.after_fault is not None:
        row.first_served_after_fault_s, row.served_after_fault = ctx.after_fault
        ctx.after_fault = None
    row.pipeline_after = probe.pdd.get("pipeline", probe.error or "none") if probe else ""
    return row


async def _fills_landed_note(ctx: ChaosContext, filling: int, ended_s: float) -> str:
    """Wait (at most two minutes more) until the cache fills still crossing SETTLE_S after the
    streams ended (``ended_s``, monotonic) have landed; say when they did."""
    await _gauges_until(ctx, lambda held: not held.cache_fill, ended_s + SETTLE_S + 120, poll_s=1.0)
    return f"{filling} blocks of cache fills crossing at 10 s, landed {time.monotonic() - ended_s:.0f} s later"


async def _settled_blocks(ctx: ChaosContext) -> tuple[int, int]:
    """KV blocks (for requests, for cache fills) the engines still hold SETTLE_S after the streams
    ended, or sooner: once every engine answers and holds none of either, nothing is left running
    that could take blocks again, so the rest of the wait could only confirm the zero.

    The gauges are refreshed with each heartbeat, so the first reading is taken two heartbeats
    after the streams ended (an earlier one may predate the frees, or the fills)."""
    deadline_s = time.monotonic() + SETTLE_S
    await asyncio.sleep(2 * HEARTBEAT_S)
    held = await _gauges_until(ctx, lambda held: held == HeldBlocks(0, 0, 0), deadline_s)
    return held.for_requests, held.cache_fill


async def _cache_fills_landed(ctx: ChaosContext, timeout_s: float = 60.0):
    """Wait until no import kept for the cache is crossing: a stream the relay finished reaches
    main decode only as such a fill, and "once its KV has landed" is when the probe means something.

    The gauge is refreshed with each heartbeat, so the wait starts two heartbeats after the
    streams ended (an earlier reading may predate the fill)."""
    await asyncio.sleep(2 * HEARTBEAT_S)
    await _gauges_until(ctx, lambda held: not held.cache_fill, time.monotonic() + timeout_s)


async def _gauges_until(
    ctx: ChaosContext, done: Callable[["HeldBlocks"], bool], deadline_s: float, poll_s: float = 0.5
) -> "HeldBlocks":
    """Read the engines' KV gauges until ``done`` says so or ``deadline_s`` (monotonic) has
    passed; return the last reading."""
    while True:
        held = held_blocks(ctx)
        if done(held) or time.monotonic() >= deadline_s:
            return held
        await asyncio.sleep(poll_s)


async def _warm(session, url: str, ctx: ChaosContext, chat: list[dict], timeout_s: float = 120.0):
    """Send the prompt until main decode has it cached (the next request goes P-MD)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        # 16 tokens: above the odd-traffic bound, whose WAN transfer would be cancelled.
        record = await stream_chat(session, url, ctx.model_name, chat, 16, RequestRecord(0, 0, "warm"))
        if record.pdd.get("pipeline") == "P-MD":
            return
        await asyncio.sleep(2.0)  # each try ships KV again: let the last one land first
    raise launcher.LauncherError("a prompt did not get cached on main decode")


async def _stream(session, url, ctx, chat, record: RequestRecord, started: asyncio.Event):
    task = asyncio.create_task(stream_chat(session, url, ctx.model_name, chat, ctx.max_tokens, record))
    while not task.done() and record.ttft_ms is None:
        await asyncio.sleep(0.05)
    started.set()
    await task


def _row(scenario: str, records: list[RequestRecord], expected: list[str], held: int, notes: str) -> ChaosRow:
    identical = sum(r.error is None and r.text == e for r, e in zip(records, expected))
    failed = [r for r in records if r.error is not None]
    wrong = [(r, e) for r, e in zip(records, expected) if r.error is None and r.text != e]
    lost = sum(max(1, abs(len(r.text) - len(e))) for r, e in wrong)  # in characters: a lower bound
    pipelines: dict[str, int] = {}
    for r in records:
        pipelines[r.pdd.get("pipeline", "none")] = pipelines.get(r.pdd.get("pipeline", "none"), 0) + 1
    stalls = [max(r.itl_ms, default=0.0) for r in records] + [r.ttft_ms or 0.0 for r in records]
    return ChaosRow(
        scenario=scenario,
        requests=len(records),
        identical=identical,
        recovered=sum(bool(r.pdd.get("recoveries")) for r in records),
        failed_clear=sum(bool(r.error) for r in failed),
        lost_or_duplicated_tokens=lost,
        longest_stall_s=round(max(stalls) / 1000, 2),
        blocks_held_after_10s=held,
        pipelines=dict(sorted(pipelines.items())),
        notes=notes,
    )


async def wait_healthy(ctx: ChaosContext, timeout_s: float = 180.0):
    """Until every process runs and the router sees every engine instance it saw at start."""
    want = {
        kind: sum(1 for n in ctx.deployment.processes if n.startswith(prefix))
        for kind, prefix in (
            ("prefill", "prefill-"),
            ("relay_decode", "relay-decode-"),
            ("main_decode", "main-decode-"),
        )
    }
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        health = await asyncio.to_thread(_health, ctx)
        if (
            health
            and all(len(health["instances"].get(k, [])) >= n for k, n in want.items())
            and all(s == "healthy" for s in health.get("sites", {}).values())
        ):
            return
        await asyncio.sleep(0.5)
    raise launcher.LauncherError(f"deployment not healthy after {timeout_s:.0f} s")


def _health(ctx: ChaosContext) -> dict | None:
    return get_json(ctx.deployment.router_url.removesuffix("/v1") + "/health")


def _metric_sum(url: str, name: str) -> dict[str, float]:
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    return {
        line.split("{", 1)[1].split("}", 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name + "{")
    }


class HeldBlocks(NamedTuple):
    """KV blocks every engine process holds now.

    Attributes:
        for_requests: Blocks that requests hold.
        cache_fill: Blocks of cache fills still crossing. A cache fill is the import of a
            request that ended elsewhere: no request holds its blocks, they land in the
            prefix cache when the transfer ends.
        unanswered: Engine processes whose metrics did not answer (being restarted: a new
            process holds nothing yet).
    """

    for_requests: int
    cache_fill: int
    unanswered: int


def held_blocks(ctx: ChaosContext) -> HeldBlocks:
    """Read every engine process's KV gauges now."""
    used = filling = unanswered = 0
    for name, url in ctx.deployment.metrics_urls.items():
        if name.startswith(("prefill", "relay-decode", "main-decode")):
            try:
                used += int(sum(_metric_sum(url, "pdd_kv_blocks_used").values()))
                filling += int(sum(_metric_sum(url, "pdd_kv_blocks_cache_fill").values()))
            except OSError:
                unanswered += 1
    return HeldBlocks(used - filling, filling, unanswered)


def _kill(ctx: ChaosContext, name: str) -> str:
    os.kill(ctx.deployment.processes[name], signal.SIGKILL)
    return f"SIGKILL {name}"


def _busiest(ctx: ChaosContext, prefix: str) -> str:
    urls = ctx.deployment.metrics_urls
    active = {n: sum(_metric_sum(u, "pdd_active_sequences").values()) for n, u in urls.items() if n.startswith(prefix)}
    return max(active, key=active.get)


def _wan(ctx: ChaosContext, **changes) -> dict:
    return wan_control.call(ctx.deployment.wan_control_url, changes, ctx.deployment.control_key())


async def _md_kill(ctx):
    return _kill(ctx, await asyncio.to_thread(_busiest, ctx, "main-decode-"))


async def _relay_kill(ctx):
    return _kill(ctx, await asyncio.to_thread(_busiest, ctx, "relay-decode-"))


async def _prefill_kill(ctx):
    return _kill(ctx, "prefill-0")


class AfterFault(NamedTuple):
    """New requests after a fault: how soon the first one's first token came, how many of a
    round were served."""

    first_served_s: float
    served: int


async def _router_kill(ctx):
    routers = [n for n in ctx.deployment.processes if n.startswith("router-")]
    victim = await asyncio.to_thread(_busiest_router, ctx, routers)
    note = _kill(ctx, victim)
    killed_s = time.monotonic()
    if len(routers) == 1:  # nothing serves until the supervisor brings it back
        return f"{note}, the only router"
    ctx.after_fault = await _new_requests_after(ctx, killed_s, round_size=2 * ctx.streams)
    first_s, served = ctx.after_fault
    return f"{note} of {len(routers)}; new requests served {first_s:.2f} s later, then {served}/{2 * ctx.streams}"


def _busiest_router(ctx: ChaosContext, routers: list[str]) -> str:
    urls = ctx.deployment.metrics_urls
    running = {n: sum(_metric_sum(urls[n], "pdd_requests_running").values()) for n in routers}
    return max(sorted(running), key=running.get)


async def _new_requests_after(
    ctx: ChaosContext, fault_s: float, round_size: int, timeout_s: float = 120.0
) -> AfterFault:
    """Send short requests to the deployment's address (fresh connections) until one is served;
    then ``round_size`` at once, counting those served. Served "after" means its first token
    arrived that long after the fault (its whole answer takes what the pipeline takes)."""
    chat = [{"role": "user", "content": "Still there after the fault?"}]
    first_s = -1.0
    async with aiohttp.ClientSession() as session:
        while time.monotonic() - fault_s < timeout_s:
            sent_s = time.monotonic()
            record = await stream_chat(
                session, ctx.deployment.router_url, ctx.model_name, chat, 4, RequestRecord(0, 0, "after"), timeout_s=30
            )
            if record.error is None and record.ttft_ms is not None:
                first_s = sent_s - fault_s + record.ttft_ms / 1000
                break
            await asyncio.sleep(0.05)
        records = [RequestRecord(i, 0, "after") for i in range(round_size)]
        await asyncio.gather(
            *(
                stream_chat(session, ctx.deployment.router_url, ctx.model_name, chat, 4, r, timeout_s=60)
                for r in records
            )
        )
    return AfterFault(round(first_s, 2), sum(r.error is None for r in records))


async def _nats_a_restart(ctx):
    await asyncio.to_thread(launcher.restart, ctx.run_dir, "nats-a")
    return "pdd restart nats-a"


async def _nats_b_outage(ctx):
    with launcher.locked_state(ctx.run_dir) as deployment:
        deployment.paused.append("nats-b")  # keep the supervisor from bringing it back early
        os.kill(deployment.processes["nats-b"], signal.SIGTERM)
    await asyncio.sleep(ctx.outage_s)  # the fault's length
    with launcher.locked_state(ctx.run_dir) as deployment:
        deployment.paused.remove("nats-b")
    await asyncio.to_thread(launcher.restart, ctx.run_dir, "nats-b")
    return f"nats-b down {ctx.outage_s:.0f} s, then pdd restart nats-b"


async def _partition_on(ctx):
    await asyncio.to_thread(_wan, ctx, partitioned=True)
    ctx.fault_started_s = time.monotonic()
    return f"requests sent during a {ctx.partition_s:.0f} s partition"


async def _partition_off(ctx):
    await asyncio.sleep(max(0.0, ctx.fault_started_s + ctx.partition_s - time.monotonic()))  # its length
    await asyncio.to_thread(_wan, ctx, partitioned=False)
    await wait_healthy(ctx)


async def _redeploy(ctx):
    """``pdd down``, then ``pdd up`` on the same run folder (its JetStream store kept)."""
    spec = ctx.deployment.spec
    if spec is None:
        raise launcher.LauncherError("the deployment does not record what it was started with")
    await asyncio.to_thread(launcher.down, ctx.run_dir)
    await asyncio.to_thread(launcher.up, spec)
    await wait_healthy(ctx)
    return "warm prompts sent again after pdd down, pdd up on the same run folder"


async def _stalls_on(ctx):
    await asyncio.to_thread(_wan, ctx, stall_probability=0.01, stall_ms=6000)
    return "6 s stalls at 1 % of link chunks"


async def _stalls_off(ctx):
    await asyncio.to_thread(_wan, ctx, stall_probability=0.0, stall_ms=0)


async def _slow_wan(ctx):
    ctx.saved_bandwidth_bps = (await asyncio.to_thread(_wan, ctx))["profile"]["bandwidth_bps"]
    await asyncio.to_thread(_wan, ctx, bandwidth_bps=2e6)
    return "link at 2 Mbit/s before the streams start"


async def _restore_wan(ctx):
    await asyncio.to_thread(_wan, ctx, bandwidth_bps=ctx.saved_bandwidth_bps)


Fault = Callable[[ChaosContext], Awaitable[str | None]]
FAULTS: dict[str, tuple[Fault | None, Fault | None]] = {
    "md-kill": (_md_kill, None),
    "relay-kill": (_relay_kill, None),
    "prefill-kill": (_prefill_kill, None),
    "router-kill": (_router_kill, None),
    "nats-a-restart": (_nats_a_restart, None),
    "nats-b-outage": (_nats_b_outage, None),
    "partition": (None, _partition_on),
    "stalls": (None, _stalls_on),
    "slow-wan": (None, _slow_wan),
    "redeploy": (None, _redeploy),
}
"""Scenario → (fault injected once every stream has its first token, fault set up before)."""
AFTER: dict[str, Fault] = {"partition": _partition_off, "stalls": _stalls_off, "slow-wan": _restore_wan}


async def run(ctx: ChaosContext, names: list[str]) -> list[ChaosRow]:
    """Run scenarios in order; print each row as it is done."""
    rows = []
    for name in names:
        started = time.monotonic()
        try:
            row = await run_scenario(ctx, name)
        except (TimeoutError, launcher.LauncherError, OSError) as exc:
            row = ChaosRow(name, ctx.streams, 0, 0, 0, 0, 0.0, -1, notes=f"scenario did not run: {exc}")
        row.seconds = round(time.monotonic() - started, 1)
        print(json.dumps(asdict(row)), flush=True)
        rows.append(row)
    return rows


def table(rows: list[ChaosRow]) -> str:
    """The rows as a Markdown table."""
    head = (
        "| scenario | requests | identical | recovered | failed (clear error) | lost/dup tokens "
        "| longest stall (s) | blocks held 10 s later | pipelines (then after the fault) | fault |\n"
        "|---|---|---|---|---|---|---|---|---|---|"
    )
    return head + "".join(
        f"\n| {r.scenario} | {r.requests} | {r.identical} | {r.recovered} | {r.failed_clear} | "
        f"{r.lost_or_duplicated_tokens} | {r.longest_stall_s} | {r.blocks_held_after_10s} | "
        f"{', '.join(f'{p} {n}' for p, n in r.pipelines.items())}"
        f"{f' (then {r.pipeline_after})' if r.pipeline_after else ''} | {r.notes} |"
        for r in rows
    )
