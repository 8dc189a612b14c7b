"""Deployments on data-centre chips: the four designs the paper compares, built from a chip
pair, a model, a link and instance counts, and evaluated on a workload through the simulator."""

from collections.abc import Callable
from dataclasses import dataclass, field, replace

from loadtest.sim.cost_model import Efficiency, RooflineCostModel, chip, model
from loadtest.sim.deployment import Deployment, RolePool
from loadtest.sim.network import LinkSpec
from loadtest.sim.simulator import Simulator
from loadtest.sim.workload import PRESETS, Preset, Workload, synthetic

DESIGNS = ("same-dc-pd", "cross-dc-pd", "cross-dc-pd-drc", "pdd")
"""Same-datacenter homogeneous PD on chip A; cross-datacenter PD (main decode on chip B, the
whole missed prompt over the WAN, no decode-side cache); the same with the decode-side cache;
PDD (chip A for prefill and relay, chip B for main decode)."""


@dataclass(frozen=True)
class Sla:
    """The service level: TTFT and inter-token latency at a percentile.

    A deployment meets it when, over the measured window, that percentile of TTFT (a request
    unfinished at the end counts as missing it) and of every inter-token gap are within the
    bounds. A request counts as goodput when its own TTFT and its own gaps at that
    percentile are.

    Attributes:
        ttft_s: TTFT bound.
        itl_s: Inter-token gap bound.
        quantile: The percentile, as a fraction (0.99: P99).
    """

    ttft_s: float = 10.0
    itl_s: float = 0.1
    quantile: float = 0.99

    def request_ok(self, request) -> bool:
        """Whether one finished request counts as goodput."""
        return request.ttft_s <= self.ttft_s and gap_quantile(request.gaps, self.quantile) <= self.itl_s


def gap_quantile(gaps: list, quantile: float) -> float:
    """The ``quantile`` of ``(gap_s, count)`` pairs (0 without gaps)."""
    if not gaps:
        return 0.0
    ordered = sorted(gaps)
    total = sum(n for _, n in ordered)
    seen = 0
    for gap, count in ordered:
        seen += count
        if seen >= quantile * total:
            return gap
    return ordered[-1][0]


@dataclass(frozen=True)
class Setting:
    """Everything but the counts.

    Attributes:
        chip_a: Prefill (and relay, and same-datacenter decode) chip.
        chip_b: Cross-datacenter main decode chip.
        model: Model served.
        link: The WAN line between the datacenters.
        block_size: Tokens per simulated KV block (coarser than an engine's: same hits, fewer objects).
        efficiency: Roofline assumptions.
        cache_tier_bytes: Host-memory cache tier per instance for idle prefixes.
        rdma_bytes_per_s: Same-datacenter transfer rate (the local path).
        max_batch_tokens: Chunked prefill's token budget per step.
        price_b: Chip B's relative price (None: the catalogue's).
        request_tokens: A typical request's prompt and output: each instance's ``max_sequences``
            is what its KV pool holds of them (as an engine would be configured).
        chips_a: Chips in one instance of chip A (0: the fewest, a power of two, whose memory
            holds the weights and ``MIN_REQUESTS_PER_INSTANCE`` typical requests).
        chips_b: The same for chip B.
        max_prefill_requests: Requests whose prompt chunks share a step (0: as many as the
            budget takes; 1: one request at a time, so a small tail chunk runs alone).
    """

    chip_a: str = "H100-SXM"
    chip_b: str = "H200-SXM"
    model: str = "llama-3.1-8b-fp8kv"
    link: LinkSpec = field(default_factory=lambda: LinkSpec(25e9, 0.02, 0.002, 64 << 20))
    block_size: int = 256
    efficiency: Efficiency = field(default_factory=Efficiency)
    cache_tier_bytes: float = 256e9
    rdma_bytes_per_s: float = 50e9
    max_batch_tokens: int = 8192
    price_b: float | None = None
    request_tokens: int = 66560
    chips_a: int = 0
    chips_b: int = 0
    max_prefill_requests: int = 0


MIN_REQUESTS_PER_INSTANCE = 8
"""An instance too small to hold this many typical requests' KV is not deployed: a group of
chips (tensor or expert parallel) is."""


def instance_chips(setting: Setting, chip_name: str) -> int:
    """Chips in one instance of ``chip_name`` (``Setting.chips_a`` / ``chips_b``, or the fewest
    powers of two that hold the weights and ``MIN_REQUESTS_PER_INSTANCE`` typical requests)."""
    given = setting.chips_a if chip_name == setting.chip_a else setting.chips_b
    if given:
        return given
    spec, served = chip(chip_name), model(setting.model)
    need = (
        served.weight_bytes
        + MIN_REQUESTS_PER_INSTANCE
        * setting.request_tokens
        * served.kv_bytes_per_token
        / setting.efficiency.kv_memory_share
    )
    chips = 1
    while chips * spec.hbm_bytes < need and chips < 64:
        chips *= 2
    return chips


@dataclass(frozen=True)
class Counts:
    """Instances per service (each of ``instance_chips`` chips)."""

    prefill: int
    relay_decode: int
    main_decode: int

    def bump(self, role: str, delta: int) -> "Counts":
        """These counts with ``role`` changed by ``delta``."""
        return replace(self, **{role: getattr(self, role) + delta})


def _role(setting: Setting, chip_name: str, count: int, price: float | None) -> RolePool:
    spec, chips = chip(chip_name, price), instance_chips(setting, chip_name)
    cost = RooflineCostModel(
        spec, model(setting.model), setting.efficiency, setting.max_batch_tokens, chips, setting.max_prefill_requests
    )
    pool_blocks = cost.kv_capacity_tokens // setting.block_size
    max_sequences = max(1, cost.kv_capacity_tokens // setting.request_tokens)
    return RolePool(
        count, cost, pool_blocks, max_sequences=max_sequences, price=spec.price * chips, chip=chip_name, chips=chips
    )


def build(design: str, counts: Counts, setting: Setting) -> Deployment:
    """The deployment of ``design`` with ``counts``."""
    decode_chip = setting.chip_a if design == "same-dc-pd" else setting.chip_b
    decode_price = None if design == "same-dc-pd" else setting.price_b
    relays = counts.relay_decode if design == "pdd" else 0
    spec = model(setting.model)
    tier = int(setting.cache_tier_bytes // (spec.kv_bytes_per_token * setting.block_size))
    return Deployment(
        _role(setting, setting.chip_a, counts.prefill, None),
        _role(setting, setting.chip_a, relays, None),
        _role(setting, decode_chip, counts.main_decode, decode_price),
        setting.link,
        setting.block_size,
        spec.kv_bytes_per_token,
        md_site="site-a" if design == "same-dc-pd" else "site-b",
        pipeline_policy="auto" if design == "pdd" else "P-MD",
        md_prefix_cache=design != "cross-dc-pd",
        cache_tier_blocks=tier,
        local_bytes_per_s=setting.rdma_bytes_per_s,
        local_latency_s=0.0005,
        initial_wan_bps=setting.link.bandwidth_bps,
        initial_wan_rtt_s=setting.link.rtt_s,
    )


@dataclass
class Evaluation:
    """One design at one rate, measured in steady state.

    Attributes:
        design: Which design.
        counts: Its instances.
        cost: Their price.
        rate_rps: Offered load.
        summary: The simulator's figures over the measured window.
        meets_sla: Whether enough requests met the SLA.
        link_utilisation: WAN bytes per second over the line's rate.
        bottleneck: The busiest service (highest mean busy share).
        busy_share: Mean busy share per service.
        slow_waits: Where the slowest tenth of requests waited (prefill, room at main decode or
            the relay), in seconds.
    """

    design: str
    counts: Counts
    cost: float
    rate_rps: float
    summary: dict
    meets_sla: bool
    link_utilisation: float
    bottleneck: str
    busy_share: dict = field(default_factory=dict)
    slow_waits: dict = field(default_factory=dict)


WorkloadSource = Callable[..., Workload]
"""``(rate_rps=, num_requests=, block_size=, seed=, fixed_hit_rate=) -> Workload``: a preset's
generator, or a trace re-timed to the rate."""


def preset_source(preset: Preset) -> WorkloadSource:
    """Requests drawn from ``preset``."""
    return lambda **kw: synthetic(preset, **kw)


def evaluate(
    design: str,
    counts: Counts,
    setting: Setting,
    source: WorkloadSource,
    rate_rps: float,
    sla: Sla,
    *,
    num_requests: int = 900,
    seed: int = 0,
    fixed_hit_rate: float | None = None,
) -> Evaluation:
    """Simulate ``num_requests`` at ``rate_rps``; judge the requests that arrived after the first
    third (the cluster fills up before that)."""
    deployment = build(design, counts, setting)
    workload = source(
        rate_rps=rate_rps,
        num_requests=num_requests,
        block_size=setting.block_size,
        seed=seed,
        fixed_hit_rate=fixed_hit_rate,
    )
    last_arrival = max(r.start_s for r in workload.requests)
    warmup = last_arrival / 3
    simulator = Simulator(deployment, seed=seed)
    result = simulator.run(workload, until_s=last_arrival + 4 * max(60.0, sla.ttft_s))
    window = last_arrival - warmup
    measured = [r for r in result.requests if r.arrival_s >= warmup]
    arrived = sum(1 for r in workload.requests if r.start_s >= warmup)
    result.requests = measured
    summary = result.summary(sla.ttft_s, sla.itl_s, window_s=window)
    ttft_q = _ttft_quantile(measured, arrived, sla.quantile)
    itl_q = gap_quantile([g for r in measured for g in r.gaps], sla.quantile)
    summary["ttft_quantile_s"], summary["itl_quantile_s"] = ttft_q, itl_q
    summary["goodput_rps"] = round(sum(1 for r in measured if sla.request_ok(r)) / window, 3) if window else 0.0
    busy = _busy_share(simulator)
    return Evaluation(
        design,
        counts,
        deployment.cost,
        rate_rps,
        summary,
        ttft_q <= sla.ttft_s and itl_q <= sla.itl_s,
        _link_utilisation(design, result.wan_bytes, simulator.events.now, setting),
        max(busy, key=busy.get),
        busy,
        _waits(measured),
    )


def _ttft_quantile(measured: list, arrived: int, quantile: float) -> float:
    """The ``quantile`` of the measured requests' TTFTs, each of the ``arrived`` requests that
    did not finish counting as infinite (infinite without any)."""
    ttfts = sorted(r.ttft_s for r in measured) + [float("inf")] * (arrived - len(measured))
    return ttfts[min(len(ttfts) - 1, int(quantile * len(ttfts)))] if ttfts else float("inf")


def _link_utilisation(design: str, wan_bytes: int, elapsed_s: float, setting: Setting) -> float:
    """The WAN line's mean utilisation over ``elapsed_s`` (0 for same-datacenter PD, which does not use it)."""
    return wan_bytes * 8 / max(elapsed_s, 1e-9) / setting.link.bandwidth_bps if design != "same-dc-pd" else 0.0


def _busy_share(simulator: Simulator) -> dict[str, float]:
    """Per service with instances, its engines' mean busy share of the simulated time."""
    return {
        role: round(sum(e.busy_s for e in engines) / len(engines) / max(simulator.events.now, 1e-9), 3)
        for role, engines in simulator.engines.items()
        if engines
    }


def _waits(requests) -> dict:
    """Where the slowest tenth of requests spent their time to first token."""
    slow = sorted(requests, key=lambda r: r.ttft_s)[-max(1, len(requests) // 10) :] if requests else []
    if not slow:
        return {}
    return {
        "prefill_s": sum(r.prefill_done_s for r in slow) / len(slow),
        "main_decode_room_s": sum(r.room_wait_s.get("md", 0.0) for r in slow) / len(slow),
        "relay_room_s": sum(r.room_wait_s.get("relay", 0.0) for r in slow) / len(slow),
        "ttft_s": sum(r.ttft_s for r in slow) / len(slow),
    }


def preset(name: str) -> Preset:
    """A workload preset by name."""
    return PRESETS[name]
