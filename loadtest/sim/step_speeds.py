"""How fast each kind of step runs inside a running deployment, against the isolated fit.

``pdd profile`` times steps of a bare engine. Inside a deployment on a shared host the same
steps run slower, and unevenly: every service's event loop, the NATS servers, the router and
the WAN link take turns on the same cores, and an engine's compute threads stall whenever one
of them is descheduled. Measured here on 2026-12-03 (``docs/planning.md``): prompt chunks ran
at 1.5× the fit alone and 1.9× beside another engine's step; two-sequence decode steps at 1.8×.

So the profile also replays a short calibration workload (not the benchmark's trace) through
a real PDD deployment with the engine-call log on, and reads, per kind of step, the median of
measured over predicted time, alone and beside another engine's step, and how widely steps
spread around it. The simulator slows each step by its kind's factor and, when replaying
several times, draws each step's noise from that spread.
"""

import asyncio
import dataclasses
import json
import math
import os
import statistics
import tempfile
from pathlib import Path

from loadtest.sim.cost_model import LinearCostModel

KINDS = ("prompt", "decode_one", "decode_many")
"""Steps computing prompt or extend chunks (with or without decodes); decode-only steps of one
sequence; decode-only steps of several."""
ALONE_OVERLAP = 0.05
"""A step is alone when other engines' steps overlap less than this share of it..."""
BESIDE_OVERLAP = 0.5
"""...and beside another when they overlap at least this share."""
MIN_STEPS = 5
"""Fewer steps of a kind and condition than this: no factor (the simulator falls back to the
profile's contention figure)."""
CALIBRATION_SEED = 101
"""The calibration trace's seed: not the benchmark's (0), so the validation replays requests
the calibration never saw."""


def kind_of(has_chunks: bool, num_decodes: int) -> str:
    """A step's kind (:data:`KINDS`): any prompt or extend chunk makes it ``prompt``. The
    calibration reads kinds with this and the simulator steps by it, so the two agree."""
    if has_chunks:
        return "prompt"
    return "decode_one" if num_decodes == 1 else "decode_many"


def step_kind(batch: list[list[int]]) -> str:
    """A step's kind from its call-log batch (``[new_tokens, context_tokens]`` per sequence)."""
    return kind_of(any(new > 1 for new, _ in batch), len(batch))


def predicted_s(batch: list[list[int]], cost: LinearCostModel) -> float:
    """The fit's time for a step with this batch."""
    chunks = [(new, context) for new, context in batch if new > 1]
    decodes = [context for new, context in batch if new == 1]
    return cost.step_s(chunks, len(decodes), sum(decodes))


def measure_step_speeds(calls: list[dict], cost: LinearCostModel) -> dict:
    """Per kind, measured over predicted step time alone and beside, from an engine-call log of
    one deployment (each instance's first step, a warm-up, left out).

    Returns:
        ``{kind: {"alone", "beside": median ratio or None, "alone_steps", "beside_steps":
        counts, "spread": :func:`log_spread` of the steps alone}}``.
    """
    steps = [c for c in calls if c["call"] == "step" and c.get("batch")]
    by_instance: dict[str, list[tuple[float, float]]] = {}
    for call in steps:
        by_instance.setdefault(call["instance"], []).append((call["start_s"], call["end_s"]))
    first = {instance: min(spans) for instance, spans in by_instance.items()}
    ratios: dict[tuple[str, str], list[float]] = {}
    for call in steps:
        start, end = call["start_s"], call["end_s"]
        if (start, end) == first[call["instance"]] or end <= start:
            continue
        overlap = sum(
            max(0.0, min(end, e) - max(start, s))
            for instance, spans in by_instance.items()
            if instance != call["instance"]
            for s, e in spans
        ) / (end - start)
        if ALONE_OVERLAP <= overlap < BESIDE_OVERLAP:
            continue
        condition = "alone" if overlap < ALONE_OVERLAP else "beside"
        ratios.setdefault((step_kind(call["batch"]), condition), []).append(
            (end - start) / predicted_s(call["batch"], cost)
        )
    speeds = {}
    for kind in KINDS:
        row = {}
        for condition in ("alone", "beside"):
            values = ratios.get((kind, condition), [])
            row[condition] = round(statistics.median(values), 3) if len(values) >= MIN_STEPS else None
            row[f"{condition}_steps"] = len(values)
        row["spread"] = log_spread(ratios.get((kind, "alone"), []))
        speeds[kind] = row
    return speeds


def measure_wake_s(calls: list[dict]) -> float:
    """The median delay from a prompt's ``add_request`` on an idle prefill engine to the start
    of the step that computes it: the engine loop's wake-up (prompts arriving meanwhile share
    that step). None without such prompts."""
    delays = []
    for instance in {c["instance"] for c in calls if c["call"] == "add_request"}:
        own = sorted((c for c in calls if c["instance"] == instance), key=lambda c: c["queued_s"])
        steps = [c for c in own if c["call"] == "step"]
        for call in own:
            if call["call"] != "add_request":
                continue
            queued = call["queued_s"]
            if any(s["queued_s"] <= queued < s["end_s"] for s in steps):
                continue  # a step was asked for or running: not idle
            following = [s["start_s"] for s in steps if s["start_s"] >= queued]
            if following:
                delays.append(min(following) - queued)
    return round(statistics.median(delays), 4) if delays else None


def measure_dispatch(calls: list[dict], records: list) -> dict | None:
    """How long a request takes from the client's send to its ``add_request`` at the prefill
    engine: the router's intake (parsing, tokenizing, placement) and the message hops. Two
    prompts sent at once reach the engine this far apart, which decides whether they share a
    step.

    Args:
        calls: The engine-call log (its ``add_request`` lines name their request).
        records: The client's ``RequestRecord``s (``request_id`` and ``sent_unix_s``).

    Returns:
        ``{"median_s", "spread" (:func:`log_spread` of the delays), "requests"}``; None when no
        request can be matched.
    """
    queued = {}
    for call in calls:
        if call["call"] == "add_request" and call.get("request"):
            queued.setdefault(call["request"], call["queued_s"])
    delays = [
        queued[r.request_id] - r.sent_unix_s
        for r in records
        if r.request_id in queued and r.sent_unix_s is not None and queued[r.request_id] > r.sent_unix_s
    ]
    if not delays:
        return None
    return {"median_s": round(statistics.median(delays), 4), "spread": log_spread(delays), "requests": len(delays)}


def log_spread(ratios: list[float]) -> float:
    """The spread of ``log(ratio)`` (of any positive values: step ratios, delays), robust to the
    odd step that a page fault or a garbage collection stretches tenfold: the interquartile
    range over that of a unit normal."""
    if len(ratios) < MIN_STEPS:
        return 0.0
    quartiles = statistics.quantiles([math.log(r) for r in ratios], n=4)
    return round((quartiles[2] - quartiles[0]) / 1.349, 3)


def calibration_workload(*, quick: bool) -> list[tuple[int, dict]]:
    """The calibration's two phases, as ``(concurrency, trace shape)``: one session at a time
    (steps alone), then two at once (steps beside each other)."""
    if quick:
        return [
            (1, {"sessions": 1, "turns": 2, "cold_lines": 8, "max_tokens": 8}),
            (2, {"sessions": 2, "turns": 2, "cold_lines": 8, "max_tokens": 8}),
        ]
    # long enough answers that two sessions often decode at once (two-sequence steps)
    # four cold prompts alone: the prompt factor's steps are the fewest and spread the most
    return [
        (1, {"sessions": 4, "turns": 3, "cold_lines": 40, "max_tokens": 24}),
        (2, {"sessions": 4, "turns": 3, "cold_lines": 40, "max_tokens": 40}),
    ]


CALIBRATION_RUNS = 3
"""Fresh deployments the calibration replays its workload through. One run is a minute and a
half of a machine whose speed wanders: eight single runs within an hour put a one-sequence
decode step at 81–127 ms where the bench runs took 90. The median of three stands when one
lands in a slow minute; it cannot follow a machine that stays slower for longer
(``docs/planning.md``)."""


def calibrate(model: str, cost: LinearCostModel, *, quick: bool = False, runs: int | None = None) -> dict:
    """Replay the calibration workload ``runs`` times (default :data:`CALIBRATION_RUNS`, one when
    ``quick``), each through a fresh real PDD deployment (``pdd up``'s processes on this
    machine, the benchmark's link and pool) with the engine-call log on, and combine the runs'
    :func:`measure_step_speeds`, :func:`measure_wake_s` and :func:`measure_dispatch`
    (:func:`combine_runs`)."""
    phases = calibration_workload(quick=quick)
    each = [_calibration_run(model, cost, phases) for _ in range(runs or (1 if quick else CALIBRATION_RUNS))]
    shapes = ", ".join(f"{shape['sessions']} x {shape['turns']} turns at concurrency {c}" for c, shape in phases)
    return {
        **combine_runs(each),
        "runs": each,
        "source": f"traces of {shapes} (seeds from {CALIBRATION_SEED}) through {len(each)} fresh PDD "
        "deployment(s) on this machine: the engine-call log's steps against the fit, the median "
        "over the runs",
    }


def combine_runs(runs: list[dict]) -> dict:
    """Per figure, the median over calibration runs of what each measured (a run that measured
    nothing for it is left out); step counts and requests add up."""

    def median(values):
        values = [v for v in values if v is not None]
        return round(statistics.median(values), 4) if values else None

    kinds = {}
    for kind in KINDS:
        rows = [run["kinds"][kind] for run in runs]
        kinds[kind] = {
            "alone": median(r["alone"] for r in rows),
            "alone_steps": sum(r["alone_steps"] for r in rows),
            "beside": median(r["beside"] for r in rows),
            "beside_steps": sum(r["beside_steps"] for r in rows),
            "spread": median(r["spread"] for r in rows),
        }
    dispatches = [run["dispatch"] for run in runs if run.get("dispatch")]
    dispatch = (
        {
            "median_s": median(d["median_s"] for d in dispatches),
            "spread": median(d["spread"] for d in dispatches),
            "requests": sum(d["requests"] for d in dispatches),
        }
        if dispatches
        else None
    )
    return {
        "kinds": kinds,
        "wake_s": median(run["wake_s"] for run in runs),
        "dispatch": dispatch,
        "requests": sum(run["requests"] for run in runs),
    }


def _calibration_run(model: str, cost: LinearCostModel, phases: list[tuple[int, dict]]) -> dict:
    """One replay of the calibration phases through a fresh deployment, measured."""
    with tempfile.TemporaryDirectory(prefix="pdd-calibration-") as folder:
        log_path = Path(folder) / "engine-calls.jsonl"
        records = record_calibration(model, phases, log_path)
        return measure_run(read_call_log(log_path), records, cost)


def measure_run(calls: list[dict], records: list, cost: LinearCostModel) -> dict:
    """One calibration run's figures: step speeds, wake-up, dispatch and its request count."""
    return {
        "kinds": measure_step_speeds(calls, cost),
        "wake_s": measure_wake_s(calls),
        "dispatch": measure_dispatch(calls, records),
        "requests": len(records),
    }


def read_call_log(path: Path) -> list[dict]:
    """An engine-call log's lines."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def record_calibration(model: str, phases: list[tuple[int, dict]], log_path: Path) -> list:
    """Replay the calibration ``phases`` through a fresh PDD deployment of ``model`` (``pdd up``'s
    processes on this machine, the benchmark's link and pool) with the engine-call log written
    to ``log_path``; return the client's records (a failed request raises)."""
    from loadtest.bench_modes import BENCH_SPEC, deployed, mode_spec
    from loadtest.runner import run_trace
    from loadtest.trace import generate_trace

    spec = mode_spec("pdd", dataclasses.replace(BENCH_SPEC, model=model, seed=CALIBRATION_SEED))
    records = []
    previous = os.environ.get("PDD_ENGINE_CALL_LOG")
    os.environ["PDD_ENGINE_CALL_LOG"] = str(log_path)  # read once, at each service's start
    try:
        with deployed(spec) as deployment:
            for index, (concurrency, shape) in enumerate(phases):
                trace = generate_trace(CALIBRATION_SEED + index, **shape)
                done, _ = asyncio.run(run_trace(deployment.router_url, trace, concurrency=concurrency, progress=False))
                records += done
    finally:
        if previous is None:
            os.environ.pop("PDD_ENGINE_CALL_LOG", None)
        else:
            os.environ["PDD_ENGINE_CALL_LOG"] = previous
    failed = [r for r in records if r.error]
    if failed:
        raise RuntimeError(f"a calibration request failed: {failed[0].error}")
    return records


RUN_CALIBRATION_FOLDER = "calibration"
"""Where ``pdd bench run --calibrate`` keeps its calibration runs: one folder per repetition
holding ``engine-calls.jsonl`` and ``records.json``."""


def calibrate_during_bench(model: str, out: Path, repetition: int, *, quick: bool) -> Path:
    """One calibration run between a bench run's repetitions, its log and records kept under
    ``out``/:data:`RUN_CALIBRATION_FOLDER` for ``pdd sim validate`` to measure against its
    profile's fit."""
    folder = Path(out) / RUN_CALIBRATION_FOLDER / f"after-repetition-{repetition}"
    folder.mkdir(parents=True, exist_ok=True)
    log_path = folder / "engine-calls.jsonl"
    log_path.unlink(missing_ok=True)
    records = record_calibration(model, calibration_workload(quick=quick), log_path)
    (folder / "records.json").write_text(json.dumps([dataclasses.asdict(r) for r in records]))
    return folder


def run_calibration(out: Path, cost: LinearCostModel) -> dict | None:
    """A bench run's own calibration runs (``--calibrate``), measured against ``cost`` and
    combined (:func:`combine_runs`); None when it has none."""
    from loadtest.client import RequestRecord

    folders = sorted((Path(out) / RUN_CALIBRATION_FOLDER).glob("after-repetition-*"))
    runs = []
    for folder in folders:
        records = [RequestRecord(**r) for r in json.loads((folder / "records.json").read_text())]
        runs.append(measure_run(read_call_log(folder / "engine-calls.jsonl"), records, cost))
    return {**combine_runs(runs), "runs": runs} if runs else None
