"""Placement with its inputs gathered: the cache index's overlap, the WAN estimate, site health.

``placement.place`` decides from numbers; ``Placer`` fetches them (one request to the cache
index, bounded by ``OVERLAP_TIMEOUT_S``; without an answer the request is placed on load
alone) and marks a site-A-only placement degraded while a remote site is cut off.
"""

import dataclasses

import nats
import structlog

from services.router.api_error import ApiError
from services.router.odd_traffic import OddTrafficRule
from services.router.openai_api import ParsedRequest
from services.router.placement import Placement, place
from services.router.registry import InstanceRegistry
from services.router.site_health import SiteHealth
from services.router.wan_estimate import WanEstimator
from shared import subjects
from shared.block_hash import HASH_SCHEME_VERSION, hash_blocks
from shared.config import RouterConfig
from shared.dead_letters import BadMessageSink
from shared.messages import OverlapQuery, OverlapReply, decoder, encode
from shared.tracing import tracer

log = structlog.get_logger(__name__)
_overlap_decoder = decoder(OverlapReply)
_tracer = tracer("pdd.router")
OVERLAP_TIMEOUT_S = 0.25


class Placer:
    """Where a request runs, from the fleet's state as this router knows it."""

    def __init__(
        self,
        config: RouterConfig,
        registry: InstanceRegistry,
        site_health: SiteHealth,
        wan: WanEstimator,
        kv_bytes_per_token: int,
    ):
        self.config, self.registry, self.site_health, self.wan = config, registry, site_health, wan
        self.kv_bytes_per_token = config.kv_bytes_per_token or kv_bytes_per_token
        self.odd_rule = OddTrafficRule(
            config.odd_traffic_filter,
            config.odd_max_output_tokens,
            config.relay_step_ms / 1000,
            config.ttft_target_ms / 1000,
        )
        self.nc: nats.NATS | None = None
        self.bad_messages: BadMessageSink | None = None

    def connect(self, nc: nats.NATS, bad_messages: BadMessageSink):
        """Use this NATS connection for the cache-index queries."""
        self.nc, self.bad_messages = nc, bad_messages

    async def place(self, req: ParsedRequest, request_id: str, avoid: frozenset[str] = frozenset()) -> Placement:
        """Where the request runs (again, avoiding ``avoid``, for a recovery); raises NoInstances."""
        hashes = hash_blocks(req.prompt_token_ids, self.config.block_size)
        with _tracer.start_as_current_span(
            "router.cache_index.query", attributes={"request_id": request_id, "blocks": len(hashes)}
        ):
            hits = await self._overlap(hashes)
        self.wan.seen_cached(hashes, hits)
        placement = place(
            self.registry,
            hits,
            num_prompt_tokens=len(req.prompt_token_ids),
            block_size=self.config.block_size,
            kv_bytes_per_token=self.kv_bytes_per_token,
            wan=self.wan.current(),
            ttft_target_s=self.config.ttft_target_ms / 1000,
            policy=self.config.pipeline_policy,
            odd_rule=self.odd_rule,
            max_tokens=req.sampling.max_tokens,
            avoid=avoid,
            arriving=self.wan.arriving(hashes),
        )
        if placement.kv_crosses_sites:  # its KV now shares the link (relayed or not, it crosses)
            self.wan.flow_placed(
                request_id,
                placement.main_decode.instance_id,
                hashes,
                placement.missing_kv_bytes,
                placement.predicted_prefill_s,
                placement.predicted_ships_from_s,
                placement.prefill.instance_id,
            )
        else:  # a recovery's earlier attempt may have left its flow on the link's ledger
            self.wan.flow_stopped(request_id)
        cut_off = self.site_health.unreachable()
        if placement.pipeline == "P-RLD" and cut_off:
            placement = dataclasses.replace(placement, degraded_reason=f"{', '.join(cut_off)} unreachable")
        return placement

    def check_fits_a_pool(self, req: ParsedRequest):
        """400 for a request whose prompt and output fit no decoder's KV pool at all."""
        pools = [
            s.report.total_blocks
            for service in ("main_decode", "relay_decode")
            for s in self.registry.live(service)
            if s.report.total_blocks
        ]
        needed = -(-(len(req.prompt_token_ids) + req.sampling.max_tokens) // self.config.block_size)
        if pools and needed > max(pools):
            raise ApiError(
                400,
                f"prompt plus max_tokens need {needed} KV blocks; the largest decoder pool holds {max(pools)}",
                param="max_tokens",
                code="kv_capacity_exceeded",
            )

    async def _overlap(self, hashes: list[int]) -> dict[str, int]:
        """Leading blocks of ``hashes`` each instance holds, by the cache index ({} without it)."""
        if not hashes:
            return {}
        subject = subjects.shared_work(self.config.site, "cache_index", subjects.OVERLAP)
        try:
            reply = await self.nc.request(
                subject,
                encode(OverlapQuery(block_hashes=hashes, hash_scheme=HASH_SCHEME_VERSION)),
                timeout=OVERLAP_TIMEOUT_S,
            )
            overlap = self.bad_messages.decode(_overlap_decoder, reply, "reply:overlap")
            return overlap.hit_blocks if overlap is not None else {}
        except (TimeoutError, nats.errors.Error):
            log.warning("cache_index_unavailable")
            return {}
