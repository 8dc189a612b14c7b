"""Confidence for the benchmark's ratios: a median over repetitions and a 90 % bootstrap interval.

One quick run's P99 is the largest of 21 requests, so one run's PDD-vs-DRC ratio is one draw
(0.40 in one run, 0.61 in a rerun of the same command). ``pdd bench run --repeat N`` runs the
modes N times, interleaved, and each ratio here is reported as the median of its N
per-repetition values with a 90 % interval from a bootstrap. A target is judged on the
interval: MET when all of it is on the right side, MISSED when none is, UNDECIDED otherwise.

Every repetition of every mode replays the same trace, so repetitions and the trace's sessions
are crossed, not nested, and each bootstrap sample draws both once: repetitions with
replacement, and the trace's sessions with replacement, the same sessions for every drawn
repetition and every mode. A ratio then compares the modes on the same resampled workload, and
a sample without the trace's costliest session lacks it in every mode and repetition, as a
trace without it would. Sessions, not turns, are the units: a follow-up turn's TTFT depends on
its session's earlier turns (their KV, their answers). With a handful of sessions and three
repetitions the interval is itself rough (a bootstrap's spread is about (n-1)/n of the truth,
and a P99's bootstrap leans on the few requests at the top).

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


@dataclass(frozen=True)
class _Sessions:
    """The runs' records by trace session, grouped once for every bootstrap sample.

    Attributes:
        by_mode: Per mode, per repetition, each session's records.
        ids: Every session of the trace, in order.
    """

    by_mode: dict[str, list[dict[int, list[RequestRecord]]]]
    ids: list[int]

    @classmethod
    def of(cls, runs: Runs) -> "_Sessions":
        by_mode: dict[str, list[dict[int, list[RequestRecord]]]] = {}
        for mode, mode_runs in runs.items():
            by_mode[mode] = []
            for run in mode_runs:
                by_session: dict[int, list[RequestRecord]] = {}
                for record in run.records:
                    by_session.setdefault(record.session, []).append(record)
                by_mode[mode].append(by_session)
        ids = sorted({session for per_run in by_mode.values() for by_session in per_run for session in by_session})
        return cls(by_mode, ids)


def _resample(runs: Runs, sessions: _Sessions, rng: np.random.Generator) -> Runs:
    """One bootstrap sample: repetitions drawn with replacement, and the trace's sessions drawn
    with replacement once, for every drawn repetition and every mode (see the module)."""
    repetitions = min(len(v) for v in runs.values())
    picked = rng.integers(0, repetitions, repetitions)
    drawn = [sessions.ids[i] for i in rng.integers(0, len(sessions.ids), len(sessions.ids))]
    out: Runs = {}
    for mode, mode_runs in runs.items():
        out[mode] = [
            ModeRun(
                [record for session in drawn for record in sessions.by_mode[mode][index].get(session, [])],
                mode_runs[index].link_kv_bytes,
            )
            for index in picked
        ]
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
    used = {mode: runs[mode] for spec in specs for mode in spec.modes}
    sessions = _Sessions.of(used)
    for _ in range(samples):
        resampled = _resample(used, sessions, rng)
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
