"""A running request's answer to its client: one JSON body, or server-sent events.

Every event write has a timeout (``sse_write_timeout_s``): a client that stops reading is
dropped, and closing its flow cancels the request and frees its KV everywhere.
"""

import asyncio
import contextlib

import msgspec
import structlog
from aiohttp import HttpVersion11, web

from services.router import openai_api
from services.router.api_error import ApiError
from services.router.logprobs_format import LogprobsFormatter
from services.router.openai_api import ParsedRequest
from services.router.prompts import PromptBuilder
from services.router.recovery_plan import UpstreamFailed, UpstreamTimeout
from services.router.request_flow import RequestFlow
from services.router.request_metrics import RequestMetrics
from services.router.sse_chunks import ContentEvents
from shared.metrics import SLOW_CLIENTS

log = structlog.get_logger(__name__)
_encode_json = msgspec.json.Encoder().encode


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
        detok = self.prompts.detokenizer(req.sampling.stop)
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
        if request.version == HttpVersion11:
            response.enable_chunked_encoding()  # what aiohttp would pick; set here, it is known (write_framed)
        await response.prepare(request)
        try:
            try:
                async with contextlib.aclosing(flow.tokens()) as batches:
                    closing = await self._stream_events(request, response, req, flow, metrics, batches)
                metrics.finish(flow.outcome, "ok")
            except (UpstreamFailed, UpstreamTimeout) as exc:
                metrics.finish(flow.outcome, "error")
                closing = _event(upstream_error(exc).body())
            # The closing events, [DONE] and the end of the body: one write.
            await asyncio.wait_for(response.write_eof(closing + b"data: [DONE]\n\n"), self.sse_write_timeout_s)
        except (TimeoutError, SlowClient):
            # The flow is closed (its request cancelled, its KV freed); so is the connection.
            SLOW_CLIENTS.inc()
            metrics.finish(flow.outcome, "error")
            log.warning("slow_client_dropped", request_id=flow.request_id, timeout_s=self.sse_write_timeout_s)
            if request.transport is not None:
                request.transport.abort()
        return response

    async def _stream_events(
        self,
        request: web.Request,
        response: web.StreamResponse,
        req: ParsedRequest,
        flow: RequestFlow,
        metrics: RequestMetrics,
        batches,
    ) -> bytes:
        """Write the content events as they come; return the closing ones (the text held back
        to the end, the finish reason, the usage), for the caller to write with the body's end."""
        events = EventStream(self, request, response, req, flow, metrics)
        flow.sink = events
        try:
            async for batch in batches:
                await events.send(batch)
        finally:
            flow.sink = None
        closing = []
        rest = events.detok.flush()
        if rest:
            closing.append(_event(openai_api.chunk_body(req, flow.request_id, rest)))
        outcome = flow.outcome
        last = openai_api.chunk_body(req, flow.request_id, None, outcome.finish_reason, pdd=outcome.as_pdd())
        closing.append(_event(last))
        if req.include_usage:
            usage = openai_api.usage_chunk(req, flow.request_id, outcome.output_tokens, outcome.prefill_cached_tokens)
            closing.append(_event(usage))
        return b"".join(closing)

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
        await self._write(response, _event(body))

    async def _write(self, response: web.StreamResponse, data: bytes):
        try:
            async with asyncio.timeout(self.sse_write_timeout_s):  # no task per write, unlike wait_for
                await response.write(data)
        except TimeoutError:
            raise SlowClient() from None


def _event(body: dict) -> bytes:
    """One server-sent event carrying ``body``."""
    return b"data: " + _encode_json(body) + b"\n\n"


MAX_WRITE_NOW_BYTES = 16 << 10
"""Below every transport's high-water mark (uvloop's and asyncio's: 64 KiB)."""


def writes_now(transport: asyncio.Transport | None, data: bytes) -> bool:
    """Whether a response's ``write(data)`` on ``transport`` completes without waiting: the
    transport is open and holds no unsent bytes (so it is not paused: a transport resumes
    writing once its buffer drains below the low-water mark), and ``data`` alone cannot reach
    the high-water mark. A client that stops reading fills its kernel buffers, then the
    transport's: from then on every write waits, with the slow-client timeout."""
    return (
        transport is not None
        and not transport.is_closing()
        and transport.get_write_buffer_size() == 0
        and len(data) < MAX_WRITE_NOW_BYTES
    )


def write_framed(transport: asyncio.Transport, data: bytes, chunked: bool):
    """A response body's ``data`` written straight to its transport (``writes_now`` holds), as
    the response's own writer would put it on the wire: in one HTTP/1.1 chunk when the response
    is chunked. One transport call, no coroutine; for plain content events, the bulk of a
    stream. The writer's byte counts do not see it (they only pace its drains, which
    ``writes_now`` replaces here)."""
    transport.write(b"%x\r\n%b\r\n" % (len(data), data) if chunked else data)


class EventStream:
    """One streaming answer's content events: a batch of tokens at a time from the flow's task
    (``send``), or one plain token at a time from the mailbox's callback (``deliver``, a
    ``token_intake.DirectSink``) while the client keeps up."""

    def __init__(
        self,
        writer: ResponseWriter,
        request: web.Request,
        response: web.StreamResponse,
        req: ParsedRequest,
        flow: RequestFlow,
        metrics: RequestMetrics,
    ):
        self.writer, self.response, self.req, self.flow, self.metrics = writer, response, req, flow, metrics
        self.transport = request.transport
        self.detok = writer.prompts.detokenizer(req.sampling.stop)
        self.content = ContentEvents(req, flow.request_id)
        self.first = True
        self.num_sent = self.num_chars = 0

    async def send(self, batch: list[int]):
        """Write the event of a batch the flow's task yielded (none when it adds no text)."""
        req, flow = self.req, self.flow
        delta = await self.writer.prompts.detokenize_batch(self.detok, batch)
        logprobs = self.writer._logprobs(req, flow, self.num_sent, self.num_sent + len(batch), self.num_chars)
        self.num_sent += len(batch)
        if logprobs is not None and not req.chat:
            self.num_chars += sum(map(len, logprobs["tokens"]))
        if delta and not self.first and logprobs is None:
            await self._write(self.content.event(delta))
        elif delta or self.first or logprobs is not None:
            chunk = openai_api.chunk_body(req, flow.request_id, delta, first=self.first, logprobs=logprobs)
            await self.writer._sse(self.response, chunk)
            self.first = False
        else:
            return
        self.metrics.delivered(flow.outcome.pipeline)

    def ready(self) -> bool:
        """A plain content event (after the first, without log-probabilities) can go now."""
        return not self.first and self.req.sampling.logprobs is None and writes_now(self.transport, b"")

    async def _write(self, data: bytes):
        if writes_now(self.transport, data):
            await self.response.write(data)  # it cannot wait: no timer
        else:
            await self.writer._write(self.response, data)

    def deliver(self, batch: list[int]):
        """``send`` of a short batch, synchronously (``ready`` held)."""
        delta = self.detok.add(batch)
        self.num_sent += len(batch)
        if delta:
            write_framed(self.transport, self.content.event(delta), self.response.chunked)
            self.metrics.delivered(self.flow.outcome.pipeline)
