"""In-deployment step speeds read from an engine-call log: kinds, alone and beside, the spread."""

import json
import math

import pytest

from loadtest.client import RequestRecord
from loadtest.sim.cost_model import LinearCostModel
from loadtest.sim.step_speeds import (
    KINDS,
    MIN_STEPS,
    combine_runs,
    log_spread,
    measure_dispatch,
    measure_step_speeds,
    measure_wake_s,
    predicted_s,
    run_calibration,
    step_kind,
)
from loadtest.sim.validate import ValidateInputError, run_step_speeds, validate

COST = LinearCostModel((0.08, 0.0016, 1e-6, 0.004, 5e-6, 0.0), 1e9, 5e9, 46080)


def step(instance: str, start_s: float, batch: list[list[int]], ratio: float) -> dict:
    """A call-log line of a step that took ``ratio`` times the fit's prediction."""
    seconds = ratio * predicted_s(batch, COST)
    return {
        "instance": instance,
        "call": "step",
        "queued_s": start_s,
        "start_s": start_s,
        "end_s": start_s + seconds,
        "batch": batch,
    }


def test_kinds_come_from_the_batch():
    assert step_kind([[40, 848], [1, 900]]) == "prompt"
    assert step_kind([[1, 900]]) == "decode_one"
    assert step_kind([[1, 900], [1, 700]]) == "decode_many"


def test_steps_alone_and_beside_another_engines_are_told_apart_and_the_warm_up_left_out():
    calls = [step("prefill-0", 0.0, [[800, 0]], 9.0)]  # the first step of an engine: a warm-up
    clock = 100.0
    for i in range(MIN_STEPS):  # prompts alone
        calls.append(step("prefill-0", clock, [[40 + i, 848]], 1.5))
        clock += 10
    calls.append(step("main-decode-0", clock - 5, [[1, 500]], 1.0))  # its own warm-up
    for i in range(MIN_STEPS):  # a prompt while main decode runs one long two-sequence step
        prompt = step("prefill-0", clock, [[200, 848]], 2.0)
        calls.append(prompt)
        calls.append(
            step(
                "main-decode-0",
                clock - 0.01,
                [[1, 900], [1, 950]],
                (prompt["end_s"] - clock + 0.02) / predicted_s([[1, 900], [1, 950]], COST),
            )
        )
        clock += 10
    calls.append({"instance": "prefill-0", "call": "export_frames", "queued_s": 0, "start_s": 0, "end_s": 1})
    speeds = measure_step_speeds(calls, COST)
    assert speeds["prompt"]["alone"] == pytest.approx(1.5, abs=1e-3)
    assert speeds["prompt"]["beside"] == pytest.approx(2.0, abs=1e-3)
    assert speeds["prompt"]["alone_steps"] == MIN_STEPS and speeds["prompt"]["beside_steps"] == MIN_STEPS
    assert speeds["decode_many"]["beside_steps"] == MIN_STEPS and speeds["decode_many"]["alone"] is None
    assert speeds["decode_one"] == {"alone": None, "alone_steps": 0, "beside": None, "beside_steps": 0, "spread": 0.0}
    assert speeds["prompt"]["spread"] == pytest.approx(0.0, abs=1e-3)


def test_the_spread_is_the_log_ratios_and_an_outlier_does_not_make_it():
    ratios = [math.exp(x) for x in (-0.2, -0.1, 0.0, 0.1, 0.2)] * 4
    assert 0.1 < log_spread(ratios) < 0.2
    # one step stretched 30-fold (a standard deviation would be 0.75 with it)
    assert log_spread(ratios + [30.0]) < 0.25
    assert log_spread(ratios[: MIN_STEPS - 1]) == 0.0


def test_the_wake_up_is_measured_from_prompts_that_found_the_prefill_idle():
    def call(name, queued_s, start_s, end_s):
        return {"instance": "prefill-0", "call": name, "queued_s": queued_s, "start_s": start_s, "end_s": end_s}

    calls = [
        call("add_request", 0.0, 0.0, 0.0),
        call("step", 0.001, 0.003, 1.0),  # idle: 3 ms
        call("add_request", 0.5, 1.0, 1.0),
        call("step", 1.0, 1.0, 2.0),  # arrived mid-step
        call("add_request", 5.0, 5.0, 5.0),
        call("step", 5.004, 5.005, 6.0),
    ]  # idle: 5 ms
    assert measure_wake_s(calls) == pytest.approx(0.004)
    assert measure_wake_s([c for c in calls if c["call"] == "step"]) is None


def test_the_dispatch_is_timed_from_the_clients_send_to_the_prefills_add_request():
    delays = [0.010, 0.012, 0.015, 0.020, 0.030, 0.014]
    records, calls = [], []
    for i, delay in enumerate(delays):
        records.append(RequestRecord(i, 0, "cold", request_id=f"r{i}", sent_unix_s=100.0 + i))
        calls.append(
            {
                "instance": "prefill-0",
                "call": "add_request",
                "request": f"r{i}",
                "queued_s": 100.0 + i + delay,
                "start_s": 100.0 + i + delay,
                "end_s": 100.0 + i + delay,
            }
        )
    calls.append(
        {"instance": "prefill-0", "call": "free", "request": "r0", "queued_s": 99.0, "start_s": 99, "end_s": 99}
    )
    records.append(RequestRecord(9, 0, "cold", request_id="lost", sent_unix_s=50.0))  # never reached the engine
    dispatch = measure_dispatch(calls, records)
    assert dispatch["requests"] == len(delays)
    assert dispatch["median_s"] == pytest.approx(sorted(delays)[2] / 2 + sorted(delays)[3] / 2, abs=1e-4)
    assert dispatch["spread"] == log_spread(delays) > 0
    assert measure_dispatch([c for c in calls if c["call"] != "add_request"], records) is None


def test_runs_combine_by_their_median_so_one_slow_run_does_not_set_the_factors():
    def run(scale: float, beside: float | None, dispatch: dict | None) -> dict:
        kinds = {
            kind: {
                "alone": 1.2 * scale,
                "alone_steps": 10,
                "beside": beside,
                "beside_steps": 6 if beside else 0,
                "spread": 0.1 * scale,
            }
            for kind in KINDS
        }
        return {"kinds": kinds, "wake_s": 0.003 * scale, "dispatch": dispatch, "requests": 24}

    runs = [
        run(1.0, 1.6, {"median_s": 0.008, "spread": 0.2, "requests": 24}),
        run(1.45, None, None),
        run(1.05, 1.7, {"median_s": 0.009, "spread": 0.3, "requests": 24}),
    ]
    combined = combine_runs(runs)
    prompt = combined["kinds"]["prompt"]
    assert prompt["alone"] == pytest.approx(1.2 * 1.05)  # the slow run (1.45) is outvoted
    assert prompt["beside"] == pytest.approx(1.65)  # the run that measured none is left out
    assert prompt["alone_steps"] == 30 and prompt["beside_steps"] == 12
    assert combined["wake_s"] == pytest.approx(0.003 * 1.05, abs=1e-4)
    assert combined["dispatch"] == {"median_s": pytest.approx(0.0085), "spread": pytest.approx(0.25), "requests": 48}
    assert combined["requests"] == 72
    assert combine_runs([run(1.0, None, None)])["dispatch"] is None


def test_a_runs_own_call_log_gives_its_step_speeds_and_a_run_without_one_a_clear_error(tmp_path):
    calls = [step("prefill-0", 0.0, [[800, 0]], 9.0)] + [
        step("prefill-0", 10.0 * i, [[60, 848]], 1.7) for i in range(1, MIN_STEPS + 1)
    ]
    with pytest.raises(ValidateInputError, match="engine-calls.jsonl is missing"):
        run_step_speeds(tmp_path, COST)
    (tmp_path / "engine-calls.jsonl").write_text("".join(json.dumps(c) + "\n" for c in calls))
    assert run_step_speeds(tmp_path, COST)["prompt"]["alone"] == pytest.approx(1.7, abs=1e-3)


def test_a_bench_runs_own_calibration_runs_are_measured_against_the_fit_and_combined(tmp_path):
    for repetition, ratio in enumerate((1.4, 2.2, 1.5)):
        folder = tmp_path / "calibration" / f"after-repetition-{repetition}"
        folder.mkdir(parents=True)
        calls = [step("prefill-0", 0.0, [[800, 0]], 9.0)] + [
            step("prefill-0", 10.0 * i, [[60, 848]], ratio) for i in range(1, MIN_STEPS + 1)
        ]
        calls.append(
            {
                "instance": "prefill-0",
                "call": "add_request",
                "request": "r0",
                "queued_s": 100.01,
                "start_s": 100.01,
                "end_s": 100.01,
            }
        )
        (folder / "engine-calls.jsonl").write_text("".join(json.dumps(c) + "\n" for c in calls))
        record = RequestRecord(0, 0, "cold", request_id="r0", sent_unix_s=100.0)
        (folder / "records.json").write_text(json.dumps([record.__dict__]))
    combined = run_calibration(tmp_path, COST)
    assert len(combined["runs"]) == 3
    assert combined["kinds"]["prompt"]["alone"] == pytest.approx(1.5, abs=1e-3)  # the median run
    assert combined["dispatch"]["median_s"] == pytest.approx(0.01, abs=1e-4)
    assert run_calibration(tmp_path / "elsewhere", COST) is None


def test_validating_with_a_runs_calibration_it_does_not_have_is_a_clear_error(tmp_path):
    (tmp_path / "results.json").write_text(json.dumps({"config": {}, "modes": {}}))
    profile = tmp_path / "profile.json"
    profile.write_text(
        json.dumps(
            {
                "cost_model": {
                    "coefficients": list(COST.coefficients),
                    "export_bytes_per_s": 1e9,
                    "import_bytes_per_s": 5e9,
                    "kv_bytes_per_token": 46080,
                    "max_batch_tokens": 2048,
                }
            }
        )
    )
    with pytest.raises(ValidateInputError, match="run pdd bench run with --calibrate"):
        validate(tmp_path, profile, host_cores=2, step_speeds_from="calibration")
    with pytest.raises(ValidateInputError, match="one of auto, profile, calibration, run"):
        validate(tmp_path, profile, host_cores=2, step_speeds_from="fastest")


def test_the_cli_offers_every_step_speed_source_validate_takes():
    from infra.cli import build_parser
    from loadtest.sim.validate import STEP_SPEED_SOURCES

    args = build_parser().parse_args(["sim", "validate", "some-run"])
    assert args.step_speeds == "auto"
    for source in STEP_SPEED_SOURCES:
        assert build_parser().parse_args(["sim", "validate", "x", "--step-speeds", source]).step_speeds == source
    with pytest.raises(SystemExit):
        build_parser().parse_args(["sim", "validate", "x", "--step-speeds", "fastest"])
