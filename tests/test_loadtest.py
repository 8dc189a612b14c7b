"""The agentic trace generator and the load client (``pdd bench run`` itself: test_bench_run.py)."""

import json

import pytest

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


def test_a_mooncake_trace_given_as_ours_is_refused_by_name(tmp_path):
    path = tmp_path / "mooncake.jsonl"
    path.write_text(json.dumps({"session_id": "0", "input_length": 10, "output_length": 4}) + "\n")
    with pytest.raises(ValueError, match="--format jsonl"):
        load_trace(path)
