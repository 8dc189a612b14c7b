"""Where a request runs: prefill and main-decode instances, and the pipeline.

P→RLD→MD when the blocks the chosen main decoder lacks are predicted to land there more than
the TTFT target after the prefill ends; P→MD otherwise. The prefill ships a long prompt's KV
chunk by chunk while it computes, so the prediction overlaps the transfer with the compute
from the chunk that computes the first block the decoder lacks, and lets the last chunk's
blocks leave only when the compute ends (``WanEstimate.arrival_after_prefill_s``, with the
chosen prefill's own reported chunk sizes and compute rate, ``prefill_forecast.py``): a
follow-up turn whose decoder holds all but its new tail gains no overlap. P→RLD alone is chosen
only while no main decoder is live (site B unreachable): serving at site A beats failing.

Among main decode instances the cheapest wins, cost counted in KV blocks: the prompt blocks
the instance lacks (to receive) plus the blocks its running requests hold. A prefill
instance's cost is work, also in blocks: the prompt blocks it lacks (to compute) plus the
blocks it has queued to compute for other requests (not the blocks it holds: a request that
hits most of a long cached prefix holds many blocks and computes few). Main decoders whose
missing KV would cross the WAN within the TTFT target go first, so a conversation stays with
the decoder that caches it. A cached prefix draws requests to its instance only while that
instance is not busier by more than the prefix saves: a system prompt shared by all traffic
cannot pin every request on one decoder. Equal costs go to the instance that was placed on
least recently. Relays, whose work is decode steps, go to the fewest sequences.
(docs/planning.md records the simulated runs behind these rules.)
"""

import functools
from collections.abc import Callable
from dataclasses import dataclass

from services.router.prefill_forecast import PrefillForecast
from services.router.registry import InstanceRegistry, InstanceState
from services.router.wan_estimate import Arriving, WanEstimate
from shared.errors import PddError
from shared.messages import InstanceRef, Pipeline


class NoInstances(PddError):
    """A service the request needs has no live instance."""

    code = "no_instances"


@dataclass(frozen=True)
class Placement:
    """The routing decision for one request and its inputs.

    Attributes:
        pipeline: ``P-MD`` or ``P-RLD-MD``.
        prefill: Chosen prefill instance.
        main_decode: Chosen main decode instance (None only for ``P-RLD``).
        relay_decode: Chosen relay, for ``P-RLD-MD`` and ``P-RLD``.
        md_cached_blocks: Leading prompt blocks the main decoder holds (cache-index).
        md_load_blocks: KV blocks the main decoder's running requests held when chosen.
        num_prompt_blocks: KV blocks the prompt fills (the load it adds where it runs).
        prefill_compute_blocks: Prompt blocks the chosen prefill lacks (the work it adds there).
        missing_kv_bytes: KV bytes the main decoder lacks (the WAN's when it is at another
            site than the prefill).
        predicted_wan_s: When they are predicted to land, counted from the prefill's end (0
            for a main decoder beside the prefill: the local path is not modelled).
        predicted_prefill_s: The prefill's predicted compute time (0: no rate reported yet).
        predicted_ships_from_s: When the first block the main decoder lacks is predicted
            computed (its KV may start crossing), counted from the prefill's start.
        odd_traffic: Marked odd by the odd-traffic filter (relayed; WAN cancelled if the relay wins).
        degraded_reason: Why a ``P-RLD`` request is served at site A alone.
    """

    pipeline: Pipeline
    prefill: InstanceRef
    main_decode: InstanceRef | None
    relay_decode: InstanceRef | None
    md_cached_blocks: int
    md_load_blocks: int
    num_prompt_blocks: int
    missing_kv_bytes: int
    predicted_wan_s: float
    odd_traffic: bool = False
    degraded_reason: str = ""
    prefill_compute_blocks: int = 0
    predicted_prefill_s: float = 0.0
    predicted_ships_from_s: float = 0.0

    @property
    def instance_ids(self) -> list[str]:
        """Every instance the request runs on."""
        refs = (self.prefill, self.main_decode, self.relay_decode)
        return [ref.instance_id for ref in refs if ref is not None]

    @property
    def kv_crosses_sites(self) -> bool:
        """Whether the prompt's KV travels to a main decoder at another site than the prefill's
        (only such a flow's bytes and timing are the WAN's)."""
        return self.main_decode is not None and self.main_decode.site != self.prefill.site

    @property
    def decoder_ids(self) -> frozenset[str]:
        """The instances that may write the request's token stream."""
        return frozenset(ref.instance_id for ref in (self.main_decode, self.relay_decode) if ref is not None)

    @property
    def compute_blocks(self) -> dict[str, int]:
        """Prompt blocks each instance computes (``InstanceRegistry.assign``'s ``compute_blocks``)."""
        return {self.prefill.instance_id: self.prefill_compute_blocks}


def placement_cost_blocks(state: InstanceState, hits: dict[str, int], num_prompt_blocks: int) -> int:
    """Blocks the instance lacks for this prompt plus blocks its running requests hold."""
    missing = max(0, num_prompt_blocks - hits.get(state.report.instance.instance_id, 0))
    return missing + state.load_blocks


def prefill_cost_blocks(state: InstanceState, hits: dict[str, int], num_prompt_blocks: int, block_size: int) -> int:
    """Blocks the prefill would compute for this prompt plus blocks it has queued to compute."""
    missing = max(0, num_prompt_blocks - hits.get(state.report.instance.instance_id, 0))
    return missing + state.pending_compute_blocks(block_size)


def tie_break(state: InstanceState) -> tuple[int, int]:
    """Among instances of equal cost: the most spare KV blocks (a fleet-wide fact every router
    reads from the heartbeats, so routers spread cold prompts without talking to each other,
    and a prompt evicts the least cache), then the one this router placed on longest ago."""
    return -state.spare_blocks, state.last_placed


def _pick(candidates: list[InstanceState], hits: dict[str, int], num_prompt_blocks: int) -> InstanceState:
    return min(candidates, key=lambda s: (placement_cost_blocks(s, hits, num_prompt_blocks), *tie_break(s)))


def _pick_prefill(
    candidates: list[InstanceState], hits: dict[str, int], num_prompt_blocks: int, block_size: int
) -> InstanceState:
    return min(candidates, key=lambda s: (prefill_cost_blocks(s, hits, num_prompt_blocks, block_size), *tie_break(s)))


def _live(registry: InstanceRegistry, service: str, avoid: frozenset[str]) -> list[InstanceState]:
    """Live instances of ``service``, without those to avoid unless nothing else is live."""
    live = registry.live(service)
    return [s for s in live if s.report.instance.instance_id not in avoid] or live


def place(
    registry: InstanceRegistry,
    hits: dict[str, int],
    *,
    num_prompt_tokens: int,
    block_size: int,
    kv_bytes_per_token: int,
    wan: WanEstimate,
    ttft_target_s: float,
    policy: str = "auto",
    odd_rule=None,
    max_tokens: int = 0,
    avoid: frozenset[str] = frozenset(),
    arriving: dict[str, Arriving] | None = None,
) -> Placement:
    """Choose instances and pipeline for a prompt (``policy`` forces one for baselines).
    ``avoid`` names instances that already failed this request (a recovery): they are
    chosen only when no other instance of their service is live. ``arriving``: per main
    decoder, the prompt's leading blocks already on their way there (they do not cross again;
    the request's KV is complete no earlier than they land).

    Raises:
        NoInstances: no live prefill instance, or neither a main decoder nor a relay.
    """
    prefills, mains = _live(registry, "prefill", avoid), _live(registry, "main_decode", avoid)
    relays = _live(registry, "relay_decode", avoid)
    if not prefills or not (mains or relays):
        raise NoInstances("no live " + ("prefill" if not prefills else "main_decode or relay_decode") + " instance")
    num_prompt_blocks = -(-num_prompt_tokens // block_size)
    prefill = _pick_prefill(prefills, hits, num_prompt_blocks, block_size)
    prefill_compute_blocks = max(0, num_prompt_blocks - hits.get(prefill.report.instance.instance_id, 0))
    if not mains:
        return _relay_only(prefill, relays, num_prompt_blocks, prefill_compute_blocks)
    forecast = PrefillForecast.of(
        prefill.report, num_prompt_tokens, hits.get(prefill.report.instance.instance_id, 0) * block_size
    )
    arrival_s = functools.partial(_arrival_s, wan, forecast, kv_bytes_per_token, prefill.report.instance.instance_id)
    main, missing_from, predicted_s = _pick_main(
        mains,
        hits,
        num_prompt_tokens,
        block_size,
        arrival_s,
        ttft_target_s,
        arriving or {},
        forecast.compute_s,
        prefill.report.instance.site,
    )
    missing_bytes = (num_prompt_tokens - missing_from) * kv_bytes_per_token
    odd = policy == "auto" and odd_rule is not None and odd_rule.is_odd(max_tokens, predicted_s)
    wants_relay = predicted_s > ttft_target_s or odd if policy == "auto" else policy == "P-RLD-MD"
    relays = _with_room(relays)
    relay = _least_busy(relays) if wants_relay and relays else None
    return Placement(
        pipeline="P-RLD-MD" if relay else "P-MD",
        prefill=prefill.report.instance,
        main_decode=main.report.instance,
        relay_decode=relay.report.instance if relay else None,
        md_cached_blocks=hits.get(main.report.instance.instance_id, 0),
        md_load_blocks=main.load_blocks,
        num_prompt_blocks=num_prompt_blocks,
        missing_kv_bytes=missing_bytes,
        predicted_wan_s=predicted_s,
        odd_traffic=odd and relay is not None,
        prefill_compute_blocks=prefill_compute_blocks,
        predicted_prefill_s=forecast.compute_s,
        predicted_ships_from_s=forecast.ready_s(missing_from),
    )


def _arrival_s(
    wan: WanEstimate, forecast: PrefillForecast, kv_bytes_per_token: int, prefill_id: str, missing_from: int
) -> float:
    """When the prompt's KV from token ``missing_from`` on lands across the WAN, counted from
    the end of the prefill ``forecast`` describes (run by ``prefill_id``)."""
    num_tokens = forecast.num_prompt_tokens - missing_from
    tail_tokens = forecast.num_prompt_tokens - max(missing_from, forecast.last_chunk_from)
    return wan.arrival_after_prefill_s(
        num_tokens * kv_bytes_per_token,
        prefill_s=forecast.compute_s,
        ships_from_s=forecast.ready_s(missing_from),
        tail_bytes=max(0, tail_tokens) * kv_bytes_per_token,
        sender_id=prefill_id,
    )


def _pick_main(
    mains: list[InstanceState],
    hits: dict[str, int],
    num_prompt_tokens: int,
    block_size: int,
    arrival_s: Callable[[int], float],
    ttft_target_s: float,
    arriving: dict[str, Arriving],
    prefill_s: float,
    prefill_site: str,
) -> tuple[InstanceState, int, float]:
    """The main decoder (those whose missing KV lands within the target first), the first
    prompt token it lacks and when the KV from there on is predicted to land after the prefill
    (``arrival_s`` across the WAN, at once beside the prefill, and no earlier than blocks
    already on their way to it)."""
    held = dict(hits)
    for instance_id, coming in arriving.items():
        held[instance_id] = max(held.get(instance_id, 0), coming.blocks)

    def missing_from(state: InstanceState) -> int:
        return min(num_prompt_tokens, held.get(state.report.instance.instance_id, 0) * block_size)

    def lands_s(state: InstanceState) -> float:
        crosses = state.report.instance.site != prefill_site
        landing = arrival_s(missing_from(state)) if crosses else 0.0
        coming = arriving.get(state.report.instance.instance_id)
        if coming is not None and coming.blocks > hits.get(state.report.instance.instance_id, 0):
            landing = max(landing, coming.lands_in_s - prefill_s)
        return landing

    candidates = _with_room(mains) or mains
    quick = [s for s in candidates if lands_s(s) <= ttft_target_s]
    main = _pick(quick or candidates, held, -(-num_prompt_tokens // block_size))
    return main, missing_from(main), lands_s(main)


def _with_room(instances: list[InstanceState]) -> list[InstanceState]:
    """Those where this router may place another request: within its share of their
    ``max_sequences`` and the slots other routers' requests leave (``capacity_share``)."""
    return [s for s in instances if s.room_sequences is None or s.room_sequences > 0]


def _least_busy(relays: list[InstanceState]) -> InstanceState:
    return min(relays, key=lambda s: (s.load_sequences, *tie_break(s)))


def _relay_only(
    prefill: InstanceState, relays: list[InstanceState], num_prompt_blocks: int, prefill_compute_blocks: int
) -> Placement:
    """Degraded mode: no main decoder is live, the relay finishes the request at site A.

    Admission is bounded by the relays' own capacity: the small relay pool must not take
    every request a cut-off site would have served.
    """
    room = [s for s in relays if not s.report.max_sequences or s.load_sequences < s.report.max_sequences]
    if not room:
        raise NoInstances("no main decoder is reachable and the relay pool is full")
    relay = _least_busy(room)
    return Placement(
        pipeline="P-RLD",
        prefill=prefill.report.instance,
        main_decode=None,
        relay_decode=relay.report.instance,
        md_cached_blocks=0,
        md_load_blocks=0,
        num_prompt_blocks=num_prompt_blocks,
        missing_kv_bytes=0,
        predicted_wan_s=0.0,
        degraded_reason="no main decoder is reachable",
        prefill_compute_blocks=prefill_compute_blocks,
    )
