"""The router learns the WAN link from its own KV transfers and routes by what it learnt."""

import asyncio
import math

import aiohttp
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from infra.wan_link import LinkProfile
from services.router.kv_landings import KvLandings, file_late_kv_ready
from services.router.link_share import Sending, finish_times
from services.router.placement import Placement
from services.router.wan_estimate import MIN_SAMPLE_BYTES, WanEstimate, WanEstimator
from shared.block_hash import hash_blocks
from shared.messages import InstanceRef, KvReady
from tests.helpers import chat_body, post, reference_chat_answer, until


def test_first_measurement_replaces_the_prior_then_smooths():
    wan = WanEstimator(bandwidth_bps=100e6, rtt_s=0.04, alpha=0.5)
    wan.add_throughput(10e6, num_bytes=100)  # too small to tell
    assert wan.current().bandwidth_bps == 100e6
    wan.add_throughput(10e6, num_bytes=MIN_SAMPLE_BYTES)
    assert wan.current().bandwidth_bps == 10e6
    wan.add_throughput(20e6, num_bytes=MIN_SAMPLE_BYTES)
    assert wan.current().bandwidth_bps == 15e6
    wan.add_rtt(0.1)
    wan.add_rtt(0.2)
    assert abs(wan.current().rtt_s - 0.15) < 1e-9


def test_one_queued_handshake_cannot_blow_up_the_rtt_estimate():
    wan = WanEstimator(bandwidth_bps=100e6, rtt_s=0.04, alpha=0.5)
    wan.add_rtt(25.0)  # waited behind a burst of other flows' KV
    assert wan.current().rtt_s == 0.16
    wan.add_rtt(0.04)
    assert abs(wan.current().rtt_s - 0.1) < 1e-9


def test_a_drop_is_believed_within_one_transfer_and_rises_are_smoothed():
    wan = WanEstimator(bandwidth_bps=100e6, rtt_s=0.04, alpha=0.5)
    wan.add_throughput(100e6, num_bytes=MIN_SAMPLE_BYTES)
    wan.add_throughput(2e6, num_bytes=MIN_SAMPLE_BYTES)  # the link fell to 2 Mbit/s
    assert wan.current().bandwidth_bps == 2e6
    wan.add_throughput(1.5e6, num_bytes=MIN_SAMPLE_BYTES)  # noise: smoothed
    assert wan.current().bandwidth_bps == 1.75e6
    wan.add_throughput(101.75e6, num_bytes=MIN_SAMPLE_BYTES)  # recovery: smoothed too
    assert wan.current().bandwidth_bps == 51.75e6


async def test_router_learns_a_slow_link_and_starts_relaying(make_stack):
    # The router believes 100 Mbit/s; the link gives 2 Mbit/s. A ~700-token tiny-model prompt
    # (~360 KB of KV) is predicted at ~30 ms (P-MD) but really takes ~1.4 s (relay-worthy). The
    # KV ships while the prompt computes, so only the transfer's excess over the prefill counts:
    # at 5 Mbit/s a prefill measured slow (a loaded machine) hid the whole transfer once.
    stack = await make_stack(
        profile=LinkProfile(bandwidth_bps=2e6, rtt_ms=20, jitter_ms=0, seed=4),
        engine_settings={"frame_tokens": 16},
        router_settings={
            "ttft_target_ms": 200,
            "wan_bandwidth_mbit": 100,
            "wan_rtt_ms": 20,
            "odd_traffic_filter": False,
        },
    )
    status, first = await post(stack, "/chat/completions", chat_body("Describe a harbour. " * 140, 4))
    assert status == 200 and first["pdd"]["pipeline"] == "P-MD"
    async with aiohttp.ClientSession() as session:
        async with session.get(stack.base_url.removesuffix("/v1") + "/health") as response:
            learnt = (await response.json())["wan_estimate"]
    assert 1.4 <= learnt["bandwidth_mbit"] <= 2.6, learnt
    status, second = await post(stack, "/chat/completions", chat_body("Describe a lighthouse. " * 140, 4))
    assert status == 200 and second["pdd"]["pipeline"] == "P-RLD-MD"


async def test_after_the_link_drops_the_second_large_request_is_relayed(make_stack):
    # ~700-token tiny-model prompts (~360 KB of KV): ~30 ms at 100 Mbit/s, ~1.5 s at 2 Mbit/s.
    stack = await make_stack(
        profile=LinkProfile(bandwidth_bps=100e6, rtt_ms=20, jitter_ms=0, seed=4),
        engine_settings={"frame_tokens": 16},
        router_settings={
            "ttft_target_ms": 500,
            "wan_bandwidth_mbit": 100,
            "wan_rtt_ms": 20,
            "odd_traffic_filter": False,
        },
    )
    topics = iter(["a harbour", "a lighthouse", "a canal", "a bridge"])

    async def large_request() -> str:
        status, body = await post(stack, "/chat/completions", chat_body(f"Describe {next(topics)}. " * 140, 4))
        assert status == 200, body
        return body["pdd"]["pipeline"]

    assert await large_request() == "P-MD"
    stack.link.set_profile(bandwidth_bps=2e6)
    assert await large_request() == "P-MD"  # still believed fast: this transfer teaches the drop
    assert await large_request() == "P-RLD-MD"


def test_placed_flows_hold_the_link_until_their_predicted_last_byte():
    now = [100.0]
    wan = WanEstimator(bandwidth_bps=100e6, rtt_s=0.04, clock=lambda: now[0])
    wan.flow_placed("r0", "md-0", [1, 2], 0, prefill_s=2.0, ships_from_s=0.2)  # nothing crosses: no queue
    assert wan.current().queue_s == 0.0
    # 37 MB shipped from 0.2 s into a 2 s prefill: 2.96 s on the wire, the last byte leaves at 3.16 s
    wan.flow_placed("r1", "md-0", [1, 2], 37_000_000, prefill_s=2.0, ships_from_s=0.2)
    assert wan.current().queue_s == pytest.approx(3.16)
    now[0] += 1.0
    assert wan.current().queue_s == pytest.approx(2.16)
    wan.flow_placed("r2", "md-1", [7], 1_000_000, prefill_s=0.1, ships_from_s=0.1)  # 0.08 s, behind r1
    assert wan.current().queue_s == pytest.approx(2.24)
    wan.flow_landed("r1", "md-1")  # said by another decoder than the flow's: not believed
    assert wan.current().queue_s == pytest.approx(2.24)
    wan.flow_landed("r1", "md-0")  # its KvReady came early: r2 goes as soon as it can
    assert wan.current().queue_s == pytest.approx(0.18)
    wan.seen_cached([7, 8], {"md-1": 1})  # the index lists r2's only block at md-1: landed
    assert wan.current().queue_s == 0.0


def test_the_flows_are_replanned_when_the_link_proves_faster_or_one_lands_early():
    now = [0.0]
    wan = WanEstimator(bandwidth_bps=100e6, rtt_s=0.04, clock=lambda: now[0])
    for request_id in ("a", "b", "c"):  # three cold prompts' 25 MB each, placed together: 2 s each
        wan.flow_placed(request_id, "md-0", [hash(request_id)], 25_000_000, prefill_s=0.5, ships_from_s=0.1)
    assert wan.current().queue_s == pytest.approx(0.1 + 3 * 25_000_000 * 8 / 100e6)
    now[0] = 1.0  # as much left each: the first placed has had the link since 0.1 s
    left = 25_000_000 - 0.9 * 100e6 / 8
    assert wan.current().crossing_bytes == pytest.approx((left, 25_000_000, 25_000_000))
    wan.add_throughput(200e6, 25_000_000)  # the first measurement: twice as fast as believed
    assert wan.current().queue_s == pytest.approx((left + 50_000_000) * 8 / wan.bandwidth_bps)
    wan.flow_landed("a", "md-0")  # landed early: b, then c, have the link
    assert wan.current().queue_s == pytest.approx(50_000_000 * 8 / wan.bandwidth_bps)
    assert wan.arriving([hash("c")])["md-0"].lands_in_s == pytest.approx(wan.current().queue_s + 0.02)
    assert wan.arriving([hash("b")])["md-0"].lands_in_s == pytest.approx(wan.current().queue_s / 2 + 0.02)


def test_blocks_on_their_way_count_for_a_follow_up_prompt_until_the_index_lists_them():
    now = [0.0]
    wan = WanEstimator(bandwidth_bps=100e6, rtt_s=0.04, clock=lambda: now[0])
    wan.flow_placed("a", "md-0", [11, 12, 13], 30_000_000, prefill_s=2.0, ships_from_s=0.1)  # 2.4 s on the wire
    wan.flow_placed("b", "md-1", [11, 99], 20_000_000, prefill_s=1.0, ships_from_s=0.1)
    # a follow-up turn: the first turn's three blocks plus a new one
    arriving = wan.arriving([11, 12, 13, 14])
    # both may send from 0.1 s: b has less to send, so it goes first, then a
    a_leaves_s = 0.1 + (20_000_000 + 30_000_000) * 8 / 100e6
    assert arriving["md-0"].blocks == 3 and arriving["md-0"].lands_in_s == pytest.approx(a_leaves_s + 0.02)
    assert arriving["md-1"].blocks == 1
    assert wan.arriving([50, 51, 52]) == {}  # another prompt: its chained hashes differ from the first on
    wan.flow_landed("b", "md-1")  # landed: from now on only the cache-index credits its blocks
    assert set(wan.arriving([11, 12, 13, 14])) == {"md-0"}
    now[0] += 2.6  # md-0's flow should have landed by now
    assert wan.arriving([11, 12, 13, 14]) == {}


@settings(max_examples=100, deadline=None, derandomize=True)
@given(
    shared=st.lists(st.integers(0, 3), max_size=40),
    first=st.lists(st.integers(0, 3), max_size=40),
    second=st.lists(st.integers(0, 3), max_size=40),
)
def test_a_prompt_counts_the_leading_blocks_a_placed_flow_shares_with_it(shared, first, second):
    wan = WanEstimator(bandwidth_bps=100e6, rtt_s=0.04, clock=lambda: 0.0)
    placed, asked = hash_blocks(shared + first, 4), hash_blocks(shared + second, 4)
    wan.flow_placed("a", "md-0", placed, 30_000_000, prefill_s=2.0)
    expected = next((i for i, (x, y) in enumerate(zip(placed, asked)) if x != y), min(len(placed), len(asked)))
    arriving = wan.arriving(asked)
    assert (arriving["md-0"].blocks if arriving else 0) == expected


def test_a_new_flow_goes_ahead_of_the_flows_crossing_with_more_left_and_behind_the_others():
    idle = WanEstimate(bandwidth_bps=100e6, rtt_s=0.04)
    busy = WanEstimate(bandwidth_bps=100e6, rtt_s=0.04, queue_s=5.0, crossing_bytes=(62_500_000.0,))  # 5 s of KV
    transfer_s = 37_000_000 * 8 / 100e6
    # shipping while a 3 s prefill computes: the idle link has it all there 0.02 s after the prefill
    alone = idle.arrival_after_prefill_s(37_000_000, prefill_s=3.0, ships_from_s=0.2)
    assert alone == pytest.approx(max(0.0, 0.2 + transfer_s - 3.0) + 0.02)
    # beside a flow with 5 s of KV still to send (59.9 MB by its first byte), a cold prompt's
    # 37 MB go first: as if alone
    assert busy.arrival_after_prefill_s(37_000_000, prefill_s=3.0, ships_from_s=0.2) == pytest.approx(alone)
    # a follow-up turn's megabyte does not wait for the other flow's 5 s either
    follow_up = busy.arrival_after_prefill_s(1_000_000, prefill_s=0.1, ships_from_s=0.1)
    assert follow_up == pytest.approx(1_000_000 * 8 / 100e6 + 0.02)
    # a longer prompt's 80 MB wait for the other flow's rest
    behind = busy.arrival_after_prefill_s(80_000_000, prefill_s=3.0, ships_from_s=0.2)
    crossing_left = 62_500_000 - 0.2 * 100e6 / 8
    assert behind == pytest.approx(0.2 + (80_000_000 + crossing_left) * 8 / 100e6 - 3.0 + 0.02)


def test_kv_out_of_the_last_chunk_crosses_after_the_prefill_however_early_the_first_byte():
    """A follow-up turn whose decoder holds all but the prompt's new tail: the tail is computed
    by the prefill's last chunk, so its bytes cross after the compute, not overlapped with it."""
    idle = WanEstimate(bandwidth_bps=100e6, rtt_s=0.04)
    tail_bytes = 8_400_000  # 0.67 s on the link
    overlapped = idle.arrival_after_prefill_s(tail_bytes, prefill_s=0.7, ships_from_s=0.08)
    assert overlapped == pytest.approx(max(0.0, 0.08 + tail_bytes * 8 / 100e6 - 0.7) + 0.02)
    after = idle.arrival_after_prefill_s(tail_bytes, prefill_s=0.7, ships_from_s=0.7, tail_bytes=tail_bytes)
    assert after == pytest.approx(tail_bytes * 8 / 100e6 + 0.02)
    # a long prompt ships most bytes while it computes; its last chunk's still follow the compute
    mixed = idle.arrival_after_prefill_s(37_000_000, prefill_s=3.0, ships_from_s=0.1, tail_bytes=tail_bytes)
    assert mixed == pytest.approx(tail_bytes * 8 / 100e6 + 0.02)
    assert idle.arrival_after_prefill_s(37_000_000, prefill_s=3.0, ships_from_s=0.1) == pytest.approx(
        0.1 + 37_000_000 * 8 / 100e6 - 3.0 + 0.02
    )
    # beside a flow crossing with more left, the tail goes first; beside one with less, after it
    busy = WanEstimate(bandwidth_bps=100e6, rtt_s=0.04, crossing_bytes=(100_000_000.0,))
    ahead = busy.arrival_after_prefill_s(tail_bytes, prefill_s=0.7, ships_from_s=0.7, tail_bytes=tail_bytes)
    assert ahead == pytest.approx(after)
    busy = WanEstimate(bandwidth_bps=100e6, rtt_s=0.04, crossing_bytes=(12_000_000.0,))
    behind = busy.arrival_after_prefill_s(tail_bytes, prefill_s=0.7, ships_from_s=0.7, tail_bytes=tail_bytes)
    crossing_left = 12_000_000 - 0.7 * 100e6 / 8  # 3.25 MB by the end of the compute
    assert behind == pytest.approx((tail_bytes + crossing_left) * 8 / 100e6 + 0.02)
    # a long prompt beside a 40 MB flow of its prefill: its 28.6 MB before the tail go first
    # as they are computed; the link carries the other flow with the rest of its time (8.9 MB
    # by the compute's end), so the tail, with less left than the other's 31.1 MB, goes alone
    busy = WanEstimate(bandwidth_bps=100e6, rtt_s=0.04, crossing_bytes=(40_000_000.0,))
    mixed = busy.arrival_after_prefill_s(37_000_000, prefill_s=3.0, ships_from_s=0.1, tail_bytes=tail_bytes)
    assert mixed == pytest.approx(tail_bytes * 8 / 100e6 + 0.02)


def shortest_first_finish_s(crossing: list[float], new_bytes: float, joins_s: float, bytes_per_s: float) -> float:
    """When a flow of ``new_bytes`` joining at ``joins_s`` sends its last byte on a link that
    serves, of the flows with bytes left, the one with the fewest (on a tie the one listed
    first, the new flow last), event by event (the join, each flow's end)."""
    now, left, new_left = 0.0, [b for b in crossing if b > 0], new_bytes
    while True:
        joined = now >= joins_s
        candidates = [(b, i) for i, b in enumerate(left)] + ([(new_left, len(left))] if joined else [])
        if not candidates:
            now = joins_s
            continue
        size, i = min(candidates)
        step_s = size / bytes_per_s if joined else min(size / bytes_per_s, joins_s - now)
        now += step_s
        if i == len(left):
            return now
        left[i] -= step_s * bytes_per_s
        left = [b for b in left if b > 1e-6 * new_bytes]


@settings(max_examples=200, deadline=None, derandomize=True)
@given(
    crossing=st.lists(st.floats(1e5, 1e8), max_size=6),
    new_bytes=st.floats(1e5, 1e8),
    ships_from_s=st.floats(0.0, 5.0),
)
def test_a_new_flows_last_byte_is_what_a_shortest_first_link_gives(crossing, new_bytes, ships_from_s):
    wan = WanEstimate(bandwidth_bps=100e6, rtt_s=0.04, crossing_bytes=tuple(crossing))
    first_byte_s = max(ships_from_s, wan.rtt_s)
    expected = shortest_first_finish_s(crossing, int(new_bytes), first_byte_s, 100e6 / 8)
    # no prefill bound (prefill_s = 0): the arrival is the last byte plus a one-way delay
    assert wan.arrival_after_prefill_s(int(new_bytes), 0.0, ships_from_s) == pytest.approx(
        expected + 0.02, rel=1e-6, abs=1e-6
    )


@settings(max_examples=200, deadline=None, derandomize=True)
@given(
    crossing=st.lists(st.floats(1e5, 1e8), max_size=6),
    new_bytes=st.floats(1e5, 1e8),
    joins_s=st.floats(0.0, 5.0),
)
def test_the_ledgers_plan_is_what_a_shortest_first_link_gives(crossing, new_bytes, joins_s):
    flows = [Sending(0.0, size) for size in crossing] + [Sending(joins_s, new_bytes)]
    expected = shortest_first_finish_s(crossing, new_bytes, joins_s, 100e6 / 8)
    assert finish_times(flows, 0.0, 100e6 / 8)[-1] == pytest.approx(expected, rel=1e-6, abs=1e-6)
    assert [flow.unsent_bytes for flow in flows] == [*crossing, new_bytes]  # a projection: nothing sent


def shared_by_prefills_finish_s(flows: list[tuple[float, float, str]], bytes_per_s: float) -> list[float]:
    """When each flow ``(first byte at, bytes, prefill)`` sends its last byte on a link that
    gives each prefill with a flow that may send an equal share, spent on that prefill's flow
    with the fewest bytes left (on a tie the one listed first), event by event."""
    left = [size for _, size, _ in flows]
    done = [math.inf] * len(flows)
    now = 0.0
    while any(d == math.inf for d in done):
        started = [i for i, (at, _, _) in enumerate(flows) if at <= now and done[i] == math.inf]
        upcoming = min((at for i, (at, _, _) in enumerate(flows) if at > now and done[i] == math.inf), default=math.inf)
        heads = {}
        for i in started:
            sender = flows[i][2]
            if sender not in heads or left[i] < left[heads[sender]]:
                heads[sender] = i
        if not heads:
            now = upcoming
            continue
        rate = bytes_per_s / len(heads)
        step_s = min(upcoming - now, min(left[i] for i in heads.values()) / rate)
        now += step_s
        for i in heads.values():
            left[i] -= rate * step_s
            if left[i] <= 1e-6 * flows[i][1]:
                done[i] = now
    return done


@settings(max_examples=200, deadline=None, derandomize=True)
@given(
    flows=st.lists(
        st.tuples(st.floats(0.0, 3.0), st.floats(1e5, 5e7), st.sampled_from(["prefill-0", "prefill-1", "prefill-2"])),
        min_size=1,
        max_size=6,
    )
)
def test_the_ledgers_plan_sends_each_prefills_shortest_flow_and_shares_the_link_between_prefills(flows):
    sendings = [Sending(at, size, sender) for at, size, sender in flows]
    expected = shared_by_prefills_finish_s(flows, 100e6 / 8)
    assert finish_times(sendings, 0.0, 100e6 / 8) == pytest.approx(expected, rel=1e-6, abs=1e-6)


def test_a_new_flow_shares_the_link_equally_with_another_prefills_flow():
    """Only one prefill's flows take turns: beside another prefill's flow, a new one gets half
    the link whichever has less left."""
    crossing = {"crossing_bytes": (62_500_000.0,), "crossing_senders": ("prefill-1",)}
    busy = WanEstimate(bandwidth_bps=100e6, rtt_s=0.04, **crossing)
    shared = busy.arrival_after_prefill_s(37_000_000, ships_from_s=0.2, sender_id="prefill-0")
    assert shared == pytest.approx(0.2 + 2 * 37_000_000 * 8 / 100e6 + 0.02)
    follow_up = busy.arrival_after_prefill_s(1_000_000, ships_from_s=0.1, sender_id="prefill-0")
    assert follow_up == pytest.approx(0.1 + 2 * 1_000_000 * 8 / 100e6 + 0.02)
    # another prefill with two flows crossing still gets one share, not one per flow
    two = WanEstimate(bandwidth_bps=100e6, rtt_s=0.04, crossing_bytes=(40e6, 40e6), crossing_senders=("p1", "p1"))
    beside_two = two.arrival_after_prefill_s(37_000_000, ships_from_s=0.0, sender_id="p0")
    assert beside_two == pytest.approx(0.04 + 2 * 37_000_000 * 8 / 100e6 + 0.02)
    # the same flow from the crossing flow's own prefill goes ahead of it
    ahead = busy.arrival_after_prefill_s(37_000_000, ships_from_s=0.2, sender_id="prefill-1")
    assert ahead == pytest.approx(0.2 + 37_000_000 * 8 / 100e6 + 0.02)


def test_the_estimator_tells_placement_who_sends_each_flow_crossing():
    wan = WanEstimator(bandwidth_bps=100e6, rtt_s=0.04, clock=lambda: 0.0)
    wan.flow_placed("a", "md-0", [1], 25_000_000, prefill_s=0.5, ships_from_s=0.1, sender_id="prefill-0")
    wan.flow_placed("b", "md-0", [2], 25_000_000, prefill_s=0.5, ships_from_s=0.1, sender_id="prefill-1")
    estimate = wan.current()
    assert estimate.crossing_senders == ("prefill-0", "prefill-1")
    # two prefills: each sends half the rate from 0.1 s, both leave at 0.1 + 4 s
    assert estimate.queue_s == pytest.approx(0.1 + 2 * 25_000_000 * 8 / 100e6)
    assert wan.arriving([1])["md-0"].lands_in_s == pytest.approx(estimate.queue_s + 0.02)


def test_the_ledger_tells_what_each_placed_flow_still_has_to_send():
    now = [0.0]
    wan = WanEstimator(bandwidth_bps=100e6, rtt_s=0.04, clock=lambda: now[0])
    wan.flow_placed("a", "md-0", [1], 25_000_000, prefill_s=0.5, ships_from_s=0.1)  # 2 s from 0.1 s
    wan.flow_placed("b", "md-1", [2], 12_500_000, prefill_s=0.5, ships_from_s=0.1)
    now[0] = 0.6  # b, with less to send, has had the link for 0.5 s
    assert wan.current().crossing_bytes == pytest.approx((25_000_000, 6_250_000))
    wan.flow_stopped("a")  # odd traffic the relay finished: its bytes stop crossing
    assert wan.current().crossing_bytes == pytest.approx((6_250_000,))
    assert wan.arriving([1]) == {}


def test_a_flow_that_shared_the_link_measured_its_share_not_a_slower_link():
    now = [0.0]
    wan = WanEstimator(bandwidth_bps=100e6, rtt_s=0.04, clock=lambda: now[0])
    wan.flow_placed("a", "md-0", [1], 37_000_000, prefill_s=0.5, ships_from_s=0.1)
    wan.flow_placed("b", "md-1", [2], 37_000_000, prefill_s=0.5, ships_from_s=0.1)
    now[0] = 6.0  # both crossed together: each measured about half the link
    wan.add_throughput(50e6, 37_000_000, "a")
    assert wan.bandwidth_bps == 100e6
    wan.flow_landed("a", "md-0")
    wan.add_throughput(150e6, 37_000_000, "b")  # a share above the estimate: the link is at least that fast
    assert wan.bandwidth_bps > 100e6
    wan.flow_landed("b", "md-1")
    now[0] = 20.0
    wan.flow_placed("c", "md-0", [3], 37_000_000, prefill_s=0.5, ships_from_s=0.1)
    now[0] = 30.0  # alone on the link, and slow: the link dropped, believed at once
    wan.add_throughput(20e6, 37_000_000, "c")
    assert wan.bandwidth_bps == 20e6


def test_a_later_flow_that_lands_first_delays_the_flows_placed_before_it_by_its_own_bytes_only():
    """A follow-up turn's megabyte goes ahead of a cold prompt's 30 MB placed before it and
    lands while they cross. The cold prompt lost what the megabyte took of the link, no more."""
    now = [0.0]
    wan = WanEstimator(bandwidth_bps=100e6, rtt_s=0.04, clock=lambda: now[0])
    wan.flow_placed("cold", "md-0", [1, 2, 3], 30_000_000, prefill_s=2.0, ships_from_s=0.1)  # 2.4 s from 0.1 s
    landing = wan.arriving([1, 2, 3, 4])["md-0"].lands_in_s
    now[0] = 1.0
    wan.flow_placed("warm", "md-1", [7, 8], 1_000_000, prefill_s=0.1, ships_from_s=0.1)
    now[0] = 1.3
    wan.flow_landed("warm", "md-1")
    delay_s = 1_000_000 * 8 / 100e6
    assert wan.arriving([1, 2, 3, 4])["md-0"].lands_in_s == pytest.approx(landing + delay_s - 1.3)
    now[0] = 1.5
    wan.flow_stopped("warm-odd")  # never placed: nothing changes
    assert wan.arriving([1, 2, 3, 4])["md-0"].lands_in_s == pytest.approx(landing + delay_s - 1.5)


def test_a_flow_the_index_shows_landed_does_not_push_the_flows_still_listed_behind_it():
    now = [0.0]
    wan = WanEstimator(bandwidth_bps=10e6, rtt_s=0.04, clock=lambda: now[0])
    for request_id, prompt in (("a", [1, 2]), ("b", [1, 3]), ("c", [1, 4])):  # 0.63 s each, a shared first block
        wan.flow_placed(request_id, "md-0", prompt, 784_000, prefill_s=0.05, ships_from_s=0.05)
    now[0] = 3.0  # all three landed long ago; the index lists a's prompt at md-0 only now
    wan.seen_cached([1, 2, 5], {"md-0": 2})
    assert wan.current().queue_s == 0.0 and wan.arriving([1, 2, 5]) == {}


def test_a_flow_waits_for_its_prefill_only_until_the_prefill_says_it_is_done():
    """A follow-up turn waits in the plan for blocks on their way; a prefill predicted slower
    than it ran must not hold them back there."""
    now = [0.0]
    wan = WanEstimator(bandwidth_bps=100e6, rtt_s=0.04, clock=lambda: now[0])
    # 30 MB shipped from 0.2 s of a prompt predicted to compute for 3 s: 2.4 s on the wire
    wan.flow_placed("turn-1", "md-0", [1, 2], 30_000_000, prefill_s=3.0, ships_from_s=0.2)
    assert wan.arriving([1, 2, 3])["md-0"].lands_in_s == pytest.approx(3.0 + 0.02)
    now[0] = 1.0
    wan.prefill_done("never-placed")  # nothing changes
    assert wan.arriving([1, 2, 3])["md-0"].lands_in_s == pytest.approx(2.0 + 0.02)
    wan.prefill_done("turn-1")  # computed in 1 s: the link alone decides when the rest lands
    left_bytes = 30_000_000 - (1.0 - 0.2) * 100e6 / 8
    assert wan.arriving([1, 2, 3])["md-0"].lands_in_s == pytest.approx(left_bytes * 8 / 100e6 + 0.02)


async def test_the_router_predicts_a_prompts_compute_from_the_rate_the_prefill_reports(make_stack):
    """A prompt's KV leaves as it is computed, so placement needs the prompt's compute time: the
    prefill reports its rate in its heartbeat (0 until it has computed a long prompt), and the
    router's prediction for a like prompt is of the order the prefill then measures."""
    stack = await make_stack(
        profile=LinkProfile(bandwidth_bps=1e9, rtt_ms=10, jitter_ms=0, seed=4),
        router_settings={"odd_traffic_filter": False},
    )
    predicted_ms = computed_ms = 0.0
    for attempt in range(40):  # until a heartbeat after the first long prompt has carried the rate
        status, body = await post(stack, "/chat/completions", chat_body(f"Describe harbour {attempt}. " * 100, 2))
        assert status == 200, body
        predicted_ms, computed_ms = body["pdd"]["predicted_prefill_ms"], body["pdd"]["prefill_compute_ms"]
        if predicted_ms > 0:
            break
    assert predicted_ms > 0, "the prefill never reported a rate"
    assert 0.2 <= predicted_ms / computed_ms <= 5, (predicted_ms, computed_ms)


def test_a_landing_is_believed_only_from_the_main_decoder_of_the_latest_attempt():
    landings = KvLandings(max_entries=2)
    landings.expect("a", "a", "main-decode-0")
    landings.landed("a", "main-decode-1", landed_unix_s=10.0, wan_kv_bytes=5)  # another decoder's word
    assert landings.of(["a"]) == {}
    landings.landed("a", "main-decode-0", landed_unix_s=11.0, wan_kv_bytes=7)
    assert landings.of(["a", "b"])["a"].as_json()["landed_unix_s"] == 11.0
    landings.landed("never-sent", "main-decode-0", landed_unix_s=12.0, wan_kv_bytes=1)
    assert landings.of(["never-sent"]) == {}
    # A recovery: the new attempt's KV goes elsewhere, and only its landing counts.
    landings.expect("a", "ar1", "main-decode-1")
    assert landings.of(["a"]) == {}
    landings.landed("a", "main-decode-0", landed_unix_s=13.0, wan_kv_bytes=9)  # the failed attempt's
    landings.prefill_done("ar1", computed_unix_s=12.5, compute_ms=100.0)
    landings.landed("ar1", "main-decode-1", landed_unix_s=14.0, wan_kv_bytes=3)
    assert landings.of(["a"])["a"].as_json() == {
        "landed_unix_s": 14.0,
        "wan_kv_bytes": 3,
        "prefill_computed_unix_s": 12.5,
        "prefill_compute_ms": 100.0,
        "kv_after_prefill_ms": 1500.0,
    }
    landings.expect("b", "b", "main-decode-0")
    landings.expect("c", "c", "main-decode-0")
    assert landings.of(["a"]) == {} and len(landings) == 2  # the oldest left
    landings.landed("ar1", "main-decode-1", landed_unix_s=15.0, wan_kv_bytes=3)  # gone: nothing to file under
    assert landings.of(["a"]) == {}


def test_a_recovered_attempts_late_landing_frees_the_link_and_teaches_its_rate():
    """A relayed request whose first attempt failed: its recovery's flow is on the link's ledger
    under the request's id, and its KvReady (after the relay answered) names the attempt's."""
    now = [0.0]
    wan = WanEstimator(bandwidth_bps=100e6, rtt_s=0.04, clock=lambda: now[0])
    landings = KvLandings()
    num_bytes = 20_000_000  # 1.6 s at the believed 100 Mbit/s
    landings.expect("a", "ar1", "main-decode-1")
    wan.flow_placed("a", "main-decode-1", hash_blocks(list(range(64)), 16), num_bytes, prefill_s=0.1)
    now[0] = 1.0

    def kv_ready(attempt_id: str, sender: str) -> KvReady:
        return KvReady(
            request_id=attempt_id,
            instance_id=sender,
            site="site-b",
            cached_tokens=0,
            imported_tokens=64,
            wan_kv_bytes=num_bytes,
            transfer_s=0.8,
            throughput_bps=200e6,
            landed_unix_s=1000.0,
        )

    file_late_kv_ready(kv_ready("a", "main-decode-1"), "main-decode-1", landings, wan)  # the failed attempt's
    file_late_kv_ready(kv_ready("ar1", "main-decode-0"), "main-decode-0", landings, wan)  # not its decoder
    assert wan.main_decode_of("a") == "main-decode-1" and wan.bandwidth_bps == 100e6
    assert landings.of(["a"]) == {}
    file_late_kv_ready(kv_ready("ar1", "main-decode-1"), "main-decode-1", landings, wan)
    assert wan.main_decode_of("a") is None  # the link is free for the next placement
    assert wan.current().queue_s == 0
    assert wan.bandwidth_bps == 200e6  # the first sample of a flow that had the link alone
    assert landings.of(["a"])["a"].landed_unix_s == 1000.0
    # Attempt ar1 fails in turn and the request is placed again on the same decoder: ar1 is
    # superseded before the new flow is placed (``expect`` names the new attempt only at its
    # dispatch), so a late landing of ar1 leaves the new flow on the ledger.
    landings.supersede("ar1")
    wan.flow_placed("a", "main-decode-1", hash_blocks(list(range(64)), 16), num_bytes, prefill_s=0.1)
    file_late_kv_ready(kv_ready("ar1", "main-decode-1"), "main-decode-1", landings, wan)
    assert wan.main_decode_of("a") == "main-decode-1"


def test_kv_sent_to_a_main_decoder_at_the_prefills_own_site_is_not_counted_as_the_wans():
    prefill = InstanceRef(instance_id="prefill-0", site="site-a")
    here, there = (InstanceRef(instance_id=f"main-decode-{i}", site=s) for i, s in enumerate(("site-a", "site-b")))
    common = {"pipeline": "P-MD", "prefill": prefill, "relay_decode": None, "md_cached_blocks": 0}
    common |= {"md_load_blocks": 0, "num_prompt_blocks": 4, "missing_kv_bytes": 4096, "predicted_wan_s": 0.0}
    assert not Placement(main_decode=here, **common).kv_crosses_sites
    assert Placement(main_decode=there, **common).kv_crosses_sites
    assert not Placement(**{**common, "pipeline": "P-RLD"}, main_decode=None).kv_crosses_sites
    landings = KvLandings()
    landings.expect("local", "local", "main-decode-0", crosses_sites=False)
    landings.expect("remote", "remote", "main-decode-1", crosses_sites=True)
    landings.landed("local", "main-decode-0", landed_unix_s=10.0, wan_kv_bytes=4096)
    landings.landed("remote", "main-decode-1", landed_unix_s=10.0, wan_kv_bytes=4096)
    found = landings.of(["local", "remote"])
    assert found["local"].as_json()["wan_kv_bytes"] == 0  # landed, but over no WAN
    assert found["remote"].as_json()["wan_kv_bytes"] == 4096


async def test_a_main_decoder_beside_the_prefill_takes_its_kv_off_the_wan(make_stack, tiny):
    """Main decode at site A, beside the prefill (as the same-site baseline), on a 1 Mbit/s
    link that would make any cross-site main decoder's KV seconds late: the answer is exact,
    placement sends it P-MD with nothing predicted on the link, the response reports no WAN
    bytes, and the prefill and the main decoder both count the flow as the local network's."""
    from prometheus_client import REGISTRY

    def kv_bytes() -> dict[tuple[str, str], float]:
        return {
            (path, direction): REGISTRY.get_sample_value("pdd_kv_bytes_total", {"path": path, "direction": direction})
            or 0.0
            for path in ("wan", "local")
            for direction in ("sent", "received")
        }

    stack = await make_stack(profile=LinkProfile(bandwidth_bps=1e6, rtt_ms=40, jitter_ms=0, seed=3), md_site="site-a")
    messages = [{"role": "user", "content": "Describe a harbour at dawn. " * 30}]
    before = kv_bytes()
    status, body = await post(stack, "/chat/completions", {**chat_body("", 8), "messages": messages})
    after = kv_bytes()
    assert status == 200, body
    text, _ = reference_chat_answer(tiny, messages, 8, ignore_eos=True)
    assert body["choices"][0]["message"]["content"] == text
    pdd = body["pdd"]
    assert pdd["pipeline"] == "P-MD" and pdd["predicted_wan_ms"] == 0 and pdd["wan_kv_bytes"] == 0, pdd
    prompt_kv = pdd["prompt_tokens"] * stack.metadata.kv_bytes_per_token
    assert after["local", "sent"] - before["local", "sent"] >= prompt_kv
    assert after["local", "received"] - before["local", "received"] >= prompt_kv
    assert after["wan", "sent"] == before["wan", "sent"] and after["wan", "received"] == before["wan", "received"]


async def test_the_holder_of_a_relayed_request_learns_when_its_kv_landed(make_stack):
    """The relay's one-token answer is sent before the prefill's reply and before the KV lands
    at main decode; the router keeps both for whoever holds the request id, and the benchmark
    turns them into the request's time from the end of the prefill to the last KV byte."""
    from loadtest.bench import fill_late_landings, kv_timing
    from loadtest.client import RequestRecord

    stack = await make_stack(
        profile=LinkProfile(bandwidth_bps=5e6, rtt_ms=20, jitter_ms=0, seed=4),
        engine_settings={"frame_tokens": 16},
        router_settings={"pipeline_policy": "P-RLD-MD"},
    )
    status, body = await post(stack, "/chat/completions", chat_body("Describe a harbour. " * 140, 1))
    assert status == 200 and body["pdd"]["finished_on"] == "RLD", body["pdd"]
    assert body["pdd"]["kv_after_prefill_ms"] is None
    await until(lambda: stack.router.kv_landings.of([body["id"]]), timeout_s=30, what="the late KvReady")
    status, reply = await post(stack, "/pdd/kv-landings", {"ids": [body["id"], "not-a-request"]})
    assert status == 200 and set(reply["landings"]) == {body["id"]}, reply
    landing = reply["landings"][body["id"]]
    computed_unix_s = landing["prefill_computed_unix_s"]  # kept even when the reply came after the answer
    assert landing["landed_unix_s"] > computed_unix_s > 0 and landing["wan_kv_bytes"] > 0, landing
    assert landing["kv_after_prefill_ms"] == round((landing["landed_unix_s"] - computed_unix_s) * 1000, 1)
    record = RequestRecord(session=0, turn=0, kind="cold", request_id=body["id"], pdd=body["pdd"])
    assert await asyncio.to_thread(fill_late_landings, stack.base_url, [record]) == 1
    late = record.pdd["kv_landed_after_answer"]
    assert late["after_prefill_ms"] == landing["kv_after_prefill_ms"]
    timing = kv_timing([record], link_bps=5e6, rtt_s=0.02)
    assert timing["kv_after_prefill_ms"]["requests"] == 1 and timing["kv_after_prefill_ms"]["p50"] > 0
    status, reply = await post(stack, "/pdd/kv-landings", {"ids": "not a list"})
    assert status == 400 and reply["error"]["param"] == "ids", reply


async def test_kv_that_lands_after_the_relay_answered_still_teaches_the_link(make_stack):
    """Every request relayed (its answer done before its KV lands): the flows' late
    ``KvReady`` are the router's only samples of the link, and it learns from them."""
    stack = await make_stack(
        profile=LinkProfile(bandwidth_bps=5e6, rtt_ms=20, jitter_ms=0, seed=4),
        engine_settings={"frame_tokens": 16},
        router_settings={"pipeline_policy": "P-RLD-MD", "wan_bandwidth_mbit": 100, "wan_rtt_ms": 20},
    )
    status, body = await post(stack, "/chat/completions", chat_body("Describe a harbour. " * 140, 1))
    assert status == 200 and body["pdd"]["finished_on"] == "RLD", body["pdd"]
    wan = stack.router.wan
    await until(lambda: wan.bandwidth_samples > 0, timeout_s=30, what="a sample from the late KvReady")
    assert 3.5e6 <= wan.bandwidth_bps <= 6.5e6, wan.bandwidth_bps
    assert wan.main_decode_of(body["id"]) is None  # off the ledger as it landed, not when planned
