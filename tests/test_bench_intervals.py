"""The benchmark's ratios over repetitions: medians, bootstrap intervals, verdicts, mode order."""

import random

import numpy as np
import pytest

from loadtest.bench import interleaved
from loadtest.bench_intervals import ModeRun, ratio_intervals, verdict
from loadtest.client import RequestRecord


def records(ttfts, eager=0, output=24):
    """One record per trace turn, three turns per session."""
    return [
        RequestRecord(i // 3, i % 3, "warm", ttft_ms=t, output_tokens=output, pdd={"eager_tokens": eager})
        for i, t in enumerate(ttfts)
    ]


def runs(scale_pdd: float, repetitions: int = 3, seed: int = 0, noise: float = 0.15):
    """Every mode replays the same 21 turns in every repetition; each request's TTFT is its
    turn's cost times the mode's scale times its own noise (lognormal, sigma ``noise``)."""
    rng = random.Random(seed)
    base = [rng.lognormvariate(7, 0.6) for _ in range(21)]

    def mode(base, scale):
        return [t * scale * rng.lognormvariate(0, noise) for t in base]

    out = {"pdd": [], "cross-site-pd-drc": [], "cross-site-pd": [], "same-site": []}
    for _ in range(repetitions):
        out["cross-site-pd-drc"].append(ModeRun(records(mode(base, 1)), 270_000_000))
        out["cross-site-pd"].append(ModeRun(records(mode(base, 3)), 940_000_000))
        out["same-site"].append(ModeRun(records(mode(base, 0.5)), 0))
        out["pdd"].append(ModeRun(records(mode(base, scale_pdd), eager=3), 260_000_000))
    return out


def test_each_ratio_is_the_median_of_its_repetitions_with_an_interval_around_it():
    measured = runs(0.4)
    intervals = ratio_intervals(measured, samples=400)
    p99 = intervals["pdd_vs_drc_ttft_p99"]
    direct = [
        np.percentile([r.ttft_ms for r in p.records], 99) / np.percentile([r.ttft_ms for r in d.records], 99)
        for p, d in zip(measured["pdd"], measured["cross-site-pd-drc"])
    ]
    assert p99["per_repetition"] == pytest.approx(direct, abs=1e-3)
    assert p99["median"] == pytest.approx(float(np.median(direct)), abs=1e-3)
    assert p99["low"] <= p99["median"] <= p99["high"]
    assert intervals["drc_vs_full_wan_bytes"]["median"] == pytest.approx(270 / 940, abs=1e-3)
    assert intervals["rld_token_share"]["median"] == pytest.approx(3 / 24, abs=1e-3)


def test_a_target_is_judged_on_the_whole_interval():
    assert verdict(0.3, 0.45, 0.5) == "MET"
    assert verdict(0.55, 0.7, 0.5) == "MISSED"
    assert verdict(0.4, 0.6, 0.5) == "UNDECIDED"
    assert verdict(0.4, 0.6, None) == "MEASURED"
    # PDD's requests half as long as DRC's on average, each with its own noise: the interval straddles 0.5
    assert ratio_intervals(runs(0.5), samples=400)["pdd_vs_drc_ttft_p99"]["verdict"] == "UNDECIDED"
    assert ratio_intervals(runs(1.0), samples=400)["pdd_vs_drc_ttft_p99"]["verdict"] == "MISSED"
    assert ratio_intervals(runs(0.2), samples=400)["pdd_vs_drc_ttft_p99"]["verdict"] == "MET"


def test_a_costly_turn_in_every_mode_does_not_widen_the_interval():
    """The P99 of 21 requests is the costliest turn's. Each mode has that turn's request, and
    the draws keep the modes paired, so no draw compares one mode with it against another
    without it."""
    rng = random.Random(0)

    def width(turn_costs):
        measured = {"pdd": [], "same-site": []}
        for _ in range(3):
            for mode, scale in (("pdd", 1.05), ("same-site", 1.0)):
                ttfts = [cost * scale * rng.lognormvariate(0, 0.05) for cost in turn_costs]
                measured[mode].append(ModeRun(records(ttfts), 0))
        figure = ratio_intervals(measured, samples=400)["pdd_vs_same_site_ttft_p99"]
        return figure["high"] - figure["low"]

    even = [rng.lognormvariate(7, 0.1) for _ in range(21)]
    one_costly = [cost * (8 if turn == 7 else 1) for turn, cost in enumerate(even)]
    assert width(one_costly) < 1.5 * width(even)


def test_a_trace_without_its_costliest_session_lies_within_the_interval():
    """PDD is 1.05x same-site on the costliest turn and 1.4x on every other: the P99 ratio of
    this trace is about 1.05, and a trace of the same kind without that turn would give 1.4.
    Its session is missing from every mode and repetition of about a third of the samples, so
    the interval reaches 1.4. (Drawn afresh in each of five repetitions, a turn is missing
    from all of them in 0.6 % of the samples: the interval would end at 1.05.)"""
    rng = random.Random(1)
    costs = [rng.lognormvariate(7, 0.1) for _ in range(21)]
    costs[7] *= 8
    measured = {"pdd": [], "same-site": []}
    for _ in range(5):
        same_site = [cost * rng.lognormvariate(0, 0.02) for cost in costs]
        pdd = [t * (1.05 if turn == 7 else 1.4) for turn, t in enumerate(same_site)]
        measured["same-site"].append(ModeRun(records(same_site), 0))
        measured["pdd"].append(ModeRun(records(pdd), 0))
    figure = ratio_intervals(measured, samples=400)["pdd_vs_same_site_ttft_p99"]
    assert figure["median"] == pytest.approx(1.05, abs=0.05)
    assert figure["high"] > 1.3


def test_more_repetitions_narrow_the_interval():
    """On the P50 ratio: a P99 ratio's interval comes from the few requests at the top, whose
    share of the noise more repetitions of the same trace shrink little."""
    few = ratio_intervals(runs(0.5, repetitions=1), samples=400)["pdd_vs_drc_ttft_p50"]
    many = ratio_intervals(runs(0.5, repetitions=8), samples=400)["pdd_vs_drc_ttft_p50"]
    assert len(many["per_repetition"]) == 8
    assert many["high"] - many["low"] < few["high"] - few["low"]


def test_repetitions_rotate_the_mode_order():
    modes = ["a", "b", "c", "d"]
    orders = [interleaved(modes, r) for r in range(4)]
    assert orders[0] == modes and orders[1] == ["b", "c", "d", "a"]
    assert {order[0] for order in orders} == set(modes)


def test_a_run_of_some_modes_reports_only_the_ratios_it_has_both_modes_of():
    measured = runs(0.4)
    assert ratio_intervals({"same-site": measured["same-site"]}, samples=50) == {}
    only = ratio_intervals({"pdd": measured["pdd"], "same-site": measured["same-site"]}, samples=50)
    assert set(only) == {"pdd_vs_same_site_ttft_p99", "rld_token_share"}
