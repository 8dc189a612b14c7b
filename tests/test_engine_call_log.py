"""The engine-call log: every engine-thread call, when it was queued, ran and ended, and a
step's batch, as a service writes it with ``engine_call_log`` set."""

import asyncio
import itertools
import json

from loadtest.engine_calls import summarise_calls
from shared.engine.hf_engine import HfEngine
from shared.engine.sampling import SamplingParams
from shared.engine_loop import step_if_work
from shared.engine_worker import EngineWorker
from tests.helpers import prompt_of_length


async def test_each_call_is_recorded_in_order_with_its_batch(tiny, tmp_path):
    engine = HfEngine(tiny, num_blocks=64)
    path = tmp_path / "calls.jsonl"
    worker = EngineWorker(engine, "prefill-0", call_log=str(path))
    prompt = prompt_of_length(tiny, 40)
    await worker.call(engine.add_request, "r", prompt, SamplingParams(max_tokens=2, ignore_eos=True))
    while await worker.call(engine.has_work):
        await worker.call(engine.step)
    await worker.call(engine.step)  # nothing left to run: no batch, not the last one again
    worker.shutdown()
    calls = [json.loads(line) for line in path.read_text().splitlines()]
    assert [c["call"] for c in calls] == ["add_request", "step", "step", "step"]  # has_work is not recorded
    assert calls[1]["batch"] == [[40, 0]] and calls[2]["batch"] == [[1, 40]] and calls[3]["batch"] == []
    assert {c["instance"] for c in calls} == {"prefill-0"}
    assert calls[0]["request"] == "r" and all("request" not in c for c in calls[1:])  # a step is everyone's
    assert all(c["queued_s"] <= c["start_s"] <= c["end_s"] for c in calls)
    assert all(a["end_s"] <= b["start_s"] for a, b in itertools.pairwise(calls))  # one thread, in order


async def test_the_engine_loops_step_is_recorded_as_a_step_and_an_idle_one_not_at_all(tiny, tmp_path):
    engine = HfEngine(tiny, num_blocks=64)
    path = tmp_path / "calls.jsonl"
    worker = EngineWorker(engine, "main-decode-0", call_log=str(path))
    await worker.call(
        engine.add_request, "r", prompt_of_length(tiny, 20), SamplingParams(max_tokens=2, ignore_eos=True)
    )
    steps = 0
    while (outputs := await worker.call(step_if_work, engine)) is not None:
        steps += 1
        assert outputs
    assert await worker.call(step_if_work, engine) is None  # idle again: not recorded either
    worker.shutdown()
    calls = [json.loads(line) for line in path.read_text().splitlines()]
    assert [c["call"] for c in calls] == ["add_request"] + ["step"] * steps
    assert steps == 2 and calls[1]["batch"] == [[20, 0]]


async def test_the_summary_counts_a_prompt_queued_behind_a_step_per_role(tiny, tmp_path):
    engine = HfEngine(tiny, num_blocks=64)
    path = tmp_path / "calls.jsonl"
    worker = EngineWorker(engine, "prefill-3", call_log=str(path))
    sampling = SamplingParams(max_tokens=2, ignore_eos=True)
    await worker.call(engine.add_request, "a", prompt_of_length(tiny, 40), sampling)
    # "b" is queued while the step computing "a"'s prompt runs: it waits for that step.
    await asyncio.gather(worker.call(engine.step), worker.call(engine.add_request, "b", [5, 6, 7], sampling))
    while await worker.call(engine.has_work):
        await worker.call(engine.step)
    worker.shutdown()
    summary = summarise_calls(path.read_text().splitlines())
    assert list(summary) == ["prefill"]
    prefill = summary["prefill"]
    assert prefill["add_requests"] == 2 and prefill["add_request_wait_ms"]["p99"] > 0
    assert prefill["prompt_step_ms"]["p50"] is not None and prefill["decode_step_ms"]["p50"] is not None
    assert prefill["steps"] == len([line for line in path.read_text().splitlines() if '"batch": [[' in line])
