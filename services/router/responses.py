"""A running request's answer to its client: one JSON body, or server-sent events.

Every event write has a timeout (``sse_write_timeout_s``): a client that stops reading is
dropped, and closing its flow cancels the request and frees its KV everywhere.
"""

import asyncio
import contextlib
import json

import structlog
from aiohttp import web

from services.router import openai_api
from services.router.api_error import ApiError
from services.router.detokenizer import Detokenizer
from services.router.logprobs_format import LogprobsFormatter
from services.router.openai_api import ParsedRequest
from services.router.prompts import PromptBuilder
from services.router.request_flow import RequestFlow, UpstreamFailed, UpstreamTimeout
from services.router.request_metrics import RequestMetrics
from services.router.sse_chunks import ContentEvents
from shared.metrics import SLOW_CLIENTS

log = structlog.get_logger(__name__)


class SlowClient(Exception):
    """A streaming client did not accept an event within ``sse_write_timeout_s``."""


def upstream_error(exc: UpstreamFailed | UpstreamTimeout) -> ApiError:
    """The OpenAI error a client gets for a request the deployment could not finish."""
    if isinstance(exc, UpstreamTimeout):
        return ApiError(504, str(exc), type="timeout", code="timeout")
    return ApiError(502, str(exc), type="server_error", code="upstream_failed")


class ResponseWriter:
    """Turns a flow's token batches into the OpenAI response shapes."""

    def __init__(self, prompts: PromptBuilder, sse_write_timeout_s: float):
        self.prompts = prompts
        self.sse_write_timeout_s = sse_write_timeout_s
        self._logprobs_format = LogprobsFormatter(prompts.metadata.tokenizer)

    async def collect(self, req: ParsedRequest, flow: RequestFlow, metrics: RequestMetrics) -> web.Response:
        """The whole answer as one JSON body."""
        detok = Detokenizer(self.prompts.metadata.tokenizer, req.sampling.stop)
        try:
            async with contextlib.aclosing(flow.tokens()) as batches:
                async for batch in batches:
                    await self.prompts.detokenize_batch(detok, batch)
        except (UpstreamFailed, UpstreamTimeout) as exc:
            metrics.finish(flow.outcome, "error")
            raise upstream_error(exc) from None
        metrics.finish(flow.outcome, "ok")
        outcome = flow.outcome
        body = openai_api.completion_body(
            req,
            flow.request_id,
            detok.emitted + detok.flush(),
            outcome.finish_reason,
            outcome.output_tokens,
            outcome.as_pdd(),
            outcome.prefill_cached_tokens,
            self._logprobs(req, flow, 0, len(flow.log.token_ids)),
        )
        return web.json_response(body)

    async def stream(
        self, request: web.Request, req: ParsedRequest, flow: RequestFlow, metrics: RequestMetrics
    ) -> web.StreamResponse:
        """The answer as server-sent events, ``[DONE]`` last; an upstream failure is an error event."""
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        try:
            try:
                async with contextlib.aclosing(flow.tokens()) as batches:
                    await self._stream_events(response, req, flow, metrics, batches)
                metrics.finish(flow.outcome, "ok")
            except (UpstreamFailed, UpstreamTimeout) as exc:
                metrics.finish(flow.outcome, "error")
                await self._sse(response, upstream_error(exc).body())
            await self._write(response, b"data: [DONE]\n\n")
            await asyncio.wait_for(response.write_eof(), self.sse_write_timeout_s)
        except (TimeoutError, SlowClient):
            # The flow is closed (its request cancelled, its KV freed); so is the connection.
            SLOW_CLIENTS.inc()
            metrics.finish(flow.outcome, "error")
            log.warning("slow_client_dropped", request_id=flow.request_id, timeout_s=self.sse_write_timeout_s)
            if request.transport is not None:
                request.transport.abort()
        return response

    async def _stream_events(
        self, response: web.StreamResponse, req: ParsedRequest, flow: RequestFlow, metrics: RequestMetrics, batches
    ):
        detok, first = Detokenizer(self.prompts.metadata.tokenizer, req.sampling.stop), True
        content = ContentEvents(req, flow.request_id)
        num_sent, num_chars = 0, 0
        async for batch in batches:
            delta = await self.prompts.detokenize_batch(detok, batch)
            logprobs = self._logprobs(req, flow, num_sent, num_sent + len(batch), num_chars)
            num_sent += len(batch)
            if logprobs is not None and not req.chat:
                num_chars += sum(map(len, logprobs["tokens"]))
            if delta and not first and logprobs is None:
                await self._write(response, content.event(delta))
            elif delta or first or logprobs is not None:
                chunk = openai_api.chunk_body(req, flow.request_id, delta, first=first, logprobs=logprobs)
                await self._sse(response, chunk)
                first = False
            else:
                continue
            metrics.delivered(flow.outcome.pipeline)
        rest = detok.flush()
        if rest:
            await self._sse(response, openai_api.chunk_body(req, flow.request_id, rest))
        outcome = flow.outcome
        last = openai_api.chunk_body(req, flow.request_id, None, outcome.finish_reason, pdd=outcome.as_pdd())
        await self._sse(response, last)
        if req.include_usage:
            usage = openai_api.usage_chunk(req, flow.request_id, outcome.output_tokens, outcome.prefill_cached_tokens)
            await self._sse(response, usage)

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

    async def _sse(self, response: web.StreamResponse, body: dict):
        """Write one event; raise SlowClient when the client does not take it in time."""
        await self._write(response, b"data: " + json.dumps(body).encode() + b"\n\n")

    async def _write(self, response: web.StreamResponse, data: bytes):
        try:
            async with asyncio.timeout(self.sse_write_timeout_s):  # no task per write, unlike wait_for
                await response.write(data)
        except TimeoutError:
            raise SlowClient() from None
