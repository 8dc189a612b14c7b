"""Confidence for the benchmark's ratios: a median over repetitions and a 90 % bootstrap interval.

One quick run's P99 is the largest of 21 requests, so one run's PDD-vs-DRC ratio is one draw
(0.40 in one run, 0.61 in a rerun of the same command). ``pdd bench run --repeat N`` runs the
modes N times, interleaved, and each ratio here is reported as the median of its N
per-repetition values with a 90 % interval from a two-stage bootstrap: repetitions are drawn
with replacement, then requests within each drawn repetition. A target is judged on the
interval: MET when all of it is on the right side, MISSED when none is, UNDECIDED otherwise.

Every mode replays the same trace, so the draws are paired: one draw of repetitions for all
modes, and within a repetition one draw of trace turns (session, turn), each taking that
turn's request from every mode. A ratio then compares the modes on the same resampled
workload; unpaired draws would compare one mode with the costliest prompt against another
without it (the interval of PDD/same-site P99 over three quick runs: [0.74, 1.54] unpaired,
[0.94, 1.12] paired).

Link byte counts exist per run, not per request, so their ratio is resampled over repetitions
only: with ``--repeat 3`` its interval spans the repetitions' values.
"""

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from loadtest.client import RequestRecord

BOOTSTRAP_SAMPLES = 2000
INTERVAL = (5.0, 95.0)


@dataclass(frozen=True)
class ModeRun:
    """One deployment's replay of the trace.

    Attributes:
        records: Every request as the client saw it.
        link_kv_bytes: KV bytes the WAN link carried during the run (None: not counted).
    """

    records: list[RequestRecord]
    link_kv_bytes: int | None


Runs = dict[str, list[ModeRun]]
"""Per mode, its runs (one per repetition), in repetition order."""


@dataclass(frozen=True)
class RatioSpec:
    """A figure the report judges.

    Attributes:
        name: Key in ``results.json``'s ``intervals``.
        label: What the report calls it.
        modes: Modes it needs (skipped when one is missing).
        statistic: Computes it from runs (pooled over whatever runs it is given).
        target: Upper bound it must stay under (None: measured, not judged).
    """

    name: str
    label: str
    modes: tuple[str, ...]
    statistic: Callable[[Runs], float | None]
    target: float | None


def _ttft(runs: list[ModeRun]) -> np.ndarray:
    return np.asarray([r.ttft_ms for run in runs for r in run.records if r.error is None and r.ttft_ms is not None])


def _ttft_ratio(mode: str, base: str, q: float) -> Callable[[Runs], float | None]:
    def statistic(runs: Runs) -> float | None:
        top, bottom = _ttft(runs[mode]), _ttft(runs[base])
        if not len(top) or not len(bottom):
            return None
        return float(np.percentile(top, q) / np.percentile(bottom, q))

    return statistic


def _link_bytes_ratio(runs: Runs) -> float | None:
    drc = [run.link_kv_bytes for run in runs["cross-site-pd-drc"]]
    full = [run.link_kv_bytes for run in runs["cross-site-pd"]]
    if None in drc or None in full or not sum(full):
        return None
    return sum(drc) / sum(full)


def _rld_share(runs: Runs) -> float | None:
    ok = [r for run in runs["pdd"] for r in run.records if r.error is None]
    output = sum(r.output_tokens for r in ok)
    return sum(r.pdd.get("eager_tokens", 0) for r in ok) / output if output else None


RATIOS = [
    RatioSpec(
        "pdd_vs_drc_ttft_p99",
        "PDD P99 TTFT / cross-site PD with DRC",
        ("pdd", "cross-site-pd-drc"),
        _ttft_ratio("pdd", "cross-site-pd-drc", 99),
        0.5,
    ),
    RatioSpec(
        "pdd_vs_same_site_ttft_p99",
        "PDD P99 TTFT / same-site",
        ("pdd", "same-site"),
        _ttft_ratio("pdd", "same-site", 99),
        1.2,  # issue 29's bound (an earlier acceptance allowed 1.5)
    ),
    RatioSpec(
        "drc_vs_full_wan_bytes",
        "DRC WAN bytes / full transfer (counted on the link)",
        ("cross-site-pd-drc", "cross-site-pd"),
        _link_bytes_ratio,
        0.3,
    ),
    RatioSpec("rld_token_share", "RLD token share", ("pdd",), _rld_share, 0.2),
    RatioSpec(
        "pdd_vs_drc_ttft_p50",
        "PDD P50 TTFT / cross-site PD with DRC",
        ("pdd", "cross-site-pd-drc"),
        _ttft_ratio("pdd", "cross-site-pd-drc", 50),
        None,
    ),
    RatioSpec(
        "pdd_vs_drc_ttft_p90",
        "PDD P90 TTFT / cross-site PD with DRC",
        ("pdd", "cross-site-pd-drc"),
        _ttft_ratio("pdd", "cross-site-pd-drc", 90),
        None,
    ),
]


def _resample(runs: Runs, rng: np.random.Generator) -> Runs:
    """Repetitions drawn with replacement, then trace turns within each; every mode gets the
    same draw (a repetition's modes ran side by side on the same trace)."""
    repetitions = min(len(v) for v in runs.values())
    picked = rng.integers(0, repetitions, repetitions)
    out: Runs = {mode: [] for mode in runs}
    for index in picked:
        by_turn = {mode: _by_turn(mode_runs[index].records) for mode, mode_runs in runs.items()}
        turns = sorted(set().union(*by_turn.values()))
        draw = [turns[i] for i in rng.integers(0, len(turns), len(turns))] if turns else []
        for mode, mode_runs in runs.items():
            drawn = [record for turn in draw for record in by_turn[mode].get(turn, [])]
            out[mode].append(ModeRun(drawn, mode_runs[index].link_kv_bytes))
    return out


def _by_turn(records: list[RequestRecord]) -> dict[tuple[int, int], list[RequestRecord]]:
    """A repetition's records keyed by their trace turn (session, turn)."""
    out: dict[tuple[int, int], list[RequestRecord]] = {}
    for record in records:
        out.setdefault((record.session, record.turn), []).append(record)
    return out


def verdict(low: float, high: float, target: float | None) -> str:
    """MET, MISSED or UNDECIDED for an upper-bound target; MEASURED without one."""
    if target is None:
        return "MEASURED"
    return "MET" if high <= target else "MISSED" if low > target else "UNDECIDED"


def ratio_intervals(runs: Runs, seed: int = 0, samples: int = BOOTSTRAP_SAMPLES) -> dict:
    """Each applicable ratio: median over repetitions, 90 % interval, per-repetition values, verdict."""
    rng = np.random.default_rng(seed)
    specs = [spec for spec in RATIOS if all(runs.get(mode) for mode in spec.modes)]
    if not specs:  # e.g. --modes same-site: no ratio has both its modes
        return {}
    draws: dict[str, list[float]] = {spec.name: [] for spec in specs}
    for _ in range(samples):
        resampled = _resample({mode: runs[mode] for spec in specs for mode in spec.modes}, rng)
        for spec in specs:
            value = spec.statistic(resampled)
            if value is not None:
                draws[spec.name].append(value)
    out = {}
    for spec in specs:
        repetitions = min(len(runs[mode]) for mode in spec.modes)
        per_repetition = [spec.statistic({mode: [runs[mode][i]] for mode in spec.modes}) for i in range(repetitions)]
        values = [v for v in per_repetition if v is not None]
        if not values or not draws[spec.name]:
            continue
        low, high = (float(np.percentile(draws[spec.name], q)) for q in INTERVAL)
        out[spec.name] = {
            "label": spec.label,
            "median": round(float(np.median(values)), 3),
            "low": round(low, 3),
            "high": round(high, 3),
            "per_repetition": [round(v, 3) for v in values],
            "target": spec.target,
            "verdict": verdict(low, high, spec.target),
        }
    return out
