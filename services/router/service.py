"""Router (site A): the OpenAI-compatible HTTP front door of the whole deployment.

Tokenizes (chat template for chat), asks the cache-index how many leading blocks each
instance holds, places the request (prefill, main decode, pipeline), dispatches it and
streams the ordered tokens back as SSE or one JSON body with a ``pdd`` extension object.
"""

import asyncio
import contextlib
import dataclasses
import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jinja2
import msgspec
import nats
from aiohttp import web

from services.router import http_guard, openai_api
from services.router.admission import Admission, Overloaded
from services.router.detokenizer import Detokenizer
from services.router.logprobs_format import LogprobsFormatter
from services.router.mailbox import RequestMailbox
from services.router.odd_traffic import OddTrafficRule
from services.router.openai_api import ApiError, ParsedRequest
from services.router.placement import NoInstances, place
from services.router.registry import InstanceRegistry
from services.router.request_flow import RequestFlow, UpstreamFailed, UpstreamTimeout, new_request_id
from services.router.request_metrics import RequestMetrics
from services.router.site_health import SiteHealth
from services.router.wan_estimate import WanEstimator
from shared import subjects
from shared.block_hash import HASH_SCHEME_VERSION, hash_blocks
from shared.config import RouterConfig
from shared.messages import LoadReported, OverlapQuery, OverlapReply, decoder, encode
from shared.metrics import (
    PIPELINE_CHOICES,
    QUEUE_SECONDS,
    REJECTED,
    REQUESTS_RUNNING,
    REQUESTS_WAITING,
    SLOW_CLIENTS,
    exposition,
)
from shared.model_loader import ModelMetadata, load_metadata
from shared.ops_server import key_matches
from shared.service import Service
from shared.tracing import context_from, tracer
from shared.version import pdd_version

_overlap_decoder = decoder(OverlapReply)
_load_decoder = decoder(LoadReported)
_tracer = tracer("pdd.router")
OVERLAP_TIMEOUT_S = 0.25
HEAVY_DETOKENIZE_TOKENS = 64
"""Token batches at least this long are detokenized on the tokenizer thread, not the event loop."""
SITE_TICK_S = 0.5
SITE_PROBE_TIMEOUT_S = 1.0


class SlowClient(Exception):
    """A streaming client did not accept an event within ``sse_write_timeout_s``."""


class RouterService(Service):
    """The router actor: HTTP in, NATS out."""

    service_name = "router"

    def __init__(self, config: RouterConfig, metadata: ModelMetadata | None = None):
        super().__init__(config)
        self.config: RouterConfig = config
        self.metadata = metadata
        self.registry = InstanceRegistry(config.instance_ttl_s, config.partition_tolerance_s)
        self.site_health = SiteHealth(self.registry, config.site, config.instance_ttl_s)
        self.wan = WanEstimator(config.wan_bandwidth_mbit * 1e6, config.wan_rtt_ms / 1000)
        self.odd_rule = OddTrafficRule(
            config.odd_traffic_filter,
            config.odd_max_output_tokens,
            config.relay_step_ms / 1000,
            config.ttft_target_ms / 1000,
        )
        self.admission = Admission(
            self.registry,
            max_in_flight=config.max_in_flight,
            max_queued=config.max_queued,
            queue_timeout_s=config.queue_timeout_s,
        )
        self.port = config.http_port
        self._runner: web.AppRunner | None = None
        self._in_flight: set[asyncio.Task] = set()
        self._draining = False
        self.mailbox: RequestMailbox | None = None
        # One thread: the fast tokenizer is not safe to call from two threads at once.
        self._tokenizing = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenize")
        self._max_token_chars = 0
        self._logprobs_format: LogprobsFormatter | None = None
        self.system_fingerprint = ""

    async def on_start(self):
        loop = asyncio.get_running_loop()
        if self.metadata is None:
            self.metadata = await loop.run_in_executor(None, load_metadata, self.config.model)
        self._max_token_chars = await loop.run_in_executor(
            self._tokenizing, lambda: max(map(len, self.metadata.tokenizer.get_vocab()))
        )
        self._logprobs_format = LogprobsFormatter(self.metadata.tokenizer)
        model_name = self.config.served_model_name
        REQUESTS_RUNNING.labels(model_name).set_function(lambda: self.admission.in_flight)
        REQUESTS_WAITING.labels(model_name).set_function(lambda: self.admission.num_waiting)
        self.system_fingerprint = f"pdd-{pdd_version()}-{Path(self.config.model).name}"
        await self.subscribe(subjects.LOAD_ALL, _load_decoder, self._on_heartbeat)
        self.mailbox = RequestMailbox(self.nc, self.instance_id, self.bad_messages)
        await self.mailbox.start()
        self._tasks.append(asyncio.create_task(self._watch_sites(), name="site-health"))
        app = web.Application(
            client_max_size=self.config.max_body_mb << 20,
            middlewares=[
                http_guard.openai_errors(),
                http_guard.api_keys(
                    http_guard.parse_api_keys(self.config.api_keys), bool(self.config.metrics_key_sha256)
                ),
                http_guard.json_content(),
            ],
        )
        app.add_routes(
            [
                web.get("/v1/models", self._models),
                web.get("/health", self._health),
                web.get("/metrics", self._metrics),
                web.get("/version", self._version),
                web.post("/tokenize", self._tokenize),
                web.post("/detokenize", self._detokenize),
                web.post("/v1/completions", self._completions),
                web.post("/v1/chat/completions", self._chat_completions),
            ]
        )
        self._runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.config.http_host, self.config.http_port)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]
        self.log.info("router_listening", url=f"http://{self.config.http_host}:{self.port}/v1")

    async def on_stop(self):
        self._draining = True
        if self._in_flight:
            await asyncio.wait(self._in_flight, timeout=30)
        if self._runner:
            await self._runner.cleanup()
        self._tokenizing.shutdown(wait=False, cancel_futures=True)

    async def _on_heartbeat(self, report: LoadReported, msg):
        self.registry.observe(report)
        self.admission.wake()  # capacity may have grown

    async def _watch_sites(self):
        probes: dict[str, asyncio.Task] = {}
        while True:
            for site in self.registry.sites():
                if site != self.config.site and (site not in probes or probes[site].done()):
                    probes[site] = asyncio.create_task(self._probe_site(site))
            self.site_health.update()
            await asyncio.sleep(SITE_TICK_S)

    async def _probe_site(self, site: str):
        """Ask the site's own NATS server (its JetStream domain) whether the link carries."""
        try:
            await self.nc.jetstream(domain=site, timeout=SITE_PROBE_TIMEOUT_S).account_info()
            self.registry.site_heard(site)
        except (TimeoutError, nats.errors.Error):
            pass  # the link or the site's server is down: instances' silence is not death yet

    def load_report(self) -> LoadReported:
        return LoadReported(
            instance=self.instance_ref(),
            service=self.service_name,
            active_sequences=len(self._in_flight),
            unix_s=time.time(),
            live_request_ids=self.mailbox.open_request_ids if self.mailbox else [],
        )

    # --- plain endpoints ----------------------------------------------------------------

    async def _models(self, request):
        return web.json_response(
            {
                "object": "list",
                "data": [
                    {
                        "id": self.config.served_model_name,
                        "object": "model",
                        "created": 0,
                        "owned_by": "pdd",
                        "root": self.config.model,
                        "parent": None,
                        "max_model_len": self.metadata.max_context_tokens,
                    }
                ],
            }
        )

    async def _version(self, request):
        return web.json_response({"version": pdd_version()})

    async def _tokenize(self, request):
        """vLLM's ``/tokenize``: a ``prompt`` or chat ``messages`` → token ids."""
        body = await self._json_body(request)
        self._check_model(body.get("model", self.config.served_model_name))
        tokens = await asyncio.get_running_loop().run_in_executor(self._tokenizing, self._tokenize_body, body)
        return web.json_response(
            {"count": len(tokens), "max_model_len": self.metadata.max_context_tokens, "tokens": tokens}
        )

    def _tokenize_body(self, body: dict) -> list[int]:
        if "messages" in body:
            return self._render_chat(
                openai_api.chat_messages(body),
                add_generation_prompt=body.get("add_generation_prompt", True) is not False,
            )
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            raise ApiError(400, "'prompt' (a string) or 'messages' is required", param="prompt")
        self._check_length(len(prompt), "prompt")
        return self.metadata.tokenizer.encode(prompt, add_special_tokens=body.get("add_special_tokens") is True)

    async def _detokenize(self, request):
        """vLLM's ``/detokenize``: token ids → text."""
        body = await self._json_body(request)
        self._check_model(body.get("model", self.config.served_model_name))
        tokens, vocab = body.get("tokens"), self.metadata.vocab_size
        if not isinstance(tokens, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in tokens
        ):
            raise ApiError(400, f"'tokens' must be a list of token ids in [0, {vocab})", param="tokens")
        text = await asyncio.get_running_loop().run_in_executor(
            self._tokenizing, self.metadata.tokenizer.decode, tokens
        )
        return web.json_response({"prompt": text})

    async def _health(self, request):
        live = self.registry.summary()
        # Without main decoders the relays serve at site A: degraded, but serving.
        serving = bool(live["prefill"] and (live["main_decode"] or live["relay_decode"])) and not self._draining
        healthy = serving
        state = "ok" if serving and live["main_decode"] else "degraded" if serving else "unavailable"
        wan = self.wan.current()
        sites = {site: state.value for site, state in self.site_health.update().items()}
        return web.json_response(
            {
                "status": state,
                "instances": live,
                "sites": sites,
                "wan_estimate": {
                    "bandwidth_mbit": round(wan.bandwidth_bps / 1e6, 2),
                    "rtt_ms": round(wan.rtt_s * 1000, 1),
                },
            },
            status=200 if healthy else 503,
        )

    async def _metrics(self, request):
        key_sha256 = self.config.metrics_key_sha256
        if key_sha256 and not key_matches(request.headers.get("Authorization", ""), key_sha256):
            raise ApiError(
                401, "the metrics key is required (Authorization: Bearer <metrics key>)", code="invalid_api_key"
            )
        body, content_type = exposition()
        return web.Response(body=body, headers={"Content-Type": content_type})

    # --- completions --------------------------------------------------------------------

    async def _completions(self, request):
        return await self._serve(request, chat=False)

    async def _chat_completions(self, request):
        return await self._serve(request, chat=True)

    async def _serve(self, request: web.Request, chat: bool):
        task = asyncio.current_task()
        self._in_flight.add(task)
        try:
            if self._draining:
                raise ApiError(503, "router is shutting down", type="server_error", code="unavailable")
            body = await self._json_body(request)
            parsed = await asyncio.get_running_loop().run_in_executor(self._tokenizing, self._parse, body, chat)
            self._check_fits_a_pool(parsed)
            if not self.admission.limit:
                raise ApiError(
                    503, "no live main_decode or relay_decode instance", type="server_error", code="no_instances"
                )
            try:
                async with self.admission.slot() as queued_s:
                    QUEUE_SECONDS.labels(self.config.served_model_name).observe(queued_s)
                    return await self._run(request, parsed, queued_s)
            except Overloaded as exc:
                REJECTED.labels("busy").inc()
                raise ApiError(
                    429,
                    str(exc),
                    type="rate_limit_error",
                    code="rate_limit_exceeded",
                    headers={"Retry-After": str(exc.retry_after_s)},
                ) from None
        finally:  # an ApiError is answered by http_guard.openai_errors
            self._in_flight.discard(task)

    async def _json_body(self, request) -> dict:
        try:
            text = await request.text()
        except UnicodeDecodeError:
            raise ApiError(400, "request body is not valid UTF-8") from None
        return openai_api.parse_json_body(text)

    def _check_model(self, model):
        if model != self.config.served_model_name:
            raise ApiError(
                404,
                f"model {model!r} does not exist; this server serves {self.config.served_model_name!r}",
                param="model",
                code="model_not_found",
            )

    def _parse(self, body: dict, chat: bool) -> ParsedRequest:
        model = body.get("model")
        self._check_model(model)
        sampling = openai_api.parse_sampling(body, self.config.default_max_tokens, chat)
        stream, include_usage = openai_api.stream_flags(body)
        limit = self.metadata.max_context_tokens
        if chat:
            prompt = self._render_chat(openai_api.chat_messages(body), add_generation_prompt=True)
        else:
            prompt = self._completion_prompt(body.get("prompt"))
        if body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
            sampling = openai_api.checked(
                msgspec.structs.replace(sampling, max_tokens=max(1, min(sampling.max_tokens, limit - len(prompt))))
            )
        if len(prompt) + sampling.max_tokens > limit:
            raise ApiError(
                400,
                f"prompt ({len(prompt)} tokens) plus max_tokens ({sampling.max_tokens}) "
                f"exceeds the model's context of {limit} tokens",
                param="messages" if chat else "prompt",
                code="context_length_exceeded",
            )
        return ParsedRequest(
            chat=chat,
            model=model,
            prompt_token_ids=prompt,
            sampling=sampling,
            stream=stream,
            include_usage=include_usage,
            system_fingerprint=self.system_fingerprint,
        )

    def _render_chat(self, messages: list[dict], add_generation_prompt: bool) -> list[int]:
        """The chat template's token ids for ``messages``; 400 when the template cannot render them."""
        self._check_length(sum(len(m["content"]) for m in messages), "messages")
        try:
            return list(
                self.metadata.tokenizer.apply_chat_template(
                    messages, add_generation_prompt=add_generation_prompt, tokenize=True, return_dict=False
                )
            )
        except (jinja2.TemplateError, TypeError, ValueError, KeyError, AttributeError) as exc:
            raise ApiError(400, f"the chat template cannot render these messages: {exc}", param="messages") from None

    def _completion_prompt(self, prompt) -> list[int]:
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, str) and prompt:
            self._check_length(len(prompt), "prompt")
            return self.metadata.tokenizer.encode(prompt, add_special_tokens=False)
        vocab = self.metadata.vocab_size
        if (
            isinstance(prompt, list)
            and prompt
            and all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in prompt)
        ):
            return prompt
        raise ApiError(400, "'prompt' must be a non-empty string or a list of token ids", param="prompt")

    def _check_length(self, num_chars: int, param: str):
        """Refuse text that cannot fit the context whatever it tokenizes to, before tokenizing it.

        No token spells more than ``_max_token_chars`` characters, so text this long has at
        least ``num_chars / _max_token_chars`` tokens.
        """
        at_least = num_chars // max(1, self._max_token_chars)
        if at_least > self.metadata.max_context_tokens:
            raise ApiError(
                400,
                f"the {param} ({num_chars} characters, at least {at_least} tokens) exceed "
                f"the model's context of {self.metadata.max_context_tokens} tokens",
                param=param,
                code="context_length_exceeded",
            )

    def _check_fits_a_pool(self, req: ParsedRequest):
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

    async def _run(self, request: web.Request, req: ParsedRequest, queued_s: float = 0.0):
        started = time.perf_counter()
        request_id = new_request_id(self.instance_id)
        log = self.log.bind(request_id=request_id)
        # A client's W3C traceparent makes this request's trace a part of the client's.
        with _tracer.start_as_current_span(
            "router.route",
            context=context_from(headers=request.headers),
            attributes={
                "request_id": request_id,
                "prompt_tokens": len(req.prompt_token_ids),
                **openai_api.gen_ai_request_attributes(req),
            },
        ) as span:
            placement = await self._place(req, request_id)
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
                main_decode=placement.main_decode.instance_id if placement.main_decode else None,
            )
            flow = RequestFlow(
                self.nc,
                self.mailbox,
                self.registry,
                wan=self.wan,
                request_id=request_id,
                prompt_token_ids=req.prompt_token_ids,
                sampling=req.sampling,
                placement=placement,
                block_size=self.config.block_size,
                first_token_timeout_s=self.config.first_token_timeout_s,
                token_timeout_s=self.config.token_timeout_s,
                started=started,
                replace=lambda avoid: self._placement(req, request_id, avoid),
                max_recoveries=self.config.max_recoveries,
                recovery_wait_s=self.config.recovery_wait_s,
            )
            flow.outcome.queue_ms = queued_s * 1000
            metrics = RequestMetrics(self.config.served_model_name, started - queued_s)  # e2e from arrival
            try:
                if req.stream:
                    return await self._stream(request, req, flow, metrics)
                return await self._collect(req, flow, metrics)
            finally:
                outcome = flow.outcome
                span.set_attributes(
                    {
                        "finished_on": outcome.finished_on or "",
                        "eager_tokens": outcome.eager_tokens,
                        "recoveries": len(outcome.recoveries),
                        "gen_ai.response.id": request_id,
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

    async def _place(self, req: ParsedRequest, request_id: str):
        try:
            return await self._placement(req, request_id)
        except NoInstances as exc:
            raise ApiError(503, str(exc), type="server_error", code="no_instances") from None

    async def _placement(self, req: ParsedRequest, request_id: str, avoid: frozenset[str] = frozenset()):
        """Where the request runs (again, avoiding ``avoid``, for a recovery); raises NoInstances."""
        hashes = hash_blocks(req.prompt_token_ids, self.config.block_size)
        with _tracer.start_as_current_span(
            "router.cache_index.query", attributes={"request_id": request_id, "blocks": len(hashes)}
        ):
            hits = await self._overlap(hashes)
        kv_bytes = self.config.kv_bytes_per_token or self.metadata.kv_bytes_per_token
        placement = place(
            self.registry,
            hits,
            num_prompt_tokens=len(req.prompt_token_ids),
            block_size=self.config.block_size,
            kv_bytes_per_token=kv_bytes,
            wan=self.wan.current(),
            ttft_target_s=self.config.ttft_target_ms / 1000,
            policy=self.config.pipeline_policy,
            odd_rule=self.odd_rule,
            max_tokens=req.sampling.max_tokens,
            avoid=avoid,
        )
        cut_off = self.site_health.unreachable()
        if placement.pipeline == "P-RLD" and cut_off:
            placement = dataclasses.replace(placement, degraded_reason=f"{', '.join(cut_off)} unreachable")
        return placement

    async def _overlap(self, hashes: list[int]) -> dict[str, int]:
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
            self.log.warning("cache_index_unavailable")
            return {}

    async def _detokenize_batch(self, detok: Detokenizer, batch: list[int]) -> str:
        if len(batch) < HEAVY_DETOKENIZE_TOKENS:
            return detok.add(batch)
        return await asyncio.get_running_loop().run_in_executor(self._tokenizing, detok.add, batch)

    async def _collect(self, req: ParsedRequest, flow: RequestFlow, metrics: RequestMetrics):
        detok = Detokenizer(self.metadata.tokenizer, req.sampling.stop)
        try:
            async with contextlib.aclosing(flow.tokens()) as batches:
                async for batch in batches:
                    await self._detokenize_batch(detok, batch)
        except (UpstreamFailed, UpstreamTimeout) as exc:
            metrics.finish(flow.outcome, "error")
            raise self._upstream_error(exc) from None
        metrics.finish(flow.outcome, "ok")
        text = detok.emitted + detok.flush()
        return web.json_response(
            openai_api.completion_body(
                req,
                flow.request_id,
                text,
                flow.outcome.finish_reason,
                flow.outcome.output_tokens,
                flow.outcome.as_pdd(),
                flow.outcome.prefill_cached_tokens,
                self._logprobs(req, flow, 0, len(flow.log.token_ids)),
            )
        )

    def _logprobs(
        self, req: ParsedRequest, flow: RequestFlow, start: int, end: int, text_offset: int = 0
    ) -> dict | None:
        """The ``logprobs`` object of output tokens ``[start, end)``, if the request asked for it."""
        if req.sampling.logprobs is None:
            return None
        ids, logprobs = flow.log.token_ids[start:end], flow.log.logprobs[start:end]
        if req.chat:
            return self._logprobs_format.chat(ids, logprobs)
        return self._logprobs_format.completion(ids, logprobs, text_offset)

    async def _stream(self, request: web.Request, req: ParsedRequest, flow: RequestFlow, metrics: RequestMetrics):
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        try:
            try:
                async with contextlib.aclosing(flow.tokens()) as batches:
                    await self._stream_events(response, req, flow, metrics, batches)
                metrics.finish(flow.outcome, "ok")
            except (UpstreamFailed, UpstreamTimeout) as exc:
                metrics.finish(flow.outcome, "error")
                await self._sse(response, self._upstream_error(exc).body())
            await self._write(response, b"data: [DONE]\n\n")
            await asyncio.wait_for(response.write_eof(), self.config.sse_write_timeout_s)
        except (TimeoutError, SlowClient):
            # The flow is closed (its request cancelled, its KV freed); so is the connection.
            SLOW_CLIENTS.inc()
            metrics.finish(flow.outcome, "error")
            self.log.warning(
                "slow_client_dropped", request_id=flow.request_id, timeout_s=self.config.sse_write_timeout_s
            )
            if request.transport is not None:
                request.transport.abort()
        return response

    async def _stream_events(
        self, response: web.StreamResponse, req: ParsedRequest, flow: RequestFlow, metrics: RequestMetrics, batches
    ):
        detok, first = Detokenizer(self.metadata.tokenizer, req.sampling.stop), True
        num_sent, num_chars = 0, 0
        async for batch in batches:
            delta = await self._detokenize_batch(detok, batch)
            logprobs = self._logprobs(req, flow, num_sent, num_sent + len(batch), num_chars)
            num_sent += len(batch)
            if logprobs is not None and not req.chat:
                num_chars += sum(map(len, logprobs["tokens"]))
            if delta or first or logprobs is not None:
                await self._sse(
                    response, openai_api.chunk_body(req, flow.request_id, delta, first=first, logprobs=logprobs)
                )
                first = False
                metrics.delivered(flow.outcome.pipeline)
        rest = detok.flush()
        if rest:
            await self._sse(response, openai_api.chunk_body(req, flow.request_id, rest))
        await self._sse(
            response,
            openai_api.chunk_body(req, flow.request_id, None, flow.outcome.finish_reason, pdd=flow.outcome.as_pdd()),
        )
        if req.include_usage:
            await self._sse(
                response,
                openai_api.usage_chunk(
                    req, flow.request_id, flow.outcome.output_tokens, flow.outcome.prefill_cached_tokens
                ),
            )

    async def _sse(self, response: web.StreamResponse, body: dict):
        """Write one event; raise SlowClient when the client does not take it in time."""
        await self._write(response, b"data: " + json.dumps(body).encode() + b"\n\n")

    async def _write(self, response: web.StreamResponse, data: bytes):
        try:
            await asyncio.wait_for(response.write(data), self.config.sse_write_timeout_s)
        except TimeoutError:
            raise SlowClient() from None

    @staticmethod
    def _upstream_error(exc) -> ApiError:
        if isinstance(exc, UpstreamTimeout):
            return ApiError(504, str(exc), type="timeout", code="timeout")
        return ApiError(502, str(exc), type="server_error", code="upstream_failed")
