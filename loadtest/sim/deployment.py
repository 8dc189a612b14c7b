"""What is simulated: instance counts and their cost models, pools, the links and the router's
and relay's policies, which come from the system's own configuration classes."""

from dataclasses import dataclass, field

from loadtest.sim.network import LinkSpec
from services.relay_decode.handoff import HandoffPolicy
from services.router.odd_traffic import OddTrafficRule
from shared.config import RelayDecodeConfig, RouterConfig


@dataclass(frozen=True)
class RolePool:
    """Instances of one service.

    Attributes:
        count: How many.
        cost: Their step cost model (``LinearCostModel`` or ``RooflineCostModel``).
        pool_blocks: KV blocks each holds for running requests and cache.
        max_sequences: Requests each holds at once.
        price: Cost of one instance (the planner's unit).
        chip: The chip's name (reports).
        chips: Chips in one instance.
    """

    count: int
    cost: object
    pool_blocks: int
    max_sequences: int = 16
    price: float = 1.0
    chip: str = ""
    chips: int = 1


def router_policy() -> tuple[float, OddTrafficRule, float, float]:
    """The router's defaults: TTFT target, odd-traffic rule, initial WAN estimate (bps, s)."""
    config = RouterConfig()
    rule = OddTrafficRule(
        config.odd_traffic_filter,
        config.odd_max_output_tokens,
        config.relay_step_ms / 1000,
        config.ttft_target_ms / 1000,
    )
    return config.ttft_target_ms / 1000, rule, config.wan_bandwidth_mbit * 1e6, config.wan_rtt_ms / 1000


def handoff_policy() -> HandoffPolicy:
    """The relay's defaults."""
    config = RelayDecodeConfig()
    return HandoffPolicy(
        config.catch_up_threshold_tokens,
        config.final_gap_tokens,
        config.load_watermark,
        config.max_catch_up_chunks,
        config.max_chunk_tokens,
    )


@dataclass(frozen=True)
class Deployment:
    """A deployment to simulate.

    Attributes:
        prefill: Prefill instances (site A).
        relay_decode: Relay instances (site A).
        main_decode: Main decoders (``md_site``).
        link: The WAN between the sites.
        block_size: Tokens per KV block.
        kv_bytes_per_token: KV size of one token.
        md_site: ``site-b`` (across the WAN) or ``site-a`` (the same-site floor).
        pipeline_policy: ``auto`` (PDD) or ``P-MD``.
        md_prefix_cache: Whether main decode keeps a prefix cache (the DRC).
        cache_tier_blocks: Extra cache room per instance for idle chains (a host-memory tier).
        local_bytes_per_s: Local path's rate.
        local_latency_s: Local path's and a same-site message's latency.
        host_cores: Every engine shares this many cores (this machine); None: one chip each.
        threads_per_engine: Threads an engine computes with on a shared host.
        host_speed: Measured speed of an engine while k engines compute (``{"2": 0.4, ...}``).
        step_speeds: Per kind of step, how much slower it runs inside a deployment on this host
            than the cost model says, alone and beside another engine's step (``pdd profile``'s
            ``deployment_steps.kinds``); None: ``host_speed`` alone.
        step_noise: Draw each step's time around its kind's factor with the spread measured
            (a replay is then one of many possible runs; the simulator's seed picks which).
        engine_wake_s: On a shared host, how long an idle engine's loop takes to start a step
            once work arrives (``deployment_steps.wake_s``).
        dispatch_s: How long a request takes from the client to the prefill engine (the
            router's intake and the hops; ``deployment_steps.dispatch``); None: one local
            message's latency.
        dispatch_spread: With ``step_noise``, each request's dispatch is drawn log-normally
            around ``dispatch_s`` with this spread (two prompts sent at once then reach the
            engine apart, as they do).
        engine_thread_io: A flow's opening is our engine's: two engine-thread calls (the
            prefix lookup and ``begin_import``), each after the step then running. False: the
            opening costs no engine time (a GPU engine's scheduler does it beside the steps).
        ttft_target_s: The router's relay threshold (None: its default).
        odd_rule: The odd-traffic rule (None: the router's default).
        initial_wan_bps: The router's WAN bandwidth estimate before its first sample (None: its
            default, which is also the launcher's).
        initial_wan_rtt_s: Its RTT estimate before the first sample.
        handoff: The relay's handoff policy (None: its default).
    """

    prefill: RolePool
    relay_decode: RolePool
    main_decode: RolePool
    link: LinkSpec
    block_size: int
    kv_bytes_per_token: int
    md_site: str = "site-b"
    pipeline_policy: str = "auto"
    md_prefix_cache: bool = True
    cache_tier_blocks: int = 0
    local_bytes_per_s: float = 2.5e9
    local_latency_s: float = 0.001
    host_cores: int | None = None
    threads_per_engine: int = 2
    host_speed: dict | None = None
    step_speeds: dict | None = None
    step_noise: bool = False
    engine_wake_s: float = 0.0
    dispatch_s: float | None = None
    dispatch_spread: float = 0.0
    engine_thread_io: bool = False
    ttft_target_s: float | None = None
    odd_rule: OddTrafficRule | None = None
    initial_wan_bps: float | None = None
    initial_wan_rtt_s: float | None = None
    handoff: HandoffPolicy | None = field(default=None)

    @property
    def cost(self) -> float:
        """Instances' price summed."""
        return sum(r.count * r.price for r in (self.prefill, self.relay_decode, self.main_decode))
