"""The agentic trace generator, the load client, and `pdd bench run` on the tiny model."""

import json
import subprocess
import sys
from pathlib import Path

from loadtest.client import RequestRecord, stream_chat
from loadtest.runner import run_trace
from loadtest.trace import estimated_hit_rates, generate_trace, load_trace, save_trace
from tests.helpers import SLOW_WAN


def test_trace_is_seeded_and_shaped_like_agent_traffic(tmp_path):
    trace = generate_trace(7, sessions=20, turns=5, odd_share=0.04)
    assert trace == generate_trace(7, sessions=20, turns=5, odd_share=0.04)
    assert trace != generate_trace(8, sessions=20, turns=5, odd_share=0.04)
    kinds = [t.kind for t in trace]
    assert kinds.count("cold") == 20 and kinds.count("warm") == 80
    assert 0.02 <= kinds.count("odd") / len(trace) <= 0.06
    assert all(t.max_tokens <= 4 for t in trace if t.kind == "odd")
    cold = [len(t.content) for t in trace if t.kind == "cold"]
    warm = [len(t.content) for t in trace if t.kind == "warm"]
    assert max(warm) < 0.25 * min(cold)  # follow-ups add little to a long context
    path = tmp_path / "trace.jsonl"
    save_trace(trace, path)
    assert load_trace(path) == trace


def test_prefix_hits_are_skewed_like_the_papers_traffic():
    trace = generate_trace(11, sessions=30, turns=10)
    rates = estimated_hit_rates(trace)
    above_95 = sum(r > 0.95 for r in rates) / len(rates)
    cold_or_low = sum(r < 0.5 for r in rates) / len(rates)
    assert 0.65 <= above_95 <= 0.85, above_95  # most requests re-send almost everything
    assert 0.05 <= cold_or_low <= 0.2, cold_or_low  # a minority is cold (first turns, odd)


def test_open_loop_sessions_start_at_poisson_times():
    trace = generate_trace(1, sessions=50, turns=1, odd_share=0, session_rate_per_s=2.0)
    starts = [t.start_s for t in trace]
    assert starts == sorted(starts) and 15 < starts[-1] < 40  # ~25 s for 50 at 2/s


async def test_runner_keeps_history_so_follow_ups_hit_the_cache(make_stack):
    stack = await make_stack(profile=SLOW_WAN, router_settings={"pipeline_policy": "P-MD"})
    trace = generate_trace(3, sessions=2, turns=3, cold_lines=20, odd_share=0)
    records, wall_s = await run_trace(stack.base_url, trace, concurrency=2, progress=False)
    assert len(records) == 6 and all(r.error is None for r in records) and wall_s > 0
    follow_ups = [r for r in records if r.turn > 0]
    misses = [(r.turn, r.prompt_tokens, r.error, r.pdd) for r in follow_ups if not r.pdd.get("cached_blocks_md")]
    assert not misses, misses
    # One gap per content chunk after the first; a chunk carries one or more tokens' text.
    assert all(r.ttft_ms > 0 and 1 <= len(r.itl_ms) + 1 <= r.output_tokens for r in records)


async def test_client_records_errors_instead_of_raising(make_stack):
    import aiohttp

    stack = await make_stack()
    async with aiohttp.ClientSession() as http:
        record = await stream_chat(
            http, stack.base_url, "no-such-model", [{"role": "user", "content": "hi"}], 4, RequestRecord(0, 0, "cold")
        )
    assert record.error.startswith("HTTP 404")


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
        } <= set(figures)
    cross = results["modes"]["cross-site-pd"]
    assert cross["pipelines"] == {"P-MD": 4}
    # What the responses report is what the WAN link carried, plus flow control messages.
    assert cross["wan_kv_bytes"] <= cross["wan_link_kv_bytes"] <= 1.05 * cross["wan_kv_bytes"]
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
