"""``pdd bench run`` on the tiny model, end to end: results, report, plots, and the simulator
replaying the run from this machine's profile."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from infra.wan_link import parse_rate
from loadtest.trace import load_trace


@pytest.mark.timeout(900)  # three deployments, a profile and a replay: minutes on a loaded machine
def test_bench_run_writes_results_report_and_plots_and_the_simulator_replays_it(tmp_path):
    pdd = str(Path(sys.executable).parent / "pdd")
    result = subprocess.run(
        [
            pdd,
            "bench",
            "run",
            "--out",
            str(tmp_path),
            "--model",
            "tiny",
            "--sessions",
            "2",
            "--turns",
            "2",
            "--cold-lines",
            "12",
            "--max-tokens",
            "24",
            "--handoff-trials",
            "2",
            "--modes",
            "cross-site-pd",
            "pdd",
            "--calibrate",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    results = json.loads((tmp_path / "results.json").read_text())
    for mode in ("cross-site-pd", "pdd"):
        figures = results["modes"][mode]
        assert figures["requests"] == 4 and figures["errors"] == 0
        assert set(figures["ttft_ms"]) == {"p50", "p90", "p99", "mean"}
        assert {
            "itl_ms",
            "e2e_ms",
            "goodput_rps",
            "wan_kv_bytes",
            "rld_token_share",
            "pipelines",
            "handoff_modes",
            "kv_after_prefill_ms",
            "kv_excess_ms",
        } <= set(figures)
    cross = results["modes"]["cross-site-pd"]
    assert cross["pipelines"] == {"P-MD": 4}
    # every request shipped its KV across the WAN; each landed after its prefill ended
    assert cross["kv_after_prefill_ms"]["requests"] == 4 and cross["kv_after_prefill_ms"]["p50"] > 0
    assert "## KV landed at main decode" in (tmp_path / "report.md").read_text()
    # What the responses report is what the WAN link carried, plus flow control messages.
    assert cross["wan_kv_bytes"] <= cross["wan_link_kv_bytes"] <= 1.05 * cross["wan_kv_bytes"]
    # The link's load: what it carried over what it could carry in the replays' wall time.
    link_bps = parse_rate(results["config"]["bandwidth"])
    for mode in ("cross-site-pd", "pdd"):
        reps = [rep[mode] for rep in results["repetitions"]]
        carried_s = sum(rep["wan_link_kv_bytes"] for rep in reps) * 8 / link_bps
        assert results["modes"][mode]["wan_link_load"] == pytest.approx(
            carried_s / sum(rep["wall_s"] for rep in reps), abs=1e-3
        )
    micro = results["handoff_microbench"]
    assert micro["token_ids"]["payload_bytes"] < micro["incremental_kv"]["payload_bytes"]
    report = (tmp_path / "report.md").read_text()
    assert "| cross-site-pd |" in report and "## Checks" in report
    for plot in ("ttft_cdf.png", "wan_bytes.png", "relay_timeline.png"):
        assert (tmp_path / plot).read_bytes()[:4] == b"\x89PNG"
    assert results["intervals"]["rld_token_share"]["per_repetition"] == [results["modes"]["pdd"]["rld_token_share"]]
    assert "## Ratios" in report
    _check_the_simulator_replays(pdd, tmp_path, results)


def _check_the_simulator_replays(pdd: str, run: Path, results: dict):
    """``pdd profile`` on this machine (its micro-benchmarks; the run's own calibration stands
    for a deployment's), then ``pdd sim validate`` of the run just measured."""
    from loadtest.runner import SYSTEM
    from loadtest.sim.cost_model import FEATURES
    from loadtest.sim.workload import from_trace
    from shared.model_loader import load_metadata

    profile = run / "profile.json"
    measured = subprocess.run(
        [pdd, "profile", "--model", "tiny", "--quick", "--no-deployment", "--out", str(profile)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert measured.returncode == 0, measured.stderr[-2000:]
    fit = json.loads(profile.read_text())
    assert fit["shared_host_speed"]["2"] > 0
    assert fit["local_path"]["bytes_per_s"] > 0
    assert fit["deployment_steps"] is None
    assert fit["cost_model"]["features"] == list(FEATURES)
    assert len(fit["cost_model"]["coefficients"]) == len(FEATURES)
    replay = subprocess.run(
        [pdd, "sim", "validate", str(run), "--profile", str(profile), "--json"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert replay.returncode == 0, replay.stderr[-2000:]
    report = json.loads(replay.stdout)
    modes = report["modes"]
    # the run's own calibration (--calibrate) times the steps, measured against the profile's fit
    assert report["step_speeds"] == "the run's own calibration (1 run(s))"
    # it ran its requests through a real deployment and timed each one's way from the client's
    # send to the prefill engine
    assert (
        report["dispatch"]["requests"]
        == len(json.loads((run / "calibration" / "after-repetition-0" / "records.json").read_text()))
        >= 6
    )
    assert 0 < report["dispatch"]["median_s"] < 1
    assert set(modes) == {"cross-site-pd", "pdd"}
    metrics = {"ttft_p50_ms", "ttft_p90_ms", "ttft_p99_ms", "wan_kv_bytes", "rld_token_share", "goodput_rps"}
    for figures in modes.values():
        assert metrics <= set(figures)
        assert all({"predicted", "measured", "rel_error"} <= set(figures[m]) for m in metrics)
    # the simulated deployment ships what the real one shipped: the whole prompt, every turn
    cross = modes["cross-site-pd"]["wan_kv_bytes"]
    assert cross["measured"] == results["modes"]["cross-site-pd"]["wan_link_kv_bytes"]
    assert abs(cross["rel_error"]) < 0.05
    # the trace, tokenized as the client sends it: first turns have exactly the router's prompt count
    records = json.loads((run / "records.json").read_text())["pdd"]
    workload = from_trace(
        load_trace(run / "trace.jsonl"), load_metadata("tiny").tokenizer, 16, concurrency=2, system_prompt=SYSTEM
    )
    first_turns = {r.session: r.prompt_tokens for r in workload.requests if r.turn == 0}
    assert first_turns == {r["session"]: r["prompt_tokens"] for r in records if r["turn"] == 0}


@pytest.mark.timeout(300)
def test_the_same_site_baseline_reports_no_kv_over_the_wan(tmp_path):
    """Main decode beside the prefill: its KV crosses no WAN, and the responses, the link's
    counters and the KV timing all say so."""
    pdd = str(Path(sys.executable).parent / "pdd")
    args = ["--model", "tiny", "--sessions", "1", "--turns", "2", "--cold-lines", "12", "--max-tokens", "24"]
    args += ["--handoff-trials", "1"]
    result = subprocess.run(
        [pdd, "bench", "run", "--out", str(tmp_path), *args, "--modes", "same-site"],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    results = json.loads((tmp_path / "results.json").read_text())
    # what was replayed, as the report's config line shows it
    assert results["config"]["trace_shape"] == {"requests": 2, "sessions": 1, "max_tokens": [24]}
    figures = results["modes"]["same-site"]
    assert figures["requests"] == 2 and figures["errors"] == 0
    assert figures["wan_kv_bytes"] == 0 and figures["wan_link_kv_bytes"] == 0
    assert figures["kv_after_prefill_ms"]["requests"] == 0
