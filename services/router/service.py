"""Router (site A): the OpenAI-compatible HTTP front door of the whole deployment.

Tokenizes (chat template for chat), asks the cache-index how many leading blocks each
instance holds, places the request (prefill, main decode, pipeline), dispatches it and
streams the ordered tokens back as SSE or one JSON body with a ``pdd`` extension object.
"""

import asyncio
import time
from pathlib import Path

import nats
from aiohttp import web
from opentelemetry import trace

from services.router import openai_api
from services.router.admission import Admission
from services.router.api_error import ApiError
from services.router.http_api import RouterApi
from services.router.kv_landings import KvLandings, file_late_kv_ready
from services.router.mailbox import RequestMailbox
from services.router.openai_api import ParsedRequest
from services.router.placement import NoInstances, Placement
from services.router.placer import Placer
from services.router.prompts import PromptBuilder
from services.router.registry import InstanceRegistry
from services.router.request_flow import LIVENESS_TICK_S, FlowContext, RequestFlow, new_request_id
from services.router.request_metrics import RequestMetrics
from services.router.responses import ResponseWriter
from services.router.site_health import SiteHealth, SiteState, SiteTransition
from services.router.wan_estimate import WanEstimator
from shared import subjects
from shared.config import RouterConfig
from shared.messages import KvReady, LoadReported, decoder
from shared.metrics import (
    PIPELINE_CHOICES,
    REQUESTS_RUNNING,
    REQUESTS_WAITING,
    SITE_STATE,
    WAN_ESTIMATE_BANDWIDTH,
    WAN_ESTIMATE_RTT,
)
from shared.model_loader import ModelMetadata, load_metadata
from shared.service import Service
from shared.tracing import context_from, tracer
from shared.version import pdd_version

_load_decoder = decoder(LoadReported)
_tracer = tracer("pdd.router")
SITE_TICK_S = 0.5
SITE_PROBE_TIMEOUT_S = 1.0
PEER_SETTLE_HEARTBEATS = 1.5
"""Heartbeat intervals a router listens before it serves (it has heard every live peer by then)."""


class RouterService(Service):
    """The router actor: HTTP in, NATS out. It composes the parts: ``PromptBuilder`` (bodies to
    token ids), ``Admission``, ``Placer`` (where a request runs), ``RequestFlow`` (one request's
    dispatch, stream and recovery), ``ResponseWriter`` (JSON or SSE) and ``RouterApi`` (HTTP);
    it keeps the fleet's view current from heartbeats and site probes."""

    service_name = "router"

    def __init__(self, config: RouterConfig, metadata: ModelMetadata | None = None):
        super().__init__(config)
        self.config: RouterConfig = config
        self.metadata = metadata
        self.registry = InstanceRegistry(config.instance_ttl_s, config.partition_tolerance_s, self.instance_id)
        self.site_health = SiteHealth(self.registry, config.site, config.instance_ttl_s)
        self.wan = WanEstimator(config.wan_bandwidth_mbit * 1e6, config.wan_rtt_ms / 1000)
        self.kv_landings = KvLandings()
        self.admission = Admission(
            self.registry,
            max_in_flight=config.max_in_flight,
            max_queued=config.max_queued,
            queue_timeout_s=config.queue_timeout_s,
        )
        self.mailbox: RequestMailbox | None = None
        self.api: RouterApi | None = None
        self._flows: FlowContext | None = None

    @property
    def port(self) -> int:
        """The HTTP port it listens on (known once started)."""
        return self.api.port if self.api else self.config.http_port

    async def on_start(self):
        config = self.config
        if self.metadata is None:
            self.metadata = await asyncio.get_running_loop().run_in_executor(None, load_metadata, config.model)
        self.prompts = PromptBuilder(self.metadata, config.served_model_name, config.default_max_tokens)
        await self.prompts.start(f"pdd-{pdd_version()}-{Path(config.model).name}")
        self.placer = Placer(config, self.registry, self.site_health, self.wan, self.metadata.kv_bytes_per_token)
        self.placer.connect(self.nc, self.bad_messages)
        self.responses = ResponseWriter(self.prompts, config.sse_write_timeout_s)
        self._bind_gauges()
        await self.subscribe(subjects.LOAD_ALL, _load_decoder, self._on_heartbeat)
        listening_since = time.monotonic()
        self.mailbox = RequestMailbox(self.nc, self.instance_id, self.bad_messages, self._on_late_event)
        await self.mailbox.start()
        self._tasks.append(asyncio.create_task(self.mailbox.tick_forever(LIVENESS_TICK_S), name="mailbox-tick"))
        self._flows = FlowContext(self.nc, self.mailbox, self.registry, self.wan, config, self.kv_landings)
        self._tasks.append(asyncio.create_task(self._watch_sites(), name="site-health"))
        self.api = RouterApi(
            config, self.prompts, self.placer, self.admission, self.site_health, self.run, self.kv_landings
        )
        # Serve only once every live peer router has been heard: each heartbeats every
        # heartbeat_s, and admission counts them (their shares of the decoders) from the first request.
        await asyncio.sleep(
            max(0.0, PEER_SETTLE_HEARTBEATS * config.heartbeat_s - (time.monotonic() - listening_since))
        )
        await self.api.start()

    def _on_late_event(self, event, sender: str):
        """An event for a request already answered: a ``KvReady`` still says when and how fast
        its KV landed (``file_late_kv_ready``)."""
        if isinstance(event, KvReady):
            file_late_kv_ready(event, sender, self.kv_landings, self.wan)

    def _bind_gauges(self):
        model_name = self.config.served_model_name
        REQUESTS_RUNNING.labels(model_name).set_function(lambda: self.admission.in_flight)
        REQUESTS_WAITING.labels(model_name).set_function(lambda: self.admission.num_waiting)
        WAN_ESTIMATE_BANDWIDTH.set_function(lambda: self.wan.bandwidth_bps)
        WAN_ESTIMATE_RTT.set_function(lambda: self.wan.rtt_s)

    async def on_stop(self):
        if self.api is not None:
            await self.api.stop()
            self.prompts.stop()

    async def _on_heartbeat(self, report: LoadReported, msg):
        self.registry.observe(report)
        self.admission.wake()  # capacity may have grown

    async def _watch_sites(self):
        probes: dict[str, asyncio.Task] = {}
        while True:
            for site in self.registry.sites():
                if site != self.config.site and (site not in probes or probes[site].done()):
                    probes[site] = asyncio.create_task(self._probe_site(site))
            self._record_sites(self.site_health.update())
            await asyncio.sleep(SITE_TICK_S)

    def _record_sites(self, moves: list[SiteTransition]):
        for move in moves:
            state, why = move.state.value, move.why
            self.log.warning("site_state", site=move.site, previous=move.previous.value, state=state, why=why)
            trace.get_current_span().add_event("site_state", {"site": move.site, "state": state, "why": why})
        for site, now in self.site_health.states.items():
            for state in SiteState:
                SITE_STATE.labels(site, state.value).set(1 if state is now else 0)

    async def _probe_site(self, site: str):
        """Ask the site's own NATS server (its JetStream domain) whether the link carries."""
        try:
            await self.nc.jetstream(domain=site, timeout=SITE_PROBE_TIMEOUT_S).account_info()
            self.registry.site_heard(site)
        except (TimeoutError, nats.errors.Error):
            pass  # the link or the site's server is down: instances' silence is not death yet

    def health(self) -> tuple[bool, dict]:
        """The service's health, with the fleet as this router sees it: live instances per
        service and the live routers (``pdd up`` waits until every router sees everything)."""
        healthy, details = super().health()
        return healthy, {**details, "instances": self.registry.summary(), "routers": self.registry.routers()}

    def load_report(self) -> LoadReported:
        return LoadReported(
            instance=self.instance_ref(),
            service=self.service_name,
            active_sequences=len(self.api.in_flight) if self.api else 0,
            unix_s=time.time(),
            live_request_ids=self.mailbox.open_request_ids if self.mailbox else [],
        )

    async def run(self, request: web.Request, req: ParsedRequest, queued_s: float = 0.0) -> web.StreamResponse:
        """Place, dispatch and answer one admitted request (traced as ``router.route``)."""
        started = time.perf_counter()
        request_id = new_request_id(self.instance_id)
        log = self.log.bind(request_id=request_id)
        # A client's W3C traceparent makes this request's trace a part of the client's.
        attributes = {"request_id": request_id, "prompt_tokens": len(req.prompt_token_ids)}
        with _tracer.start_as_current_span(
            "router.route",
            context=context_from(headers=request.headers),
            attributes={**attributes, **openai_api.gen_ai_request_attributes(req)},
        ) as span:
            try:
                placement = await self.placer.place(req, request_id)
            except NoInstances as exc:
                raise ApiError(503, str(exc), type="server_error", code="no_instances") from None
            self._routed(span, log, req, placement)
            flow = RequestFlow(
                self._flows,
                request_id,
                req.prompt_token_ids,
                req.sampling,
                placement,
                started,
                replace=lambda avoid: self.placer.place(req, request_id, avoid),
            )
            flow.outcome.queue_ms = queued_s * 1000
            metrics = RequestMetrics(self.config.served_model_name, started - queued_s)  # e2e from arrival
            try:
                if req.stream:
                    return await self.responses.stream(request, req, flow, metrics)
                return await self.responses.collect(req, flow, metrics)
            finally:
                self._done(span, log, req, flow)

    def _routed(self, span, log, req: ParsedRequest, placement: Placement):
        span.set_attributes(
            {
                "pipeline": placement.pipeline,
                "odd_traffic": placement.odd_traffic,
                "md_cached_blocks": placement.md_cached_blocks,
                "missing_kv_bytes": placement.missing_kv_bytes,
                "predicted_wan_s": placement.predicted_wan_s,
                "wan_estimate_bps": self.wan.bandwidth_bps,
                "wan_estimate_rtt_s": self.wan.rtt_s,
            }
        )
        PIPELINE_CHOICES.labels(placement.pipeline).inc()
        log.info(
            "request_routed",
            pipeline=placement.pipeline,
            odd_traffic=placement.odd_traffic,
            wan_estimate_mbit=round(self.wan.bandwidth_bps / 1e6, 2),
            wan_estimate_rtt_ms=round(self.wan.rtt_s * 1000, 1),
            prompt_tokens=len(req.prompt_token_ids),
            md_cached_blocks=placement.md_cached_blocks,
            md_load_blocks=placement.md_load_blocks,
            predicted_wan_ms=round(placement.predicted_wan_s * 1000, 1),
            predicted_prefill_ms=round(placement.predicted_prefill_s * 1000, 1),
            main_decode=placement.main_decode.instance_id if placement.main_decode else None,
        )

    def _done(self, span, log, req: ParsedRequest, flow: RequestFlow):
        outcome = flow.outcome
        span.set_attributes(
            {
                "finished_on": outcome.finished_on or "",
                "eager_tokens": outcome.eager_tokens,
                "recoveries": len(outcome.recoveries),
                "gen_ai.response.id": flow.request_id,
                "gen_ai.response.model": req.model,
                "gen_ai.response.finish_reasons": [outcome.finish_reason or "error"],
                "gen_ai.usage.input_tokens": len(req.prompt_token_ids),
                "gen_ai.usage.output_tokens": outcome.output_tokens,
            }
        )
        log.info(
            "request_done",
            pipeline=outcome.pipeline,
            finished_on=outcome.finished_on,
            output_tokens=outcome.output_tokens,
            ttft_ms=outcome.ttft_ms,
            eager_tokens=outcome.eager_tokens,
            wan_kv_bytes=outcome.wan_kv_bytes,
            recoveries=len(outcome.recoveries),
        )
