"""``pdd bench``: the paper's comparison on our system, four modes on one trace and one link.

Modes (each on a fresh deployment, same trace, same WAN profile):
- ``same-site``: main decode at site A, no WAN — the floor;
- ``cross-site-pd``: P→MD only, the whole prompt's KV over the WAN (no decode-side cache);
- ``cross-site-pd-drc``: P→MD only, with the decode-side cache;
- ``pdd``: everything (selective relaying, catch-up, odd-traffic filter).

Writes ``results.json``, ``report.md`` and PNG plots into the output folder.

``--url`` replays the same trace against any OpenAI-compatible server instead (vLLM, SGLang,
Dynamo, or a PDD deployment already running) and writes the same ``results.json``, its one
mode named by ``--label``, so runs against other systems compare side by side.
"""

import asyncio
import json
import sys
import time
from pathlib import Path

import numpy as np

from loadtest.bench_intervals import ModeRun, Runs, ratio_intervals
from loadtest.bench_modes import DEFAULT_MODES, MODES, mode_deployment
from loadtest.client import RequestRecord
from loadtest.runner import run_trace
from loadtest.trace import generate_trace, load_trace, save_trace

DEFAULT_MAX_TOKENS = 256
"""Output tokens per turn unless ``--max-tokens`` says otherwise. Long enough that a relayed
request is still decoding when its KV lands and hands over, as in the paper's setting (1K-token
answers); with 24-token answers every relayed request ended on the relay at the default link,
so the relay's token share measured only how many requests were relayed."""


def percentiles(values: list[float]) -> dict:
    """p50/p90/p99/mean (None when empty)."""
    if not values:
        return {"p50": None, "p90": None, "p99": None, "mean": None}
    array = np.asarray(values, dtype=float)
    return {
        "p50": round(float(np.percentile(array, 50)), 1),
        "p90": round(float(np.percentile(array, 90)), 1),
        "p99": round(float(np.percentile(array, 99)), 1),
        "mean": round(float(array.mean()), 1),
    }


def summarise(
    records: list[RequestRecord],
    wall_s: float,
    ttft_slo_ms: float,
    itl_slo_ms: float,
    link: tuple[float, float] | None = None,
) -> dict:
    """One mode's figures; with ``link`` (its rate in bits/s, its RTT in seconds) also when the
    KV landed at main decode (``kv_timing``)."""
    ok = [r for r in records if r.error is None]
    good = [
        r for r in ok if r.ttft_ms is not None and r.ttft_ms <= ttft_slo_ms and max(r.itl_ms, default=0) <= itl_slo_ms
    ]
    output = sum(r.output_tokens for r in ok)
    eager = sum(r.pdd.get("eager_tokens", 0) for r in ok)
    count = lambda key: {
        v: sum(1 for r in ok if r.pdd.get(key) == v) for v in sorted({str(r.pdd.get(key)) for r in ok}) if v != "None"
    }
    return {
        "requests": len(records),
        "errors": len(records) - len(ok),
        "ttft_ms": percentiles([r.ttft_ms for r in ok if r.ttft_ms is not None]),
        "itl_ms": percentiles([g for r in ok for g in r.itl_ms]),
        "e2e_ms": percentiles([r.e2e_ms for r in ok if r.e2e_ms is not None]),
        "goodput_rps": round(len(good) / wall_s, 3) if wall_s else 0.0,
        "wan_kv_bytes": sum(r.pdd.get("wan_kv_bytes", 0) for r in ok),
        "rld_token_share": round(eager / output, 4) if output else 0.0,
        "pipelines": count("pipeline"),
        "handoff_modes": count("handoff_mode"),
        "odd_traffic": sum(1 for r in ok if r.pdd.get("odd_traffic")),
        "finished_on": count("finished_on"),
        "mean_output_tokens": round(output / len(ok), 1) if ok else 0.0,
        "wall_s": round(wall_s, 1),
        **(kv_timing(ok, *link) if link else {}),
    }


def kv_timing(records: list[RequestRecord], link_bps: float, rtt_s: float) -> dict:
    """Over the requests whose KV crossed the WAN: ``kv_after_prefill_ms``, from the end of the
    prefill to the last KV byte at main decode, and ``kv_excess_ms``, the same minus what a
    perfect overlap on the link would give, ``max(0, bytes / rate − prefill) + RTT / 2``
    (p50/p90 and the count). A request answered before its KV landed (the relay finished it)
    counts with what the router heard afterwards (``fill_late_landings``)."""
    after, excess = [], []
    for r in records:
        late = r.pdd.get("kv_landed_after_answer") or {}
        landed_ms = r.pdd.get("kv_after_prefill_ms")
        landed_ms = late.get("after_prefill_ms") if landed_ms is None else landed_ms
        compute_ms = r.pdd.get("prefill_compute_ms")
        compute_ms = late.get("prefill_compute_ms") if compute_ms is None else compute_ms
        wan_bytes = r.pdd.get("wan_kv_bytes", 0) or late.get("wan_kv_bytes", 0)
        if landed_ms is None or compute_ms is None or not wan_bytes:
            continue
        floor_ms = max(0.0, wan_bytes * 8 / link_bps * 1000 - compute_ms) + rtt_s * 500 if link_bps else rtt_s * 500
        after.append(landed_ms)
        excess.append(landed_ms - floor_ms)

    def p50_p90(values: list[float]) -> dict:
        figures = percentiles(values)
        return {"p50": figures["p50"], "p90": figures["p90"], "requests": len(values)}

    return {"kv_after_prefill_ms": p50_p90(after), "kv_excess_ms": p50_p90(excess)}


def fill_late_landings(router_url: str, records: list[RequestRecord]) -> int:
    """Give each record answered before its KV landed (the relay finished it) what the router
    heard afterwards (``POST /v1/pdd/kv-landings``), as ``pdd["kv_landed_after_answer"]`` =
    {after_prefill_ms, prefill_compute_ms, wan_kv_bytes}. Returns how many it found."""
    from urllib.request import Request, urlopen

    from loadtest.client import auth_headers

    waiting = {r.request_id: r for r in records if r.request_id and r.pdd and r.pdd.get("kv_after_prefill_ms") is None}
    ids, found = list(waiting), 0
    for start in range(0, len(ids), 1024):
        body = json.dumps({"ids": ids[start : start + 1024]}).encode()
        headers = {"Content-Type": "application/json", **auth_headers()}
        try:
            with urlopen(Request(f"{router_url}/pdd/kv-landings", body, headers, method="POST"), timeout=10) as reply:
                landings = json.load(reply)["landings"]
        except (OSError, ValueError, KeyError) as exc:  # the run's records stand without them
            print(f"late KV landings not read from {router_url}: {exc}", file=sys.stderr)
            return found
        for request_id, landing in landings.items():
            if landing["kv_after_prefill_ms"] is None:  # the prefill never replied
                continue
            waiting[request_id].pdd["kv_landed_after_answer"] = {
                "after_prefill_ms": landing["kv_after_prefill_ms"],
                "prefill_compute_ms": landing["prefill_compute_ms"],
                "wan_kv_bytes": landing["wan_kv_bytes"],
            }
            found += 1
    return found


def link_kv_bytes(wan_control_url: str, control_key: str) -> int:
    """KV bytes that crossed the WAN link's bulk routes (site A → site B), as counted on the link."""
    from infra.wan_control import call

    routes = call(wan_control_url, None, control_key)["routes"]
    return sum(r["bytes_forward"] for name, r in routes.items() if name.startswith("bulk-"))


def settled_link_kv_bytes(
    wan_control_url: str, control_key: str, quiet_s: float = 1.0, timeout_s: float = 120.0
) -> int:
    """The link's KV byte count once transfers still running after the last answer are done.

    A request the relay finished keeps shipping its KV to main decode (so main decode's cache
    stays aligned); those bytes crossed the WAN too, so the count waits for them: until it has
    not moved for ``quiet_s`` (at most ``timeout_s``).
    """
    deadline = time.monotonic() + timeout_s
    last = link_kv_bytes(wan_control_url, control_key)
    while time.monotonic() < deadline:
        time.sleep(quiet_s)
        now = link_kv_bytes(wan_control_url, control_key)
        if now == last:
            break
        last = now
    return last


def run_mode(mode: str, trace, args) -> tuple[list[RequestRecord], float, int]:
    """Start a fresh deployment for ``mode``, replay the trace, stop it.

    Returns the records, the wall time and the KV bytes counted on the WAN link.
    """
    with mode_deployment(mode, args) as deployment:
        records, wall_s = asyncio.run(
            run_trace(deployment.router_url, trace, concurrency=args.concurrency, open_loop=args.rate > 0)
        )
        link_bytes = settled_link_kv_bytes(deployment.wan_control_url, deployment.control_key())
        fill_late_landings(deployment.router_url, records)
        return records, wall_s, link_bytes


def interleaved(modes: list[str], repetition: int) -> list[str]:
    """The modes in repetition ``repetition``'s order: rotated by one each time, so no mode is
    always first (on a fresh machine) or always last."""
    shift = repetition % len(modes)
    return modes[shift:] + modes[:shift]


def pooled_summary(mode: str, repetitions: list[dict], runs: list[ModeRun], args) -> dict:
    """A mode's figures over every repetition: latencies and shares over all requests, goodput
    over the summed wall time, byte counts as the mean per repetition (one trace's worth)."""
    records = [r for run in runs for r in run.records]
    wall_s = sum(rep[mode]["wall_s"] for rep in repetitions)
    link_bps, rtt_s = bench_link(args)
    summary = summarise(records, wall_s, args.ttft_slo_ms, args.itl_slo_ms, (link_bps, rtt_s))
    summary["wan_kv_bytes"] = round(summary["wan_kv_bytes"] / len(runs))
    link = [run.link_kv_bytes for run in runs]
    summary["wan_link_kv_bytes"] = None if None in link else round(sum(link) / len(link))
    summary["wan_link_load"] = link_load(None if None in link else sum(link), wall_s, link_bps)
    summary["repetitions"] = len(runs)
    return summary


def link_load(link_kv_bytes: int | None, wall_s: float, link_bps: float) -> float | None:
    """The KV bytes the link carried over a replay as a fraction of what it could carry in the
    replay's wall time (None: not counted, or no rate limit). Near or above 1 the link was busy
    throughout: KV landed ever later behind the flows before it, whatever the placement."""
    if link_kv_bytes is None or link_bps <= 0 or wall_s <= 0:
        return None
    return round(link_kv_bytes * 8 / link_bps / wall_s, 3)


def bench_link(args) -> tuple[float, float]:
    """The emulated link's rate (bits/s; 0: unlimited) and RTT (seconds) of a benchmark run."""
    from infra.wan_link import parse_ms, parse_rate

    return parse_rate(args.bandwidth), parse_ms(args.rtt) / 1000


def bench_trace(args):
    """The trace ``args`` describe: ``--trace`` read back, or generated from the seed."""
    if getattr(args, "trace", None):
        return load_trace(Path(args.trace))
    return generate_trace(
        args.seed,
        sessions=args.sessions,
        turns=args.turns,
        cold_lines=args.cold_lines,
        max_tokens=args.max_tokens,
        session_rate_per_s=args.rate,
    )


def trace_shape(trace) -> dict:
    """What the replayed trace holds: with ``--trace`` its own turns, whatever the generator's
    flags (``--max-tokens``, ``--sessions``) say."""
    return {
        "requests": len(trace),
        "sessions": len({turn.session for turn in trace}),
        "max_tokens": sorted({turn.max_tokens for turn in trace}),
    }


def run_bench(args) -> dict:
    """All modes (or one ``--url`` endpoint), the handoff microbenchmark, and the output files."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    trace = bench_trace(args)
    save_trace(trace, out / "trace.jsonl")
    started = time.perf_counter()
    results = {"modes": {}, "config": {k: v for k, v in vars(args).items() if not callable(v)}}
    results["config"]["trace_shape"] = trace_shape(trace)
    records = {}
    if args.url:
        return _run_endpoint(args, trace, out, results, started)
    args.model = args.model or "smollm2"
    runs: Runs = {mode: [] for mode in args.modes}
    link_bps, rtt_s = bench_link(args)
    for repetition in range(args.repeat):
        for mode in interleaved(args.modes, repetition):
            print(f"mode {mode} (repetition {repetition + 1}/{args.repeat}): {len(trace)} requests", flush=True)
            mode_records, wall_s, link_bytes = run_mode(mode, trace, args)
            for record in mode_records:
                record.repetition = repetition
            runs[mode].append(ModeRun(mode_records, link_bytes))
            summary = summarise(mode_records, wall_s, args.ttft_slo_ms, args.itl_slo_ms, (link_bps, rtt_s))
            summary["wan_link_kv_bytes"] = link_bytes
            summary["wan_link_load"] = link_load(link_bytes, wall_s, link_bps)
            results.setdefault("repetitions", [{} for _ in range(args.repeat)])[repetition][mode] = summary
            print(f"  {json.dumps(summary['ttft_ms'])} errors={summary['errors']}", flush=True)
        if getattr(args, "calibrate", False):
            from loadtest.sim.step_speeds import calibrate_during_bench

            print(f"calibration (repetition {repetition + 1}/{args.repeat})", flush=True)
            # the tiny model's test runs take the smoke workload
            calibrate_during_bench(args.model, out, repetition, quick=args.model == "tiny")
    for mode in args.modes:
        results["modes"][mode] = pooled_summary(mode, results["repetitions"], runs[mode], args)
        records[mode] = [r for run in runs[mode] for r in run.records]
    results["intervals"] = ratio_intervals(runs, seed=args.seed)
    from infra.wan_link import parse_profile
    from loadtest.handoff_microbench import run_handoff_microbench
    from shared.model_loader import load_model

    profile = parse_profile(args.bandwidth, args.rtt, args.jitter, args.seed)
    results["handoff_microbench"] = run_handoff_microbench(
        load_model(args.model), profile=profile, trials=args.handoff_trials
    )
    _write(results, records, out, started)
    return results


def _run_endpoint(args, trace, out: Path, results: dict, started: float) -> dict:
    """Replay the trace against ``args.url`` as one mode named ``args.label``."""
    url = args.url.rstrip("/")
    print(f"{args.label} ({url}): {len(trace)} requests", flush=True)
    records, wall_s = asyncio.run(
        run_trace(url, trace, concurrency=args.concurrency, open_loop=args.rate > 0, model=args.model)
    )
    results["modes"][args.label] = summarise(records, wall_s, args.ttft_slo_ms, args.itl_slo_ms)
    results["modes"][args.label]["wan_link_kv_bytes"] = None  # no link of ours to count on
    print(
        f"  {json.dumps(results['modes'][args.label]['ttft_ms'])} errors={results['modes'][args.label]['errors']}",
        flush=True,
    )
    _write(results, {args.label: records}, out, started)
    return results


def _write(results: dict, records: dict, out: Path, started: float):
    from loadtest.report import write_report

    results["config"]["duration_s"] = round(time.perf_counter() - started, 1)
    (out / "results.json").write_text(json.dumps(results, indent=2))
    (out / "records.json").write_text(json.dumps({m: [r.__dict__ for r in rs] for m, rs in records.items()}, indent=1))
    write_report(results, records, out)


def write_trace(args) -> int:
    """``pdd bench trace``: the benchmark's trace in our JSONL or aiperf's Mooncake format."""
    args = resolve_size(args)
    trace = bench_trace(args)
    out = Path(args.out)
    if args.format == "jsonl":
        save_trace(trace, out)
    else:
        out.write_text("".join(json.dumps(row) + "\n" for row in mooncake_rows(trace)))
    print(f"{len(trace)} requests in {out} ({args.format})")
    return 0


def mooncake_rows(trace) -> list[dict]:
    """aiperf's multi-turn Mooncake rows: one per turn, sessions by ``session_id``; a session's
    first turn at its start time (ms), each later one as soon as the previous answer is in."""
    rows = []
    for turn in sorted(trace, key=lambda t: (t.session, t.turn)):
        row = {"session_id": f"session-{turn.session}", "text_input": turn.content, "output_length": turn.max_tokens}
        if turn.turn == 0:
            row["timestamp"] = int(turn.start_s * 1000)
        else:
            row["delay"] = 0
        rows.append(row)
    return rows


def add_bench_run_parser(bench_kinds):
    """``pdd bench run``."""
    run = bench_kinds.add_parser("run", help="the four-mode comparison (results.json, report.md, plots)")
    run.add_argument("--out", required=True, help="folder for results.json, report.md, plots and the trace")
    run.add_argument("--quick", action="store_true", help="small trace: 5 sessions x 4 turns (full: 12 x 6)")
    run.add_argument(
        "--url",
        default=None,
        help="benchmark this OpenAI-compatible base URL (e.g. "
        "http://127.0.0.1:8000/v1) instead of deployments started here",
    )
    run.add_argument(
        "--label", default="endpoint", help="the mode name of a --url run in results.json (default: endpoint)"
    )
    run.add_argument(
        "--model",
        default=None,
        help="model to deploy (smollm2, tiny or an HF folder; default "
        "smollm2); with --url the model name sent (default: the first /models lists)",
    )
    run.add_argument(
        "--engine",
        default="hf",
        help="engine backend of every engine service (hf, vllm; vllm needs the .venv-vllm environment)",
    )
    run.add_argument(
        "--modes",
        nargs="+",
        default=DEFAULT_MODES,
        choices=list(MODES),
        help=f"deployments to compare (default: {' '.join(DEFAULT_MODES)})",
    )
    run.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="repetitions of every mode, interleaved; ratios "
        "are reported as a median with a 90%% bootstrap interval (default 1)",
    )
    run.add_argument(
        "--calibrate",
        action="store_true",
        help="after each repetition, replay pdd profile's "
        "calibration workload through a fresh PDD deployment (OUT/calibration/, about 1.5 minutes "
        "each): pdd sim validate then times steps as the machine ran them in the run's minutes",
    )
    run.add_argument("--trace", default=None, help="replay a JSONL trace instead of generating one")
    run.add_argument("--sessions", type=int, default=None, help="sessions in the generated trace")
    run.add_argument("--turns", type=int, default=None, help="turns per session in the generated trace")
    run.add_argument("--cold-lines", type=int, default=40, help="tool-output lines of a first turn (default 40)")
    run.add_argument(
        "--max-tokens",
        type=int,
        default=DEFAULT_MAX_TOKENS,
        help=f"output tokens per turn (default {DEFAULT_MAX_TOKENS}; odd requests get 2)",
    )
    run.add_argument("--concurrency", type=int, default=2, help="closed-loop sessions at once (default 2)")
    run.add_argument(
        "--rate", type=float, default=0.0, help="open-loop session starts per second (default 0: closed loop)"
    )
    run.add_argument("--bandwidth", default="100mbit", help="emulated WAN rate (default 100mbit)")
    run.add_argument("--rtt", default="40ms", help="emulated WAN round trip (default 40ms)")
    run.add_argument("--jitter", default="5ms", help="emulated WAN jitter (default 5ms)")
    run.add_argument(
        "--window",
        default="4MiB",
        help="bytes one connection may have in flight across the emulated link, as over a real path "
        "(default 4MiB, this host's tcp_wmem maximum; 0: no limit)",
    )
    run.add_argument("--seed", type=int, default=0, help="trace and jitter seed (default 0)")
    run.add_argument("--kv-cache-mb", type=int, default=512, help="KV pool per engine (default 512)")
    run.add_argument("--ttft-slo-ms", type=float, default=3000.0, help="goodput's TTFT bound (default 3000)")
    run.add_argument("--itl-slo-ms", type=float, default=1000.0, help="goodput's inter-token bound (default 1000)")
    run.add_argument("--handoff-trials", type=int, default=20, help="trials of the handoff microbenchmark (default 20)")
    trace = bench_kinds.add_parser("trace", help="write the benchmark's agentic trace for other tools")
    trace.add_argument("--out", required=True, help="file to write")
    trace.add_argument(
        "--format",
        default="mooncake",
        choices=["mooncake", "jsonl"],
        help="mooncake: aiperf's --custom-dataset-type mooncake_trace (default); jsonl: ours",
    )
    trace.add_argument("--quick", action="store_true", help="the quick benchmark's trace")
    trace.add_argument("--sessions", type=int, default=None, help="sessions (default: 5 quick, 12 full)")
    trace.add_argument("--turns", type=int, default=None, help="turns per session (default: 4 quick, 6 full)")
    trace.add_argument("--cold-lines", type=int, default=40, help="tool-output lines of a first turn")
    trace.add_argument(
        "--max-tokens",
        type=int,
        default=DEFAULT_MAX_TOKENS,
        help=f"output tokens per turn (default {DEFAULT_MAX_TOKENS})",
    )
    trace.add_argument("--rate", type=float, default=0.0, help="open-loop session starts per second (0: closed loop)")
    trace.add_argument("--seed", type=int, default=0, help="trace seed")
    return run


def resolve_size(args):
    """Quick: 5 sessions × 4 turns (+ odd); full: 12 × 6."""
    args.sessions = args.sessions or (5 if args.quick else 12)
    args.turns = args.turns or (4 if args.quick else 6)
    return args
