"""``pdd bench control-plane``: the token path under load, with only the model fake.

A real deployment (``pdd up``: router, prefill, relay, main decoders, cache-index, both NATS
sites, the leafnode and the bulk channel through the WAN link) runs the stand-in engine
(``--engine standin``), which steps at a fixed period: ``streams`` concurrent streaming
clients then ask for tokens at ``rate`` per second in all (each stream gets one token per
step, so a step lasts ``streams / rate`` seconds). Each client runs ``rounds`` requests of
``max_tokens`` tokens back to back (``ignore_eos``).

Reported per router count: delivered tokens per second, CPU microseconds per delivered token
of every process (from ``/proc``, over the whole load, so each request's admission and
prefill are charged to its tokens), and the p50/p99 gap between consecutive content events
a client sees (``p99_added_ms``: the p99 gap beyond the engine's step time, what the control
plane adds). Each event is timed when its bytes reach the bench's process
(``loadtest.sse_stream``), not when the client's code gets round to it.

Each router count runs on its own fresh deployment (``pdd up --routers N``: N routers on one
port, the kernel spreading the clients' connections over them).
"""

import asyncio
import dataclasses
import json
import os
import random
import re
import time
from dataclasses import dataclass, field, replace

from infra.wan_link import parse_ms
from loadtest import proc_cpu
from loadtest.bench_modes import BENCH_SPEC, deployed, mode_spec
from loadtest.client import auth_headers
from loadtest.sse_stream import HttpStreamError, SseConnection, SseResponse
from shared.errors import PddError

_OPEN_EVENT = re.compile(rb'"finish_reason":\s*null')
_USAGE = re.compile(rb'"completion_tokens":\s*(\d+)')
WARMUP_STREAMS = 4
SERVED_MODEL = "pdd-standin"
STREAM_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class ControlPlaneLoad:
    """What one measurement asks of the deployment.

    Attributes:
        streams: Concurrent streaming clients.
        rate_tok_s: Tokens per second the engines produce for them in all (sets the step time).
        md: Main decode instances.
        max_tokens: Tokens per request.
        rounds: Requests each client sends, one after another.
        prompt_tokens: Prompt length (token ids, distinct per request).
        jitter: The WAN link's jitter (``pdd up --jitter``); ``0ms`` by default: a delay drawn per
            chunk is the network's, not the control plane's; with σ = 5 ms (``pdd up``'s
            default) it alone adds ~16 ms to the p99 gap (σ√2 × 2.33 between two tokens).
    """

    streams: int = 256
    rate_tok_s: float = 2000.0
    md: int = 2
    max_tokens: int = 128
    rounds: int = 2
    prompt_tokens: int = 32
    jitter: str = "0ms"

    @property
    def step_ms(self) -> float:
        """The stand-in's step time that yields ``rate_tok_s`` for ``streams`` streams."""
        return self.streams / self.rate_tok_s * 1000


@dataclass
class _Drive:
    """What the clients saw."""

    tokens: int = 0
    gaps_s: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


def run_control_plane_bench(load: ControlPlaneLoad, routers: list[int]) -> dict:
    """Measure ``load`` on a fresh deployment per router count; the report as a dict.

    Raises:
        PddError: a router count below 1, or a bad load.
    """
    if load.streams < 1 or load.rate_tok_s <= 0 or load.md < 1 or load.max_tokens < 1 or load.rounds < 1:
        raise PddError("control-plane bench: --streams, --rate, --md, --max-tokens and --rounds must be positive")
    try:
        parse_ms(load.jitter)
    except ValueError as exc:
        raise PddError(f"--jitter: {exc}") from None
    if not routers or min(routers) < 1:
        raise PddError(f"--routers {','.join(map(str, routers))}: every router count must be at least 1")
    report = {"cores": len(os.sched_getaffinity(0)), "load": {**dataclasses.asdict(load), "step_ms": load.step_ms}}
    report["routers"] = {str(n): _measure(load, n) for n in routers}
    return report


def _measure(load: ControlPlaneLoad, num_routers: int) -> dict:
    spec = replace(
        mode_spec("cross-site-pd-drc", BENCH_SPEC),
        model="tiny",
        engine="standin",
        served_model_name=SERVED_MODEL,
        md=load.md,
        routers=num_routers,
        jitter=load.jitter,
    )
    env = {"PDD_STANDIN_STEP_MS": str(load.step_ms), "PDD_MAX_SEQUENCES": str(max(16, load.streams))}
    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)  # the services started now read them
    try:
        with deployed(spec) as deployment:
            return asyncio.run(_measure_on(deployment, load))
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


async def _measure_on(deployment, load: ControlPlaneLoad) -> dict:
    url = deployment.router_url + "/completions"
    pids = {name: pid for name, pid in deployment.processes.items() if name != "supervisor"}
    pids["bench-client"] = os.getpid()
    warmup = replace(load, streams=min(WARMUP_STREAMS, load.streams), rounds=1, max_tokens=8)
    await _drive(url, warmup)
    before, started = proc_cpu.snapshot(pids), time.perf_counter()
    drive = await _drive(url, load)
    wall_s, after = time.perf_counter() - started, proc_cpu.snapshot(pids)
    per_process = proc_cpu.us_per_unit(before, after, drive.tokens)
    gaps_ms = sorted(g * 1000 for g in drive.gaps_s)
    p99 = _quantile(gaps_ms, 0.99)
    return {
        "tok_s": round(drive.tokens / wall_s, 1),
        "router_us_per_token": round(sum(us for name, us in per_process.items() if name.startswith("router")), 1),
        "p99_gap_ms": p99,
        "p50_gap_ms": _quantile(gaps_ms, 0.5),
        "p99_added_ms": round(p99 - load.step_ms, 2) if p99 is not None else None,
        "tokens": drive.tokens,
        "expected_tokens": load.streams * load.rounds * load.max_tokens,
        "wall_s": round(wall_s, 2),
        "errors": drive.errors[:5],
        "num_errors": len(drive.errors),
        "us_per_token": per_process,
    }


def _quantile(sorted_values: list[float], q: float) -> float | None:
    if not sorted_values:
        return None
    return round(sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))], 2)


async def _drive(url: str, load: ControlPlaneLoad) -> _Drive:
    """``load.streams`` clients, ``load.rounds`` requests each; what they saw."""
    drive = _Drive()
    await asyncio.gather(*(_client(url, load, i, drive) for i in range(load.streams)))
    return drive


async def _client(url: str, load: ControlPlaneLoad, index: int, drive: _Drive):
    rng = random.Random(index)
    connection = SseConnection(url, auth_headers())
    try:
        for _ in range(load.rounds):
            body = {
                "model": SERVED_MODEL,
                "prompt": [rng.randrange(1000, 20000) for _ in range(load.prompt_tokens)],
                "max_tokens": load.max_tokens,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            try:
                _record(await connection.post(json.dumps(body).encode(), STREAM_TIMEOUT_S), drive)
            except (OSError, HttpStreamError, TimeoutError) as exc:
                drive.errors.append(f"{type(exc).__name__}: {exc}")
    finally:
        connection.close()


def _record(response: SseResponse, drive: _Drive):
    """One response's content events' gaps (by the time their bytes arrived) and its usage's
    tokens go into ``drive``."""
    if response.status != 200:
        drive.errors.append(f"HTTP {response.status}: {response.body[:200].decode(errors='replace')}")
        return
    last = None
    for data, at_s in zip(response.events, response.times_s, strict=True):
        if _OPEN_EVENT.search(data):
            if last is not None:
                drive.gaps_s.append(at_s - last)
            last = at_s
        elif (usage := _USAGE.search(data)) is not None:
            drive.tokens += int(usage.group(1))
        elif data.startswith(b'{"error"'):
            drive.errors.append(data[:200].decode(errors="replace"))


def format_report(report: dict) -> str:
    """The report as a table: one row per router count, then per-process CPU per token."""
    load = report["load"]
    title = (
        f"control plane: {load['streams']} streams, {load['md']} main decoders, stand-in step "
        f"{load['step_ms']:.1f} ms (target {load['rate_tok_s']:.0f} tok/s), {report['cores']} cores"
    )
    lines = [
        title,
        "routers  tok/s  router us/token  p50 gap ms  p99 gap ms  p99 added ms  errors",
    ]
    for routers, row in report["routers"].items():
        lines.append(
            f"{routers:>7}  {row['tok_s']:>5.0f}  {row['router_us_per_token']:>15.1f}  {row['p50_gap_ms']!s:>10}  "
            f"{row['p99_gap_ms']!s:>10}  {row['p99_added_ms']!s:>12}  {row['num_errors']:>6}"
        )
        lines += [f"         {name:<16} {us:>8.1f} us/token" for name, us in row["us_per_token"].items()]
    return "\n".join(lines)
