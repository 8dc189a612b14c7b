"""``pdd profile``, ``pdd sim validate|paper`` and ``pdd plan``: parsers and handlers."""

import json
import time
from dataclasses import replace
from pathlib import Path

from shared.errors import PddError

REPO_PROFILE = Path(__file__).resolve().parents[2] / "docs" / "planning" / "profile-cpu-smollm2.json"
"""This machine's profile as shipped (``pdd profile --model smollm2`` on the 2-core CI machine)."""


WAN_SOCKET_BUFFER_BYTES = 64 << 20
"""A cancelled transfer's bytes already in socket buffers still cross: about one bandwidth-delay
product of a 25 Gbit/s, 20 ms line."""
PAPER_MODEL = "llama-3.1-8b-fp8kv"
"""The designs' model: one chip per instance, so a cluster of the paper's size is sized finely
(docs/planning.md; ``--model deepseek-v3`` runs them on 16- and 8-chip instances)."""


class PlanInputError(PddError, ValueError):
    """A ``pdd plan``, ``sim`` or ``profile`` argument that cannot be read."""

    code = "invalid_plan_input"


def add_profile_parser(commands):
    """``pdd profile`` (the ``profile`` entry point of ``pdd.commands``)."""
    profile = commands.add_parser("profile", help="measure this machine's engine cost model (JSON)")
    profile.add_argument("--model", default="smollm2", help="smollm2, tiny or an HF model folder")
    profile.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    profile.add_argument(
        "--dtype", default="float32", choices=["float32", "bfloat16", "float16"], help="weights and KV dtype"
    )
    profile.add_argument("--quick", action="store_true", help="small sizes, one repeat (a smoke run)")
    profile.add_argument("--out", default="profile.json", help="where to write the profile")
    profile.add_argument(
        "--no-deployment",
        action="store_true",
        help="skip the calibration runs through a "
        "real deployment on this machine (step speeds inside it; 1.5 minutes a run)",
    )
    profile.add_argument(
        "--calibration-runs",
        type=int,
        default=None,
        help="fresh deployments the calibration replays its workload through; the median "
        "over them is kept (default 3, and 1 with --quick)",
    )
    profile.set_defaults(handler=cmd_profile)


def add_sim_parser(commands):
    """``pdd sim validate|paper`` (the ``sim`` entry point of ``pdd.commands``)."""
    sim = commands.add_parser("sim", help="the discrete-event simulator")
    kinds = sim.add_subparsers(dest="sim", required=True)
    validate = kinds.add_parser("validate", help="replay a pdd bench run folder; predicted vs measured")
    validate.add_argument("dir", help="a pdd bench run --out folder (results.json, records.json)")
    validate.add_argument("--profile", default=str(REPO_PROFILE), help="cost profile from pdd profile")
    validate.add_argument(
        "--cores", type=int, default=None, help="cores the engines shared (default: the profile's machine)"
    )
    validate.add_argument(
        "--replays",
        type=int,
        default=None,
        help="replays of each repetition, step times "
        "drawn around the profile's in-deployment speeds (default 8; 1 without them)",
    )
    # validate.STEP_SPEED_SOURCES, spelled out: importing it costs every pdd command 1.6 s
    # (tests/test_step_speeds.py keeps the two equal)
    validate.add_argument(
        "--step-speeds",
        choices=["auto", "profile", "calibration", "run"],
        default="auto",
        help="how fast each kind of step runs inside a deployment, as a factor on the "
        "profile's fit: calibration = measured in the run's own calibration runs "
        "(pdd bench run --calibrate; DIR/calibration), profile = the profile's "
        "calibration, run = the run's own engine-call log (DIR/engine-calls.jsonl; a "
        "diagnostic). auto (default): calibration if DIR has it, else profile",
    )
    validate.add_argument("--json", action="store_true", help="machine-readable output")
    validate.set_defaults(handler=cmd_sim_validate)
    paper = kinds.add_parser("paper", help="the paper's setting at cluster scale, four designs, the bathtub")
    paper.add_argument("--out", required=True, help="folder for paper.json and the PNGs")
    paper.add_argument("--rate", type=float, default=4.0, help="requests per second every design is sized for")
    paper.add_argument("--requests", type=int, default=480, help="simulated requests per evaluation")
    paper.add_argument("--link", default="25gbit,20ms,2ms", help="the line between the datacenters: rate,RTT[,jitter]")
    paper.add_argument("--model", default=PAPER_MODEL, help="model from chips.json")
    paper.add_argument("--seed", type=int, default=0, help="workload seed")
    paper.add_argument("--json", action="store_true", help="print paper.json instead of the table")
    paper.set_defaults(handler=cmd_sim_paper)


def add_plan_parser(commands):
    """``pdd plan`` (the ``plan`` entry point of ``pdd.commands``)."""
    plan = commands.add_parser("plan", help="cheapest prefill/relay/main-decode counts for a workload, link and SLA")
    plan.add_argument(
        "--workload",
        required=True,
        help="a preset (agentic, chat) or a pdd bench trace (JSONL, from pdd bench trace --format jsonl)",
    )
    plan.add_argument("--link", default="25gbit,20ms", help="WAN rate,RTT[,jitter]")
    plan.add_argument(
        "--chips",
        default="H100-SXM,H200-SXM",
        help="chip A (prefill, relay), chip B (main decode), from loadtest/sim/chips.json",
    )
    plan.add_argument("--sla", default="ttft_p99=10s,itl_p99=100ms", help="ttft_pNN=…,itl_pNN=… (s or ms)")
    plan.add_argument(
        "--rate",
        type=float,
        default=None,
        help="requests per second (default: the preset's, agentic 3, chat 20, a trace 3)",
    )
    plan.add_argument("--model", default="llama-3.1-8b-fp8kv", help="model from chips.json")
    plan.add_argument("--requests", type=int, default=480, help="simulated requests per evaluation")
    plan.add_argument("--scan", action="store_true", help="also print the cost/latency frontier around the plan")
    plan.add_argument("--json", action="store_true", help="machine-readable output")
    plan.set_defaults(handler=cmd_plan)


def cmd_profile(args) -> int:
    """Measure and write the profile."""
    from loadtest.sim.profile import measure_profile, write_profile
    from shared.model_loader import load_model

    if args.calibration_runs is not None and args.calibration_runs < 1:
        raise PlanInputError(f"--calibration-runs: {args.calibration_runs} (at least 1; --no-deployment skips them)")
    # the deployment's engines run on the CPU, in float32
    calibrate = not args.no_deployment and args.device == "cpu" and args.dtype == "float32"
    profile = measure_profile(
        load_model(args.model, device=args.device, dtype=args.dtype),
        quick=args.quick,
        deployment_model=args.model if calibrate else None,
        calibration_runs=args.calibration_runs,
    )
    write_profile(profile, Path(args.out))
    errors = [abs(s["rel_error"]) for s in profile["samples"]]
    print(
        f"{len(errors)} samples, fit error median {sorted(errors)[len(errors) // 2]:.0%}, "
        f"max {max(errors):.0%}; profile in {args.out}"
    )
    return 0


def cmd_sim_validate(args) -> int:
    """Predicted vs measured for a bench run."""
    from loadtest.sim.validate import render, validate

    report = validate(Path(args.dir), Path(args.profile), args.cores, args.replays, args.step_speeds)
    print(json.dumps(report, indent=2) if args.json else render(report))
    return 0


def cmd_sim_paper(args) -> int:
    """The paper-scale comparison."""
    from loadtest.sim.cluster import Setting, Sla
    from loadtest.sim.paper import render, run_paper

    _check_catalogue([], args.model)
    report = run_paper(
        Path(args.out),
        rate_rps=args.rate,
        num_requests=args.requests,
        sla=Sla(),
        seed=args.seed,
        setting=Setting(model=args.model, link=parse_link(args.link)),
    )
    print(json.dumps(report, indent=2) if args.json else render(report))
    return 0


def parse_link(text: str):
    """``25gbit,20ms[,2ms]`` → a LinkSpec."""
    from infra.wan_link import parse_ms, parse_rate
    from loadtest.sim.network import LinkSpec

    parts = [p.strip() for p in text.split(",")]
    if len(parts) not in (2, 3):
        raise PlanInputError(f"--link {text!r}: expected RATE,RTT[,JITTER] such as 25gbit,20ms")
    return LinkSpec(
        parse_rate(parts[0]),
        parse_ms(parts[1]) / 1000,
        parse_ms(parts[2]) / 1000 if len(parts) == 3 else 0.0,
        WAN_SOCKET_BUFFER_BYTES,
    )


def parse_sla(text: str):
    """``ttft_p99=10s,itl_p99=100ms`` → an Sla (both at the same percentile)."""
    from loadtest.sim.cluster import Sla

    bounds, quantiles = {}, set()
    for item in filter(None, (p.strip() for p in text.split(","))):
        key, _, value = item.partition("=")
        metric, _, percentile = key.partition("_p")
        if metric not in ("ttft", "itl") or not percentile.isdigit() or not value:
            raise PlanInputError(f"--sla {item!r}: expected ttft_pNN=… or itl_pNN=… (e.g. ttft_p99=10s)")
        bounds[metric] = _seconds(value)
        quantiles.add(int(percentile) / 10 ** len(percentile))
    if len(quantiles) > 1:
        raise PlanInputError(f"--sla {text!r}: give TTFT and ITL at the same percentile")
    sla = Sla()
    return replace(
        sla,
        ttft_s=bounds.get("ttft", sla.ttft_s),
        itl_s=bounds.get("itl", sla.itl_s),
        quantile=quantiles.pop() if quantiles else sla.quantile,
    )


def _seconds(value: str) -> float:
    value = value.strip().lower()
    try:
        if value.endswith("ms"):
            return float(value[:-2]) / 1000
        return float(value[:-1]) if value.endswith("s") else float(value)
    except ValueError:
        raise PlanInputError(f"{value!r} is not a duration (10s, 100ms)") from None


DEFAULT_RATES = {"agentic": 3.0, "chat": 20.0}


def workload_source(name: str):
    """A preset's generator, or a trace file re-timed to the rate; and the default rate."""
    from loadtest.sim.cluster import preset_source
    from loadtest.sim.workload import PRESETS

    if name in PRESETS:
        return preset_source(PRESETS[name]), DEFAULT_RATES[name]
    path = Path(name)
    if not path.is_file():
        raise PlanInputError(f"--workload {name!r}: not a preset ({', '.join(PRESETS)}) or a trace file")
    from loadtest.runner import SYSTEM
    from loadtest.sim.workload import from_trace, retimed
    from loadtest.trace import load_trace
    from shared.model_loader import load_metadata

    base = from_trace(
        load_trace(path), load_metadata("smollm2").tokenizer, 256, concurrency=0, system_prompt=SYSTEM, name=path.name
    )
    return (lambda **kw: retimed(base, **{k: v for k, v in kw.items()})), 3.0


def cmd_plan(args) -> int:
    """Size PDD for the workload, link, chips and SLA."""
    from loadtest.sim.cluster import Setting
    from loadtest.sim.planner import plan_report, render_plan

    started = time.perf_counter()
    chips = [c.strip() for c in args.chips.split(",")]
    if len(chips) != 2:
        raise PlanInputError(f"--chips {args.chips!r}: expected A,B")
    _check_catalogue(chips, args.model)
    source, default_rate = workload_source(args.workload)
    setting = Setting(chip_a=chips[0], chip_b=chips[1], model=args.model, link=parse_link(args.link))
    report = plan_report(
        setting,
        source,
        args.rate or default_rate,
        parse_sla(args.sla),
        num_requests=args.requests,
        with_frontier=args.scan,
    )
    report["duration_s"] = round(time.perf_counter() - started, 1)
    print(json.dumps(report, indent=2) if args.json else render_plan(report))
    return 0


def _check_catalogue(chips: list[str], model_name: str):
    from loadtest.sim.cost_model import catalogue

    known = catalogue()
    for name in chips:
        if name not in known["chips"]:
            raise PlanInputError(f"--chips: unknown chip {name!r} (known: {', '.join(known['chips'])})")
    if model_name not in known["models"]:
        raise PlanInputError(f"--model: unknown model {model_name!r} (known: {', '.join(known['models'])})")
