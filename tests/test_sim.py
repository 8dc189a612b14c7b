"""The simulator's parts and its request path, driven by the router's and relay's own policies."""

import pytest

from loadtest.sim.cost_model import LinearCostModel, nonnegative_least_squares, step_features
from loadtest.sim.deployment import Deployment, RolePool
from loadtest.sim.events import EventQueue
from loadtest.sim.instance import Chunked, DecodeSeq, Host, SimEngine
from loadtest.sim.kv_pool import SimKvPool
from loadtest.sim.network import LinkSpec, WanPipe
from loadtest.sim.simulator import Simulator
from loadtest.sim.workload import SimRequest, Workload, from_records, shared_first_blocks
from loadtest.trace import TraceTurn

# a SmolLM2-like engine on a 2-core CPU: 80 ms per decode step, ~1.6 ms per prompt token
COST = LinearCostModel((0.08, 0.0016, 1e-6, 0.004, 5e-6, 0.0), 1e9, 5e9, 46080)
BLOCK = 16


DEFAULT_LINK = LinkSpec(100e6, 0.04, 0.005)


def deployment(link: LinkSpec = DEFAULT_LINK, **overrides) -> Deployment:
    role = RolePool(1, COST, 512 * (1 << 20) // (BLOCK * 46080))
    settings = {
        "md_site": "site-b",
        "pipeline_policy": "auto",
        "md_prefix_cache": True,
        "host_cores": 2,
        "engine_thread_io": True,
        "initial_wan_bps": link.bandwidth_bps,
        "initial_wan_rtt_s": link.rtt_s,
    }
    settings.update(overrides)
    return Deployment(role, role, role, link, BLOCK, 46080, **settings)


def agent_records(sessions: int = 3, turns: int = 4, output: int = 24, odd: int = 0) -> list[dict]:
    records = []
    for session in range(sessions):
        prompt = 850
        for turn in range(turns):
            records.append(
                {
                    "session": session,
                    "turn": turn,
                    "kind": "cold" if turn == 0 else "warm",
                    "prompt_tokens": prompt,
                    "output_tokens": output,
                }
            )
            prompt += output + 45
    for i in range(odd):
        records.append({"session": 100 + i, "turn": 0, "kind": "odd", "prompt_tokens": 850, "output_tokens": 2})
    return records


def run(records, **overrides):
    simulator = Simulator(deployment(**overrides))
    result = simulator.run(from_records(records, BLOCK, 2, "test"))
    return simulator, result


def test_wan_pipe_carries_the_flow_with_least_left_first_and_counts_what_a_cancelled_flow_sent():
    events = EventQueue()
    pipe = WanPipe(events, LinkSpec(8e6, 0.0, 0.0))  # 1 MB/s, no latency
    landed = {}
    pipe.send(1_000_000, lambda bps: landed.setdefault("a", events.now))
    cancelled = pipe.send(1_000_000, lambda bps: landed.setdefault("b", events.now))
    pipe.send(1_000_000, lambda bps: landed.setdefault("c", events.now))
    events.at(0.5, lambda: pipe.send(250_000, lambda bps: landed.setdefault("warm", events.now)))
    events.at(2.0, lambda: pipe.cancel(cancelled))  # b had the link from 1.25 s: 0.75 MB sent
    events.run()
    assert "b" not in landed
    # a, sent first, goes first; the warm flow's 0.25 MB, with less left, overtake its rest
    assert landed["warm"] == pytest.approx(0.75) and landed["a"] == pytest.approx(1.25)
    assert landed["c"] == pytest.approx(3.0)  # after the cancel c has the link alone
    assert pipe.bytes_carried == pytest.approx(3_000_000, rel=1e-6)


def test_kv_pool_evicts_the_least_recently_used_chain_from_its_tail():
    pool = SimKvPool(10)
    for session, chain in ((1, (1, 2, 3, 4)), (2, (5, 6, 7, 8))):
        pool.pin(session, 4)
        pool.unpin(session, 4, chain)
    pool.pin(1, 4)  # session 1 is used again: session 2 is now the older
    pool.pin(3, 4)  # 8 of 10 blocks held by running requests: two of session 2's four idle ones go
    assert pool.hit_blocks(2, (5, 6, 7, 8)) == 2
    assert pool.hit_blocks(1, (1, 2, 3, 4, 9)) == 4
    assert pool.hit_blocks(1, (1, 2, 7)) == 2  # a prefix hit stops where the chains differ


def test_engine_runs_decode_as_macro_steps_and_new_work_joins_at_a_step_boundary():
    events = EventQueue()
    engine = SimEngine(events, "md-0", "main_decode", "site-b", COST, SimKvPool(1000), max_sequences=4)
    tokens = []
    seq = DecodeSeq(None, 10, 100, lambda s, n, first, gap: tokens.append((n, first, gap)), lambda s: None)
    engine.add_decode(seq)
    step_s = COST.step_s([], 1, 100)
    done = []
    events.at(2.5 * step_s, lambda: engine.add_chunked(Chunked(50, 100, lambda: done.append(events.now))))
    events.run()
    assert seq.remaining == 0 and sum(n for n, _, _ in tokens) == 10
    # the chunk waited for the third step's end, then shared the fourth step with the decode
    assert done[0] == pytest.approx(3 * step_s + COST.step_s([(50, 100)], 1, 103), rel=1e-3)


def test_calls_queued_by_a_steps_outputs_run_before_the_next_step_and_later_ones_after_it():
    # As the engine worker runs them: a finished prompt's exports (one per path) go before the
    # next prompt's step; a call queued while those run waits for that step.
    events = EventQueue()
    engine = SimEngine(events, "prefill-0", "prefill", "site-a", COST, SimKvPool(1000), max_sequences=4)
    ran = []
    export_s = 0.01

    def first_prompt_done():
        ran.append(("first", events.now))
        engine.add_serial(export_s, lambda: ran.append(("export-md", events.now)))
        engine.add_serial(
            0.0,
            lambda: (
                ran.append(("export-relay", events.now)),
                engine.add_serial(0.0, lambda: ran.append(("late", events.now))),
            ),
        )

    engine.add_chunked(Chunked(100, 0, first_prompt_done))
    engine.add_chunked(Chunked(10, 0, lambda: ran.append(("second", events.now))))
    events.run()
    assert [name for name, _ in ran] == ["first", "export-md", "export-relay", "second", "late"]
    first_s = COST.step_s([(100, 0)], 0, 0)
    assert dict(ran)["second"] == pytest.approx(first_s + export_s + COST.step_s([(10, 0)], 0, 0))


def test_cold_turns_are_relayed_and_warm_follow_ups_go_straight_to_main_decode():
    _simulator, result = run(agent_records())
    by_turn = {(r.session, r.turn): r for r in result.requests}
    assert len(result.requests) == 12
    for session in range(3):
        cold = by_turn[(session, 0)]
        assert cold.pipeline == "P-RLD-MD" and cold.eager_tokens > 1  # the relay streamed while KV crossed
        assert by_turn[(session, 3)].pipeline == "P-MD"
    assert all(r.eager_tokens + 0 <= r.output_tokens for r in result.requests)


def test_every_token_arrives_and_nothing_stays_held():
    simulator, result = run(agent_records(odd=2))
    assert len(result.requests) == 14
    for engines in simulator.engines.values():
        for engine in engines:
            assert engine.pool.pinned_blocks == 0 and not engine.running and not engine.waiting
    assert not any(simulator.flows.held.values())
    for request in result.requests:
        delivered = 1 + sum(n for _, n in request.gaps)
        assert delivered == request.output_tokens


def test_odd_requests_finish_on_the_relay_with_their_wan_transfer_cancelled():
    _simulator, result = run(agent_records(sessions=1, turns=1, odd=1))
    odd = next(r for r in result.requests if r.kind == "odd")
    assert odd.finished_on == "RLD" and odd.wan_cancelled
    prompt_kv_bytes = 850 * 46080
    # the cold turn's KV crossed whole; the odd one's was cut short
    assert prompt_kv_bytes <= result.wan_bytes < 2 * prompt_kv_bytes


def test_a_long_relayed_answer_is_handed_over_in_catch_up_chunks():
    # 39 MB over 20 Mbit/s: ~16 s, so the relay is far ahead when main decode holds the prompt
    _simulator, result = run(agent_records(sessions=1, turns=1, output=400), link=LinkSpec(20e6, 0.04, 0.0))
    (request,) = result.requests
    assert request.pipeline == "P-RLD-MD" and request.finished_on == "MD"
    assert request.handoff_mode == "catch-up"


def test_the_decode_side_cache_cuts_wan_bytes_and_the_same_site_floor_has_none():
    records = agent_records()
    _, full = run(records, pipeline_policy="P-MD", md_prefix_cache=False)
    _, drc = run(records, pipeline_policy="P-MD")
    _, same = run(records, pipeline_policy="P-MD", md_site="site-a")
    assert drc.wan_bytes < 0.4 * full.wan_bytes
    assert same.wan_bytes == 0
    assert full.wan_bytes == sum(r["prompt_tokens"] for r in records) * 46080


def test_a_slower_local_path_delays_same_site_first_tokens_by_the_kv_it_carries():
    records = agent_records(sessions=1, turns=1)
    _, fast = run(records, pipeline_policy="P-MD", md_site="site-a", local_bytes_per_s=2.5e9)
    _, slow = run(records, pipeline_policy="P-MD", md_site="site-a", local_bytes_per_s=0.25e9)
    kv_bytes = records[0]["prompt_tokens"] * 46080
    delay_s = slow.requests[0].ttft_s - fast.requests[0].ttft_s
    assert delay_s == pytest.approx(kv_bytes / 0.25e9 - kv_bytes / 2.5e9, rel=0.05)


def test_steps_run_at_their_kinds_in_deployment_speed_alone_and_beside_another_engines_step():
    speeds = {"prompt": {"alone": 1.5, "beside": 2.0}, "decode_one": {"alone": 1.2, "beside": 1.25}}
    events = EventQueue()
    host = Host(2, 2, {"2": 0.5}, speeds)
    prefill = SimEngine(events, "prefill-0", "prefill", "site-a", COST, SimKvPool(1000), max_sequences=4, host=host)
    main = SimEngine(events, "md-0", "main_decode", "site-a", COST, SimKvPool(1000), max_sequences=4, host=host)
    done = {}
    prefill.add_chunked(Chunked(100, 0, lambda: done.setdefault("alone", events.now)))
    events.run()
    prompt_s = COST.step_s([(100, 0)], 0, 0)
    assert done["alone"] == pytest.approx(1.5 * prompt_s)
    # a one-sequence decode on main decode for the whole prompt step: both run "beside"
    decode = DecodeSeq(None, 1000, 100, lambda *a: None, lambda s: None)
    main.add_decode(decode)
    start = events.now

    def beside_done():
        done["beside"] = events.now
        main.settle()
        done["decoded"] = decode.emitted

    prefill.add_chunked(Chunked(100, 0, beside_done))
    events.run(until_s=start + 10 * prompt_s)
    assert done["beside"] - start == pytest.approx(2.0 * prompt_s, rel=1e-6)
    decode_s = COST.step_s([], 1, 100)
    assert done["decoded"] == int(2.0 * prompt_s / (1.25 * decode_s))


def test_step_noise_makes_replays_differ_by_seed_and_not_without_it():
    speeds = {kind: {"alone": 1.3, "beside": 1.8, "spread": 0.2} for kind in ("prompt", "decode_one", "decode_many")}
    records = agent_records()

    def ttfts(seed, noise):
        simulator = Simulator(deployment(LinkSpec(100e6, 0.04, 0.0), step_speeds=speeds, step_noise=noise), seed=seed)
        return [
            r.ttft_s
            for r in sorted(
                simulator.run(from_records(records, BLOCK, 2, "t")).requests, key=lambda r: (r.session, r.turn)
            )
        ]

    assert ttfts(1, True) == ttfts(1, True)
    assert ttfts(1, True) != ttfts(2, True)
    assert ttfts(1, False) == ttfts(2, False)


def test_the_dispatch_delays_every_first_token_and_its_spread_parts_prompts_sent_together():
    records = [{"session": s, "turn": 0, "kind": "cold", "prompt_tokens": 850, "output_tokens": 4} for s in (0, 1)]

    def prefills(seed=0, **overrides):
        simulator = Simulator(
            deployment(
                LinkSpec(100e6, 0.04, 0.0), pipeline_policy="P-MD", md_site="site-a", engine_wake_s=0.003, **overrides
            ),
            seed=seed,
        )
        return sorted(simulator.run(from_records(records, BLOCK, 2, "t")).requests, key=lambda r: r.session)

    base, slow = prefills(), prefills(dispatch_s=0.05)
    assert [r.ttft_s - b.ttft_s for r, b in zip(slow, base)] == pytest.approx([0.049, 0.049], abs=1e-3)
    # without a spread both reach the idle prefill together and share its step, every replay
    together = [prefills(dispatch_s=0.05, dispatch_spread=0.5, step_noise=False, seed=seed) for seed in range(6)]
    assert all(a.prefill_done_s == pytest.approx(b.prefill_done_s) for a, b in together)
    # drawn apart by more than the wake-up, the second waits for the first one's step
    apart = [prefills(dispatch_s=0.05, dispatch_spread=0.5, step_noise=True, seed=seed) for seed in range(6)]
    prompt_s = COST.step_s([(850, 0)], 0, 0)
    assert any(abs(a.prefill_done_s - b.prefill_done_s) > 0.5 * prompt_s for a, b in apart)


def test_sessions_share_the_blocks_their_first_prompts_start_with_and_caches_hit_them(tiny_metadata):
    common = "Here is the tool output you asked for, line by line, from the build: " * 3
    trace = [
        TraceTurn(0, 0, common + "alpha " * 80, 8, "cold"),
        TraceTurn(1, 0, common + "beta " * 80, 8, "cold"),
        TraceTurn(2, 0, "Something else entirely. " * 20, 8, "odd"),
        TraceTurn(0, 1, "more", 8, "warm"),
    ]
    shared = shared_first_blocks(
        trace,
        tiny_metadata.tokenizer,
        BLOCK,
        system_prompt="You are a careful coding agent. Answer briefly, in plain words.",
    )
    assert shared[0] == shared[1] and len(shared[0]) > len(shared[2]) >= 1  # the template's start at least
    assert shared[2] == shared[0][: len(shared[2])] and all(b < 0 for b in shared[0])
    records = [{"session": s, "turn": 0, "kind": "cold", "prompt_tokens": 300, "output_tokens": 4} for s in (0, 1)]
    workload = from_records(records, BLOCK, 1, "t", shared)
    first, second = workload.requests
    cached, uncached = SimKvPool(100), SimKvPool(100, caching=False)
    for pool in (cached, uncached):
        pool.pin(0, 20)
        pool.set_chain(0, first.prompt_blocks(BLOCK))
        pool.unpin(0, 20, first.prompt_blocks(BLOCK))
    # another session's prompt hits the blocks every session starts with, and no further
    assert cached.hit_blocks(1, second.prompt_blocks(BLOCK)) == len(shared[1])
    assert uncached.hit_blocks(1, second.prompt_blocks(BLOCK)) == 0


def test_flows_sharing_the_system_prompts_blocks_wait_in_main_decodes_line():
    # Two cold prompts sent together, one prefill step: without a decode-side cache the second
    # flow waits for the first one's import (they share the template's blocks), as the
    # importer's InFlightBlocks has it; with unrelated prompts the shorter one's KV, with less
    # to send, crosses first.
    records = [
        {"session": s, "turn": 0, "kind": "cold", "prompt_tokens": tokens, "output_tokens": 4}
        for s, tokens in ((0, 850), (1, 400))
    ]
    long_transfer_s = 850 * 46080 * 8 / 100e6
    ttfts = {}
    for shared in ({0: (-1, -2), 1: (-1, -2)}, None):
        simulator = Simulator(
            deployment(LinkSpec(100e6, 0.04, 0.0), pipeline_policy="P-MD", md_prefix_cache=False, engine_wake_s=0.003)
        )
        result = simulator.run(from_records(records, BLOCK, 2, "t", shared))
        ttfts[shared is not None] = {r.session: r.ttft_s for r in result.requests}
    in_line, apart = ttfts[True], ttfts[False]
    assert in_line[1] - apart[1] == pytest.approx(long_transfer_s, rel=0.1)  # the short one waited
    assert apart[1] < apart[0] and in_line[0] < in_line[1]  # apart the short one goes first


def test_open_loop_sessions_run_their_turns_in_order():
    requests = [
        SimRequest(0, t, "warm", 200 + 40 * t, 8, 8, tuple(range(1, (240 + 40 * t) // BLOCK + 1)), 1.0)
        for t in range(3)
    ]
    simulator = Simulator(deployment())
    result = simulator.run(Workload(requests, 0, "open"))
    arrivals = [r.arrival_s for r in sorted(result.requests, key=lambda r: r.turn)]
    ends = [r.arrival_s + r.e2e_s for r in sorted(result.requests, key=lambda r: r.turn)]
    assert arrivals[0] == pytest.approx(1.0)
    assert arrivals[1] >= ends[0] and arrivals[2] >= ends[1]


def test_profile_fit_recovers_a_linear_cost_model():
    truth = [0.05, 0.002, 3e-7, 0.004, 6e-6, 1.2e-4]
    samples = [
        step_features([(n, c)], 0, 0)
        for n, c in ((64, 0), (512, 0), (2048, 0), (128, 1024), (512, 2048), (16, 1024), (64, 512))
    ]
    samples += [step_features([], b, b * c) for b, c in ((1, 256), (4, 1024), (8, 512), (1, 2048))]
    import numpy as np

    features = np.stack(samples)
    seconds = features @ np.asarray(truth)
    fitted = nonnegative_least_squares(features / seconds[:, None], np.ones_like(seconds))
    assert fitted == pytest.approx(truth, rel=1e-6)


def test_decisions_come_from_the_routers_and_relays_own_code():
    import loadtest.sim.relay_path as relay_module
    import loadtest.sim.simulator as simulator_module
    from services.relay_decode import handoff
    from services.router import odd_traffic, placement, wan_estimate

    assert simulator_module.place is placement.place
    assert relay_module.HandoffMachine is handoff.HandoffMachine
    assert simulator_module.OddTrafficTracker is odd_traffic.OddTrafficTracker
    assert simulator_module.WanEstimator is wan_estimate.WanEstimator
    # the router's threshold, changed, changes the simulated pipeline choice
    _, relaxed = run(agent_records(sessions=1, turns=1), ttft_target_s=60.0)
    assert [r.pipeline for r in relaxed.requests] == ["P-MD"]


def test_a_simulated_run_logs_nothing_and_moves_no_metric_of_the_process():
    """The policies return their decisions; a replay of relayed, handed-over and odd requests
    (thousands of decisions in a real run) leaves the process's logs and metrics alone."""
    import logging

    import structlog
    from prometheus_client import REGISTRY
    from structlog.testing import capture_logs

    def samples() -> dict:
        return {(s.name, tuple(sorted(s.labels.items()))): s.value for m in REGISTRY.collect() for s in m.samples}

    before = samples()
    previous = structlog.get_config()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.DEBUG))
    try:
        with capture_logs() as logs:
            _, result = run(agent_records(sessions=2, turns=2, output=400, odd=2), link=LinkSpec(20e6, 0.04, 0.0))
    finally:
        structlog.configure(**previous)
    assert {r.handoff_mode for r in result.requests} >= {"catch-up"}
    assert any(r.finished_on == "RLD" for r in result.requests)  # the odd ones
    assert logs == []
    moved = {k: (before.get(k), v) for k, v in samples().items() if k[0].startswith("pdd_") and before.get(k) != v}
    assert not moved, moved
