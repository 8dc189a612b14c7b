"""Which instances the router picks: prefix hits against load, both counted in KV blocks."""

import time

import pytest

from services.router.placement import place
from services.router.registry import InstanceRegistry
from services.router.wan_estimate import Arriving, WanEstimate
from shared.block_hash import hash_blocks
from shared.messages import InstanceRef, LoadReported

BLOCK_SIZE = 16
FAST_WAN = WanEstimate(bandwidth_bps=1e9, rtt_s=0.001)


def registry_with(*, main_decodes: int, used_blocks: dict[str, int] | None = None) -> InstanceRegistry:
    registry = InstanceRegistry(ttl_s=60)
    instances = [("prefill-0", "prefill")] + [(f"main-decode-{i}", "main_decode") for i in range(main_decodes)]
    for instance_id, service in instances:
        registry.observe(
            LoadReported(
                instance=InstanceRef(instance_id=instance_id, site="site-b" if service == "main_decode" else "site-a"),
                service=service,
                used_blocks=(used_blocks or {}).get(instance_id, 0),
                total_blocks=1000,
                unix_s=time.time(),
            )
        )
    return registry


def route(registry: InstanceRegistry, hits: dict[str, int], num_prompt_tokens: int) -> str:
    """Place one request the way the router does, and count it as running."""
    placement = place(
        registry,
        hits,
        num_prompt_tokens=num_prompt_tokens,
        block_size=BLOCK_SIZE,
        kv_bytes_per_token=100,
        wan=FAST_WAN,
        ttft_target_s=1.0,
    )
    registry.assign(placement.instance_ids, placement.num_prompt_blocks)
    return placement.main_decode.instance_id


def test_a_shared_system_prompt_does_not_pin_a_busy_decoder():
    registry = registry_with(main_decodes=2)
    assert route(registry, {}, 40) == "main-decode-0"
    # Every later prompt starts with the same system-prompt block, now cached on main-decode-0;
    # the 3 blocks it is busy with outweigh the 1 block the hit saves.
    assert route(registry, {"main-decode-0": 1}, 40) == "main-decode-1"
    assert route(registry, {"main-decode-0": 1, "main-decode-1": 1}, 40) == "main-decode-0"


def test_a_long_cached_prefix_keeps_its_conversation_on_a_somewhat_busier_decoder():
    registry = registry_with(main_decodes=2, used_blocks={"main-decode-0": 20})
    assert route(registry, {"main-decode-0": 30}, 33 * BLOCK_SIZE) == "main-decode-0"


def test_load_reported_by_a_heartbeat_counts_before_this_router_placed_anything():
    registry = registry_with(main_decodes=2, used_blocks={"main-decode-0": 50})
    assert route(registry, {"main-decode-0": 2}, 40) == "main-decode-1"


def test_idle_decoders_take_turns_and_finished_requests_stop_counting():
    registry = registry_with(main_decodes=3)
    chosen = []
    for _ in range(6):
        chosen.append(route(registry, {}, 40))
        registry.release(["prefill-0", chosen[-1]], 3)
    assert chosen == ["main-decode-0", "main-decode-1", "main-decode-2"] * 2
    assert all(s.assigned == 0 and s.assigned_blocks == 0 for s in registry.live("main_decode"))


def test_a_heartbeat_from_before_a_request_finished_does_not_keep_its_load():
    registry = registry_with(main_decodes=2)
    assert route(registry, {}, 40) == "main-decode-0"
    # Main-decode-0's heartbeat still shows the request (its output grew it to 40 blocks)...
    registry.observe(
        LoadReported(
            instance=InstanceRef(instance_id="main-decode-0", site="site-b"),
            service="main_decode",
            used_blocks=40,
            unix_s=time.time(),
        )
    )
    registry.release(["prefill-0", "main-decode-0"], 3)
    # ...but the router saw it finish, and main-decode-0 holds the prompt's first block.
    assert route(registry, {"main-decode-0": 1}, 40) == "main-decode-0"


def heartbeat(instance_id: str, service: str, free_blocks: int) -> LoadReported:
    site = "site-a" if service == "prefill" else "site-b"
    instance = InstanceRef(instance_id=instance_id, site=site)
    return LoadReported(
        instance=instance, service=service, total_blocks=1000, free_blocks=free_blocks, unix_s=time.time()
    )


def test_two_routers_spread_cold_prompts_by_the_spare_blocks_instances_report():
    fleet = {"prefill-0": "prefill", "prefill-1": "prefill", "main-decode-0": "main_decode"}
    fleet["main-decode-1"] = "main_decode"
    routers = [InstanceRegistry(ttl_s=60, router_id=f"router-{name}") for name in "ab"]
    free = dict.fromkeys(fleet, 1000)
    used = []
    for turn in range(4):  # cold prompts one after another, the routers taking turns
        for registry in routers:
            for instance_id, service in fleet.items():
                registry.observe(heartbeat(instance_id, service, free[instance_id]))
        registry = routers[turn % 2]
        placement = place(
            registry,
            {},
            num_prompt_tokens=40,
            block_size=BLOCK_SIZE,
            kv_bytes_per_token=100,
            wan=FAST_WAN,
            ttft_target_s=1.0,
        )
        registry.assign(placement.instance_ids, placement.num_prompt_blocks, placement.compute_blocks)
        registry.release(placement.instance_ids, placement.num_prompt_blocks, placement.compute_blocks)
        used.append((placement.prefill.instance_id, placement.main_decode.instance_id))
        for instance_id in used[-1]:
            free[instance_id] -= 3 + turn  # each prompt stays cached where it ran
    # Each router alone would start on instance 0: router b's first prompt went there too.
    assert used[:2] == [("prefill-0", "main-decode-0"), ("prefill-1", "main-decode-1")]
    assert sorted(used[2:]) == [("prefill-0", "main-decode-0"), ("prefill-1", "main-decode-1")]


def prefill_registry(prefills: int, pending_tokens: dict[str, int] | None = None) -> InstanceRegistry:
    registry = registry_with(main_decodes=1)
    for i in range(1, prefills):
        registry.observe(
            LoadReported(
                instance=InstanceRef(instance_id=f"prefill-{i}", site="site-a"),
                service="prefill",
                total_blocks=1000,
                unix_s=time.time(),
            )
        )
    for instance_id, tokens in (pending_tokens or {}).items():
        registry.observe(
            LoadReported(
                instance=InstanceRef(instance_id=instance_id, site="site-a"),
                service="prefill",
                total_blocks=1000,
                pending_tokens=tokens,
                unix_s=time.time(),
            )
        )
    return registry


def route_prefill(registry: InstanceRegistry, hits: dict[str, int], num_prompt_tokens: int) -> str:
    placement = place(
        registry,
        hits,
        num_prompt_tokens=num_prompt_tokens,
        block_size=BLOCK_SIZE,
        kv_bytes_per_token=100,
        wan=FAST_WAN,
        ttft_target_s=1.0,
    )
    registry.assign(placement.instance_ids, placement.num_prompt_blocks, placement.compute_blocks)
    return placement.prefill.instance_id


def test_a_conversation_stays_on_the_prefill_that_caches_it_while_it_prefills_another():
    # Two 64K-token conversations, both cached on prefill-0 but for their last 2 % (the blocks
    # a turn adds). Counted by blocks held, the first one's 4,096 made prefill-0 look dearer than
    # recomputing the whole second prompt on idle prefill-1; counted by work, it computes 80 blocks.
    registry = prefill_registry(prefills=2)
    assert route_prefill(registry, {"prefill-0": 4016}, 4096 * BLOCK_SIZE) == "prefill-0"
    assert route_prefill(registry, {"prefill-0": 4016}, 4096 * BLOCK_SIZE) == "prefill-0"
    # a cold prompt goes where no work is queued
    assert route_prefill(registry, {}, 4096 * BLOCK_SIZE) == "prefill-1"


def test_a_prefill_whose_heartbeat_reports_queued_work_is_avoided_for_a_cold_prompt():
    registry = prefill_registry(prefills=2, pending_tokens={"prefill-0": 2000 * BLOCK_SIZE})
    assert route_prefill(registry, {}, 100 * BLOCK_SIZE) == "prefill-1"
    # a long cached prefix there still outweighs that queue
    assert route_prefill(registry, {"prefill-0": 3000}, 3100 * BLOCK_SIZE) == "prefill-0"


def test_prefill_work_stops_counting_when_its_prefill_completes():
    registry = prefill_registry(prefills=2)
    placement = place(
        registry,
        {},
        num_prompt_tokens=40 * BLOCK_SIZE,
        block_size=BLOCK_SIZE,
        kv_bytes_per_token=100,
        wan=FAST_WAN,
        ttft_target_s=1.0,
    )
    registry.assign(placement.instance_ids, placement.num_prompt_blocks, placement.compute_blocks)
    state = next(s for s in registry.live("prefill") if s.report.instance.instance_id == "prefill-0")
    assert placement.prefill_compute_blocks == 40 and state.pending_compute_blocks(BLOCK_SIZE) == 40
    registry.release(["prefill-0"], placement.num_prompt_blocks, placement.compute_blocks)
    assert state.pending_compute_blocks(BLOCK_SIZE) == 0 and state.assigned_compute_blocks == 0


def relay_registry(main_decodes: int) -> InstanceRegistry:
    registry = registry_with(main_decodes=main_decodes)
    registry.observe(
        LoadReported(
            instance=InstanceRef(instance_id="relay-decode-0", site="site-a"),
            service="relay_decode",
            unix_s=time.time(),
        )
    )
    return registry


def test_a_recovery_avoids_the_failed_decoder_unless_it_is_the_only_one():
    two = registry_with(main_decodes=2)
    for hits in ({}, {"main-decode-0": 5}):
        placement = place(
            two,
            hits,
            num_prompt_tokens=80,
            block_size=BLOCK_SIZE,
            kv_bytes_per_token=100,
            wan=FAST_WAN,
            ttft_target_s=1.0,
            avoid=frozenset({"main-decode-0"}),
        )
        assert placement.main_decode.instance_id == "main-decode-1"
    one = registry_with(main_decodes=1)
    placement = place(
        one,
        {},
        num_prompt_tokens=80,
        block_size=BLOCK_SIZE,
        kv_bytes_per_token=100,
        wan=FAST_WAN,
        ttft_target_s=1.0,
        avoid=frozenset({"main-decode-0"}),
    )
    assert placement.main_decode.instance_id == "main-decode-0"


def test_without_a_live_main_decoder_the_relay_serves_alone():
    placement = place(
        relay_registry(main_decodes=0),
        {},
        num_prompt_tokens=80,
        block_size=BLOCK_SIZE,
        kv_bytes_per_token=100,
        wan=FAST_WAN,
        ttft_target_s=1.0,
        policy="P-MD",
    )
    assert placement.pipeline == "P-RLD" and placement.main_decode is None
    assert placement.relay_decode.instance_id == "relay-decode-0"
    with_main = place(
        relay_registry(main_decodes=1),
        {},
        num_prompt_tokens=80,
        block_size=BLOCK_SIZE,
        kv_bytes_per_token=100,
        wan=FAST_WAN,
        ttft_target_s=1.0,
    )
    assert with_main.pipeline == "P-MD"


def test_a_conversation_stays_on_the_decoder_whose_cache_keeps_its_kv_off_the_wan():
    # 64K-token context: the cached decoder's requests hold more blocks than the prompt has, the
    # other decoder is idle but lacks the whole prompt (8.6 GB, 2.7 s on this link, past the target)
    registry = registry_with(main_decodes=2, used_blocks={"main-decode-0": 4000})
    slow_wan = WanEstimate(bandwidth_bps=25e9, rtt_s=0.02)
    placement = place(
        registry,
        {"main-decode-0": 3800},
        num_prompt_tokens=4096 * BLOCK_SIZE,
        block_size=BLOCK_SIZE,
        kv_bytes_per_token=2 * 65536,
        wan=slow_wan,
        ttft_target_s=0.5,
    )
    assert placement.main_decode.instance_id == "main-decode-0"
    assert placement.predicted_wan_s <= 0.5
    # without a decoder that could take it in time, the cheaper one in blocks still wins
    far = place(
        registry,
        {"main-decode-0": 1000},
        num_prompt_tokens=4096 * BLOCK_SIZE,
        block_size=BLOCK_SIZE,
        kv_bytes_per_token=2 * 65536,
        wan=slow_wan,
        ttft_target_s=0.5,
    )
    assert far.main_decode.instance_id == "main-decode-1"


def pipeline_for(
    prefill_report: dict, num_prompt_tokens: int, crossing_bytes: float = 0.0, hits: dict[str, int] | None = None
) -> tuple[str, float]:
    """The pipeline and predicted arrival of a prompt on a 100 Mbit/s, 40 ms link (KV of 46 KB
    per token, SmolLM2's) where a flow placed before still has ``crossing_bytes`` to send, the
    prefill reporting ``prefill_report``, the instances holding ``hits`` leading blocks (none:
    a cold prompt)."""
    registry = InstanceRegistry(ttl_s=60)
    for instance_id, service, extra in (
        ("prefill-0", "prefill", prefill_report),
        ("main-decode-0", "main_decode", {}),
        ("relay-decode-0", "relay_decode", {}),
    ):
        report = LoadReported(
            instance=InstanceRef(instance_id=instance_id, site="site-b" if service == "main_decode" else "site-a"),
            service=service,
            total_blocks=1000,
            unix_s=time.time(),
            **extra,
        )
        registry.observe(report)
    crossing = (crossing_bytes,) if crossing_bytes else ()
    wan = WanEstimate(bandwidth_bps=100e6, rtt_s=0.040, queue_s=crossing_bytes * 8 / 100e6, crossing_bytes=crossing)
    placement = place(
        registry,
        hits or {},
        num_prompt_tokens=num_prompt_tokens,
        block_size=BLOCK_SIZE,
        kv_bytes_per_token=46080,
        wan=wan,
        ttft_target_s=0.5,
    )
    return placement.pipeline, placement.predicted_wan_s


def test_kv_shipped_while_the_prompt_computes_lands_soon_after_the_prefill():
    tokens, rate, chunk = 704, 300.0, 64  # 2.3 s of compute; 32 MB, 2.6 s on the link
    transfer_s, prefill_s = tokens * 46080 * 8 / 100e6, tokens / rate
    pipeline, arrival_s = pipeline_for({"prefill_tokens_per_s": rate, "prefill_first_chunk_tokens": chunk}, tokens)
    # the link starts with the first chunk: it runs past the prefill by what it lags behind
    assert arrival_s == pytest.approx(chunk / rate + transfer_s - prefill_s + 0.020)
    assert pipeline == "P-MD"  # within the target: no relay needed
    # the same prompt before the prefill reported its rate: the whole transfer after a handshake
    pipeline, arrival_s = pipeline_for({}, tokens)
    assert arrival_s == pytest.approx(0.040 + transfer_s + 0.020)
    assert pipeline == "P-RLD-MD"
    # a prefill that computes the prompt in one step ships it all after its compute
    pipeline, arrival_s = pipeline_for({"prefill_tokens_per_s": rate, "prefill_first_chunk_tokens": 2048}, tokens)
    assert arrival_s == pytest.approx(transfer_s + 0.020) and pipeline == "P-RLD-MD"


def test_a_follow_up_turns_new_tail_crosses_only_once_the_chunk_that_computes_it_is_done():
    """The decoder holds the conversation up to the new tail. The prefill holds less (the last
    answer was decoded elsewhere), so it computes more than the decoder lacks: the missing
    blocks come out of its later chunks, and cannot overlap the earlier ones."""
    report = {"prefill_tokens_per_s": 600.0, "prefill_first_chunk_tokens": 64, "prefill_chunk_tokens": 256}
    tokens, prefill_holds, decoder_holds = 80 * BLOCK_SIZE, 53 * BLOCK_SIZE, 68 * BLOCK_SIZE
    hits = {"prefill-0": prefill_holds // BLOCK_SIZE, "main-decode-0": decoder_holds // BLOCK_SIZE}
    pipeline, arrival_s = pipeline_for(report, tokens, hits=hits)
    # chunks of 64, 256 and 112 tokens; the decoder lacks tokens from the second chunk on
    prefill_s = (tokens - prefill_holds) / 600.0
    ready_s = (64 + 256) / 600.0
    assert prefill_holds + 64 <= decoder_holds < prefill_holds + 64 + 256
    transfer_s = (tokens - decoder_holds) * 46080 * 8 / 100e6
    assert arrival_s == pytest.approx(ready_s + transfer_s - prefill_s + 0.020)
    assert pipeline == "P-RLD-MD"  # 0.54 s: past the target (overlapped from the first chunk: 0.12 s)
    # the last chunk's 112 tokens alone cross after the compute: 0.41 s, within it
    pipeline, arrival_s = pipeline_for(report, tokens, hits={**hits, "main-decode-0": 73})
    assert arrival_s == pytest.approx(112 * 46080 * 8 / 100e6 + 0.020)
    assert pipeline == "P-MD"


def test_a_cold_prompt_that_fits_an_idle_link_is_relayed_when_it_waits_for_an_earlier_flow():
    """Two cold prompts in a row: the first's KV overlaps its prefill; the second, placed while
    the first's bytes still cross, waits for them if they are fewer than its own (the link
    serves the flow with the least left first) and goes ahead of them if not."""
    report = {"prefill_tokens_per_s": 250.0, "prefill_first_chunk_tokens": 64}
    tokens = 704  # 2.8 s of compute, 32 MB: 2.6 s on the link, shipped as it computes
    alone = pipeline_for(report, tokens)
    assert alone[0] == "P-MD"
    first_byte_s, own_bytes = 64 / 250.0, tokens * 46080
    earlier_bytes = 1.5 * 100e6 / 8  # the flow before still has 1.5 s of KV to send
    pipeline, arrival_s = pipeline_for(report, tokens, crossing_bytes=earlier_bytes)
    earlier_left = earlier_bytes - first_byte_s * 100e6 / 8  # by the new flow's first byte
    assert earlier_left < own_bytes
    last_byte_s = first_byte_s + (own_bytes + earlier_left) * 8 / 100e6
    assert arrival_s == pytest.approx(last_byte_s - tokens / 250.0 + 0.020)
    assert pipeline == "P-RLD-MD"
    # an earlier flow with more left than the new one's 32 MB waits for it instead
    assert pipeline_for(report, tokens, crossing_bytes=3.0 * 100e6 / 8) == pytest.approx(alone)


def test_a_follow_up_turn_counts_only_its_new_blocks_when_the_earlier_ones_are_on_their_way():
    """The first turn's KV is still crossing to main-decode-1: the second turn goes there, its
    missing bytes are its new blocks only, and it is ready no earlier than they land."""
    registry = InstanceRegistry(ttl_s=60)
    for instance_id, service in (
        ("prefill-0", "prefill"),
        ("main-decode-0", "main_decode"),
        ("main-decode-1", "main_decode"),
        ("relay-decode-0", "relay_decode"),
    ):
        registry.observe(
            LoadReported(
                instance=InstanceRef(instance_id=instance_id, site="site-b" if service == "main_decode" else "site-a"),
                service=service,
                total_blocks=1000,
                prefill_tokens_per_s=400.0 if service == "prefill" else 0.0,
                unix_s=time.time(),
            )
        )
    wan = WanEstimate(bandwidth_bps=100e6, rtt_s=0.040)
    kwargs = {"num_prompt_tokens": 50 * BLOCK_SIZE, "block_size": BLOCK_SIZE, "kv_bytes_per_token": 46080, "wan": wan}
    cold = place(registry, {}, ttft_target_s=0.5, **kwargs)
    assert cold.missing_kv_bytes == 50 * BLOCK_SIZE * 46080
    # the prefill computes all 50 blocks in 2.0 s; the 48 on their way land 2.2 s from now
    soon = {"main-decode-1": Arriving(blocks=48, lands_in_s=2.2)}
    warm = place(registry, {}, ttft_target_s=0.5, arriving=soon, **kwargs)
    assert warm.main_decode.instance_id == "main-decode-1"
    assert warm.missing_kv_bytes == 2 * BLOCK_SIZE * 46080
    assert warm.predicted_wan_s == pytest.approx(2.2 - 2.0)  # the 2 new blocks alone would be sooner
    assert warm.pipeline == "P-MD"
    late = {"main-decode-1": Arriving(blocks=48, lands_in_s=60.0)}
    assert place(registry, {}, ttft_target_s=0.5, arriving=late, **kwargs).pipeline == "P-RLD-MD"


async def test_a_recovery_onto_a_decoder_beside_the_prefill_takes_the_first_attempts_flow_off_the_link():
    from services.router.openai_api import ParsedRequest
    from services.router.placer import Placer
    from services.router.site_health import SiteHealth
    from services.router.wan_estimate import WanEstimator
    from shared.config import RouterConfig, build_config
    from shared.engine.sampling import SamplingParams

    registry = InstanceRegistry(ttl_s=60)
    for instance_id, service, site in [
        ("prefill-0", "prefill", "site-a"),
        ("main-decode-0", "main_decode", "site-b"),
        ("main-decode-1", "main_decode", "site-a"),
    ]:
        instance = InstanceRef(instance_id=instance_id, site=site)
        registry.observe(LoadReported(instance=instance, service=service, total_blocks=1000, unix_s=time.time()))
    config = build_config(RouterConfig, {"pipeline_policy": "P-MD"}, {})
    wan = WanEstimator(bandwidth_bps=1e6, rtt_s=0.04)
    placer = Placer(config, registry, SiteHealth(registry, "site-a", 60), wan, kv_bytes_per_token=1000)

    async def no_index(hashes):
        return {}

    placer._overlap = no_index  # no cache index in this test: placement on load alone
    req = ParsedRequest(True, "tiny", list(range(64)), SamplingParams(max_tokens=4))
    first = await placer.place(req, "router-0-r", avoid=frozenset({"main-decode-1"}))
    assert first.kv_crosses_sites and wan.current().queue_s > 0  # 64 KB at 1 Mbit/s on the ledger
    again = await placer.place(req, "router-0-r", avoid=frozenset({"main-decode-0"}))
    assert not again.kv_crosses_sites
    assert wan.current().queue_s == 0 and wan.arriving(hash_blocks(list(range(64)), 16)) == {}


def test_kv_for_a_decoder_beside_the_prefill_is_not_predicted_to_cross_the_link():
    """A cold 64-block prompt on a 10 Mbit/s link: the far decoder's KV lands seconds after the
    prefill, so it would need a relay; a decoder at the prefill's site gets it on the local path."""
    registry = InstanceRegistry(ttl_s=60)
    for instance_id, service, site in (
        ("prefill-0", "prefill", "site-a"),
        ("main-decode-0", "main_decode", "site-b"),
        ("relay-decode-0", "relay_decode", "site-a"),
    ):
        instance = InstanceRef(instance_id=instance_id, site=site)
        registry.observe(LoadReported(instance=instance, service=service, total_blocks=1000, unix_s=time.time()))
    kwargs = {
        "num_prompt_tokens": 64 * BLOCK_SIZE,
        "block_size": BLOCK_SIZE,
        "kv_bytes_per_token": 46080,
        "wan": WanEstimate(bandwidth_bps=10e6, rtt_s=0.040),
        "ttft_target_s": 0.5,
    }
    far = place(registry, {}, **kwargs)
    assert far.kv_crosses_sites and far.pipeline == "P-RLD-MD" and far.predicted_wan_s > 30
    beside = InstanceRef(instance_id="main-decode-1", site="site-a")
    registry.observe(LoadReported(instance=beside, service="main_decode", total_blocks=1000, unix_s=time.time()))
    near = place(registry, {}, **kwargs)
    assert near.main_decode.instance_id == "main-decode-1" and not near.kv_crosses_sites
    assert near.predicted_wan_s == 0 and near.pipeline == "P-MD"
