"""The load-test side of the ``pdd`` command line: ``bench``, ``chaos`` and ``demo``, registered
as entry points of the ``pdd.commands`` group (pyproject.toml) that ``infra/cli.py`` discovers."""

import json
from dataclasses import replace
from pathlib import Path

from infra.cli_args import RUN_DIR_HELP, add_model_args
from infra.deployment_spec import DeploymentSpec, add_up_arguments
from shared.errors import PddError


def add_bench_parser(commands):
    """``pdd bench engine|handoff|run|trace|handoff-micro|bulk|control-plane`` (the ``bench``
    entry point of ``pdd.commands``)."""
    from loadtest.bench import add_bench_run_parser, write_trace

    bench = commands.add_parser("bench", help="benchmarks")
    bench_kinds = bench.add_subparsers(dest="bench", required=True)
    engine = bench_kinds.add_parser("engine", help="engine microbenchmark, side by side or JSON on stdout")
    add_model_args(engine)
    engine.add_argument("--quick", action="store_true", help="short contexts, one repeat")
    engine.add_argument(
        "--json", action="store_true", help='print {"<engine>": {figures...}, ...} instead of the side-by-side table'
    )
    engine.add_argument(
        "--threads", type=int, default=0, help="torch intra-op threads (0: torch's default, one per core)"
    )
    engine.add_argument(
        "--cpu-time",
        action="store_true",
        help="time by the process's CPU time, not the wall clock (with --threads 1: robust to a shared machine)",
    )
    engine.add_argument(
        "--peak-gflop-s",
        type=float,
        default=0.0,
        help="this machine's peak fp32 GFLOP/s (the prefill floor; default: measured at the start)",
    )
    engine.add_argument(
        "--read-gb-s",
        type=float,
        default=0.0,
        help="this machine's read bandwidth, GB/s (the decode floor; default: measured at the start)",
    )
    engine.add_argument(
        "--engine",
        dest="engine_name",
        default="hf",
        help="engine backend, or several side by side in one run (hf, vllm, hf,vllm)",
    )
    engine.set_defaults(handler=cmd_bench_engine)
    handoff = bench_kinds.add_parser(
        "handoff", help="main decode's worst inter-token gap during a 100-token handoff, one-shot vs catch-up"
    )
    add_model_args(handoff)
    handoff.add_argument("--other-streams", type=int, default=3, help="streams decoding beside the handoff")
    handoff.add_argument("--context", type=int, default=512, help="prompt tokens")
    handoff.add_argument("--chunk-tokens", type=int, default=32, help="tokens per catch-up chunk")
    handoff.set_defaults(handler=cmd_bench_handoff)
    add_bench_run_parser(bench_kinds).set_defaults(handler=cmd_bench_run)
    bench_kinds.choices["trace"].set_defaults(handler=write_trace)  # added with run
    micro = bench_kinds.add_parser(
        "handoff-micro", help="100-token handoff by token IDs vs by KV, over the same emulated WAN link"
    )
    add_model_args(micro)
    micro.add_argument("--trials", type=int, default=20, help="handoffs timed per kind")
    micro.add_argument("--context", type=int, default=512, help="prompt tokens")
    micro.add_argument("--bandwidth", default="100mbit", help="emulated WAN rate")
    micro.add_argument("--rtt", default="40ms", help="emulated WAN round trip")
    micro.add_argument("--jitter", default="5ms", help="emulated WAN jitter")
    micro.set_defaults(handler=cmd_bench_handoff_micro)
    bulk = bench_kinds.add_parser(
        "bulk",
        help="bulk channel throughput beside a raw socket pump and memcpy, plaintext and mutual TLS, on loopback",
    )
    bulk.add_argument("--megabytes", type=int, default=256, help="per flow (default 256)")
    bulk.add_argument("--repeats", type=int, default=3, help="runs of each measurement, interleaved (default 3)")
    bulk.add_argument(
        "--geometry",
        default="30x3x64",
        help="KV layers x KV heads x head dim of the frames (default 30x3x64: SmolLM2-135M; the tiny model: 2x2x16)",
    )
    bulk.add_argument("--dtype", default="float32", help="KV dtype (float32, bfloat16, float16)")
    bulk.add_argument("--frame-tokens", type=int, default=256, help="tokens per frame (default 256, as deployed)")
    bulk.add_argument(
        "--link", default="1gbit", help="also measure through the WAN link at this rate (default 1gbit; 0: not)"
    )
    bulk.add_argument("--link-rtt", default="40ms", help="the link's round trip (default 40ms)")
    bulk.add_argument(
        "--link-window", default="4MiB", help="bytes one connection may have in flight on the link (default 4MiB)"
    )
    bulk.add_argument("--link-megabytes", type=int, default=200, help="per flow through the link (default 200)")
    bulk.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    bulk.set_defaults(handler=cmd_bench_bulk)
    _add_control_plane_parser(bench_kinds)


def _add_control_plane_parser(bench_kinds):
    from loadtest.control_plane_bench import ControlPlaneLoad

    default = ControlPlaneLoad()
    plane = bench_kinds.add_parser(
        "control-plane",
        help="the token path (real services, NATS, WAN link, router) under load with a stand-in engine: "
        "tokens/s, CPU per token of every process, p99 inter-token gap",
    )
    plane.add_argument("--streams", type=int, default=default.streams, help="concurrent streaming clients")
    plane.add_argument(
        "--rate", type=float, default=default.rate_tok_s, help="tokens/s the engines produce in all (default 2000)"
    )
    plane.add_argument("--md", type=int, default=default.md, help="main decode instances (default 2)")
    plane.add_argument("--max-tokens", type=int, default=default.max_tokens, help="tokens per request")
    plane.add_argument("--rounds", type=int, default=default.rounds, help="requests per client, back to back")
    plane.add_argument(
        "--jitter",
        default=default.jitter,
        help="the WAN link's jitter (default 0ms: the network's own, not the control plane's; pdd up's is 5ms)",
    )
    plane.add_argument(
        "--routers",
        default="1",
        help="router counts to measure, comma-separated, each on a fresh deployment (e.g. 1,2,4; default 1)",
    )
    plane.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    plane.set_defaults(handler=cmd_bench_control_plane)


def cmd_bench_control_plane(args) -> int:
    """The control plane under load; a table (or ``--json``) on stdout."""
    from loadtest.control_plane_bench import ControlPlaneLoad, format_report, run_control_plane_bench

    try:
        routers = [int(n) for n in args.routers.split(",")]
    except ValueError:
        raise PddError(f"--routers {args.routers!r}: expected router counts such as 1 or 1,2,4") from None
    load = ControlPlaneLoad(args.streams, args.rate, args.md, args.max_tokens, args.rounds, jitter=args.jitter)
    report = run_control_plane_bench(load, routers)
    print(json.dumps(report) if args.json else format_report(report))
    return 0


def add_chaos_parser(commands):
    """``pdd chaos`` (the ``chaos`` entry point of ``pdd.commands``)."""
    chaos = commands.add_parser("chaos", help="inject faults into the running deployment; check nothing is lost")
    chaos.add_argument(
        "--scenario",
        default="all",
        help="one of md-kill, relay-kill, prefill-kill, "
        "router-kill, nats-a-restart, nats-b-outage, partition, stalls, slow-wan, redeploy, "
        "a comma-separated list of them, or all (default: all)",
    )
    chaos.add_argument("--streams", type=int, default=4, help="greedy streams per scenario (default 4)")
    chaos.add_argument("--max-tokens", type=int, default=96, help="tokens per stream (default 96)")
    chaos.add_argument("--prompt-words", type=int, default=300, help="words per cold prompt (default 300)")
    chaos.add_argument("--outage-s", type=float, default=25.0, help="length of the nats-b outage (default 25)")
    chaos.add_argument("--partition-s", type=float, default=60.0, help="length of the partition (default 60)")
    chaos.add_argument("--out", default=None, help="also write the Markdown table here")
    chaos.add_argument("--run-dir", default=None, help=RUN_DIR_HELP)
    chaos.set_defaults(handler=cmd_chaos)


def add_demo_parser(commands):
    """``pdd demo``: ``pdd up``'s flags (the ``demo`` entry point of ``pdd.commands``)."""
    demo = commands.add_parser("demo", help="up, agent conversation, down")
    add_up_arguments(demo)
    demo.set_defaults(handler=cmd_demo)


def cmd_bench_run(args) -> int:
    """The modes' comparison; a summary on stdout, the results in ``args.out``."""
    from loadtest.bench import resolve_size, run_bench

    results = run_bench(resolve_size(args))
    print(
        json.dumps({m: {"ttft_ms": v["ttft_ms"], "errors": v["errors"]} for m, v in results["modes"].items()}, indent=2)
    )
    print(f"results in {args.out}/results.json and {args.out}/report.md")
    return 0


def cmd_bench_handoff_micro(args) -> int:
    """A handoff by token IDs vs by KV over the emulated link; JSON on stdout."""
    from infra.wan_link import parse_profile
    from loadtest.handoff_microbench import run_handoff_microbench
    from shared.model_loader import load_model

    loaded = load_model(args.model, device=args.device, dtype=args.dtype)
    profile = parse_profile(args.bandwidth, args.rtt, args.jitter)
    print(
        json.dumps(run_handoff_microbench(loaded, profile=profile, context=args.context, trials=args.trials), indent=2)
    )
    return 0


def cmd_bench_bulk(args) -> int:
    """Bulk channel throughput beside the machine's limits; a table (or ``--json``) on stdout."""
    from loadtest.bulk_bench import format_report, run_bulk_bench

    try:
        geometry = tuple(int(n) for n in args.geometry.lower().split("x"))
    except ValueError:
        geometry = ()
    if len(geometry) != 3 or min(geometry) < 1:
        raise PddError(f"--geometry {args.geometry!r}: expected LAYERSxHEADSxDIM, e.g. 30x3x64")
    report = run_bulk_bench(
        args.megabytes,
        args.repeats,
        geometry=geometry,
        dtype=args.dtype,
        frame_tokens=args.frame_tokens,
        link=_bench_link(args),
        link_megabytes=args.link_megabytes,
    )
    print(json.dumps(report) if args.json else format_report(report))
    return 0


def _bench_link(args):
    """The link ``pdd bench bulk`` measures through (None for ``--link 0``)."""
    from infra.wan_link import LinkProfile, parse_bytes, parse_ms, parse_rate

    try:
        rate_bps = parse_rate(args.link)
        profile = LinkProfile(
            bandwidth_bps=rate_bps,
            rtt_ms=parse_ms(args.link_rtt),
            jitter_ms=0,
            window_bytes=int(parse_bytes(args.link_window)),
        )
    except ValueError as exc:
        raise PddError(str(exc)) from None
    return profile if rate_bps else None


def cmd_bench_handoff(args) -> int:
    """Main decode's worst gap during a handoff, one-shot vs catch-up; JSON on stdout."""
    from loadtest.handoff_bench import run_handoff_bench
    from shared.model_loader import load_model

    loaded = load_model(args.model, device=args.device, dtype=args.dtype)
    report = run_handoff_bench(
        loaded, other_streams=args.other_streams, context=args.context, chunk_tokens=args.chunk_tokens
    )
    print(json.dumps(report, indent=2))
    return 0


def cmd_bench_engine(args) -> int:
    """The engine microbenchmark (several engines side by side when given); JSON on stdout."""
    from loadtest.engine_bench import compare_engines, format_side_by_side
    from loadtest.engine_limits import MachineLimits
    from shared.model_loader import load_model

    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    model = "tiny" if args.quick and args.model == "smollm2" else args.model
    loaded = load_model(model, device=args.device, dtype=args.dtype)
    names = [n.strip() for n in args.engine_name.split(",") if n.strip()]
    measured = MachineLimits.measure() if not (args.peak_gflop_s and args.read_gb_s) else None
    limits = MachineLimits(
        peak_gflop_s=args.peak_gflop_s or measured.peak_gflop_s, read_gb_s=args.read_gb_s or measured.read_gb_s
    )
    figures = compare_engines(loaded, names, quick=args.quick, limits=limits, cpu_time=args.cpu_time)["engines"]
    print(json.dumps(figures, indent=2) if args.json else format_side_by_side(figures))
    return 0


def cmd_demo(args) -> int:
    """Start a deployment, hold an agent conversation with it, stop it."""
    from infra import launcher
    from loadtest.demo_conversation import run_demo

    spec = DeploymentSpec.from_args(args)
    run_dir = launcher.run_dir_of(spec.run_dir)
    print("starting the two-site deployment (first run converts SmolLM2 once) ...", flush=True)
    try:
        deployment = launcher.up(replace(spec, run_dir=str(run_dir)))
        print(f"PDD is up: {deployment.router_url}", flush=True)
        return run_demo(deployment.router_url, spec.model)
    finally:
        launcher.down(run_dir, quiet=True)
        print("deployment stopped")


def cmd_chaos(args) -> int:
    """Run chaos scenarios against the running deployment; print one JSON row each, then a table."""
    import asyncio

    from infra import launcher
    from loadtest import chaos
    from shared.model_loader import load_model

    run_dir = launcher.run_dir_of(args.run_dir)
    deployment = launcher.load_state(run_dir)
    if deployment is None:
        raise launcher.LauncherError(f"no deployment recorded in {run_dir} (pdd up first)")
    names = list(chaos.SCENARIOS) if args.scenario == "all" else args.scenario.split(",")
    unknown = [n for n in names if n not in chaos.SCENARIOS]
    if unknown:
        raise PddError(f"unknown scenario {unknown[0]!r}; choose from {', '.join(chaos.SCENARIOS)} or all")
    model = deployment.commands["router-0"]["env"]["PDD_MODEL"]
    served = _get_served_model(deployment)
    ctx = chaos.ChaosContext(
        run_dir=run_dir,
        model_name=served,
        loaded=load_model(model),
        streams=args.streams,
        max_tokens=args.max_tokens,
        prompt_words=args.prompt_words,
        outage_s=args.outage_s,
        partition_s=args.partition_s,
    )
    rows = asyncio.run(chaos.run(ctx, names))
    text = chaos.table(rows)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


def _get_served_model(deployment) -> str:
    import urllib.request

    from loadtest.client import auth_headers

    request = urllib.request.Request(deployment.router_url + "/models", headers=auth_headers())
    with urllib.request.urlopen(request, timeout=10) as response:
        return json.loads(response.read())["data"][0]["id"]
