"""The router's HTTP surface: the OpenAI endpoints, vLLM's tokenizer endpoints, health, metrics.

Every handler runs behind ``http_guard``'s middlewares (OpenAI error objects, API keys, JSON
content type). Completions are admitted (bounded in flight, bounded queue, 429 beyond) and
then handed to the router's ``run`` with their parsed request.
"""

import asyncio
from collections.abc import Awaitable, Callable

import structlog
from aiohttp import web

from services.router import http_guard
from services.router.admission import Admission, Overloaded
from services.router.api_error import ApiError
from services.router.kv_landings import MAX_IDS_PER_QUERY, KvLandings
from services.router.openai_api import ParsedRequest, parse_json_body
from services.router.placer import Placer
from services.router.prompts import PromptBuilder
from services.router.site_health import SiteHealth
from shared.config import RouterConfig
from shared.metrics import QUEUE_SECONDS, REJECTED, exposition
from shared.ops_server import key_matches
from shared.version import pdd_version

log = structlog.get_logger(__name__)
Runner = Callable[[web.Request, ParsedRequest, float], Awaitable[web.StreamResponse]]
"""Runs an admitted request: (HTTP request, parsed request, seconds it queued) → response."""


class RouterApi:
    """The aiohttp application and its handlers."""

    def __init__(
        self,
        config: RouterConfig,
        prompts: PromptBuilder,
        placer: Placer,
        admission: Admission,
        site_health: SiteHealth,
        run: Runner,
        kv_landings: KvLandings,
    ):
        self.config, self.prompts, self.placer, self.admission = config, prompts, placer, admission
        self.site_health, self._run, self.kv_landings = site_health, run, kv_landings
        self.in_flight: set[asyncio.Task] = set()
        self.draining = False
        self.port = config.http_port
        self._runner: web.AppRunner | None = None

    async def start(self):
        """Listen on ``http_host:http_port`` (port 0: any free one, then in ``port``); with
        ``http_reuse_port`` beside the other routers bound to the same port."""
        config = self.config
        guards = [
            http_guard.openai_errors(),
            http_guard.api_keys(http_guard.parse_api_keys(config.api_keys), bool(config.metrics_key_sha256)),
            http_guard.json_content(),
        ]
        app = web.Application(client_max_size=config.max_body_mb << 20, middlewares=guards)
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
                web.post("/v1/pdd/kv-landings", self._kv_landings),
            ]
        )
        self._runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, config.http_host, config.http_port, reuse_port=config.http_reuse_port or None)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]
        log.info("router_listening", url=f"http://{config.http_host}:{self.port}/v1")

    async def stop(self):
        """Refuse new completions, let those in flight finish (30 s at most), close."""
        self.draining = True
        if self.in_flight:
            await asyncio.wait(self.in_flight, timeout=30)
        if self._runner:
            await self._runner.cleanup()

    async def _models(self, request):
        model = {
            "id": self.config.served_model_name,
            "object": "model",
            "created": 0,
            "owned_by": "pdd",
            "root": self.config.model,
            "parent": None,
            "max_model_len": self.prompts.metadata.max_context_tokens,
        }
        return web.json_response({"object": "list", "data": [model]})

    async def _version(self, request):
        return web.json_response({"version": pdd_version()})

    async def _tokenize(self, request):
        """vLLM's ``/tokenize``: a ``prompt`` or chat ``messages`` → token ids."""
        body = await self._json_body(request)
        self.prompts.check_model(body.get("model", self.config.served_model_name))
        tokens = await self.prompts.run(self.prompts.tokenize, body)
        max_model_len = self.prompts.metadata.max_context_tokens
        return web.json_response({"count": len(tokens), "max_model_len": max_model_len, "tokens": tokens})

    async def _detokenize(self, request):
        """vLLM's ``/detokenize``: token ids → text."""
        body = await self._json_body(request)
        self.prompts.check_model(body.get("model", self.config.served_model_name))
        tokens = body.get("tokens")
        self.prompts.check_token_ids(tokens)
        text = await self.prompts.run(self.prompts.metadata.tokenizer.decode, tokens)
        return web.json_response({"prompt": text})

    async def _kv_landings(self, request):
        """``{"ids": [request ids]}`` → ``{"landings": {id: {landed_unix_s, wan_kv_bytes,
        prefill_computed_unix_s, prefill_compute_ms}}}`` for those whose KV landed at main decode
        after their answer (ids not known here are left out; a request id carries 96 random bits,
        known to the client it was returned to)."""
        body = await self._json_body(request)
        ids = body.get("ids")
        if not (isinstance(ids, list) and len(ids) <= MAX_IDS_PER_QUERY and all(isinstance(i, str) for i in ids)):
            raise ApiError(400, f"'ids' must be a list of at most {MAX_IDS_PER_QUERY} request ids", param="ids")
        landings = self.kv_landings.of(ids)
        return web.json_response({"landings": {rid: landing.as_json() for rid, landing in landings.items()}})

    async def _health(self, request):
        live = self.placer.registry.summary()
        # Without main decoders the relays serve at site A: degraded, but serving.
        serving = bool(live["prefill"] and (live["main_decode"] or live["relay_decode"])) and not self.draining
        state = "ok" if serving and live["main_decode"] else "degraded" if serving else "unavailable"
        wan = self.placer.wan.current()
        body = {
            "status": state,
            "instances": live,
            "sites": {site: state.value for site, state in self.site_health.states.items()},
            "wan_estimate": {
                "bandwidth_mbit": round(wan.bandwidth_bps / 1e6, 2),
                "rtt_ms": round(wan.rtt_s * 1000, 1),
                "queue_ms": round(wan.queue_s * 1000, 1),
            },
        }
        return web.json_response(body, status=200 if serving else 503)

    async def _metrics(self, request):
        key_sha256 = self.config.metrics_key_sha256
        if key_sha256 and not key_matches(request.headers.get("Authorization", ""), key_sha256):
            raise ApiError(
                401, "the metrics key is required (Authorization: Bearer <metrics key>)", code="invalid_api_key"
            )
        body, content_type = exposition()
        return web.Response(body=body, headers={"Content-Type": content_type})

    async def _completions(self, request):
        return await self._serve(request, chat=False)

    async def _chat_completions(self, request):
        return await self._serve(request, chat=True)

    async def _serve(self, request: web.Request, chat: bool):
        task = asyncio.current_task()
        self.in_flight.add(task)
        try:
            if self.draining:
                raise ApiError(503, "router is shutting down", type="server_error", code="unavailable")
            body = await self._json_body(request)
            parsed = await self.prompts.run(self.prompts.parse, body, chat)
            self.placer.check_fits_a_pool(parsed)
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
            self.in_flight.discard(task)

    async def _json_body(self, request) -> dict:
        try:
            text = await request.text()
        except UnicodeDecodeError:
            raise ApiError(400, "request body is not valid UTF-8") from None
        return parse_json_body(text)
