"""``pdd bench control-plane`` end to end at a tiny size: a real deployment on the stand-in
engine delivers every token asked for, and the JSON has the figures the issue names (what they
measure is the benchmark's to print, not a test's to time)."""

import json

from tests.helpers import pdd


def test_the_control_plane_bench_delivers_every_token_and_reports_per_process_cpu():
    done = pdd(
        "bench", "control-plane", "--streams", "4", "--rate", "400", "--max-tokens", "8", "--rounds", "1", "--json"
    )
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout)
    assert report["cores"] >= 1 and list(report["routers"]) == ["1"]
    assert report["load"]["jitter"] == "0ms"  # the network's jitter is not the control plane's
    one = report["routers"]["1"]
    assert one["num_errors"] == 0 and one["tokens"] == one["expected_tokens"] == 4 * 8
    assert one["tok_s"] > 0 and one["p99_gap_ms"] >= one["p50_gap_ms"] > 0
    assert one["router_us_per_token"] == one["us_per_token"]["router-0"]
    assert {"router-0", "main-decode-0", "main-decode-1", "nats-a", "nats-b", "wan-link"} <= set(one["us_per_token"])


def test_a_router_count_below_one_is_refused_by_name():
    done = pdd("bench", "control-plane", "--routers", "2,0", "--json")
    assert done.returncode != 0 and "--routers 2,0" in done.stderr and done.stdout == ""


def test_a_bad_jitter_is_refused_by_name_before_anything_starts():
    done = pdd("bench", "control-plane", "--jitter", "soon", "--json")
    assert done.returncode != 0 and "--jitter" in done.stderr and "soon" in done.stderr and done.stdout == ""
