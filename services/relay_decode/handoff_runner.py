"""Carries out a relayed request's handoff: what its ``HandoffMachine`` decides, done.

Each chunk goes to main decode as token IDs (a NATS request to the main decoder that holds
the prompt); a final chunk pauses the relay's sequence first and takes everything it emitted.
Once main decode owns the request the relay closes it (its sequence freed); if main decode
does not accept a chunk the relay resumes and finishes the request itself. The machine's
events become this service's logs (``handoff_state``, ``handoff_chunk``) and events on the
request's ``relay.decode`` span.
"""

import time

import nats
from opentelemetry import trace

from services.relay_decode.handoff import HandoffChunk, HandoffEvent, HandoffState, StateChanged
from services.relay_decode.relayed_request import RelayedRequest
from shared import subjects
from shared.engine.backend import EngineBackend, RequestStatus
from shared.messages import HandoffAccepted, HandoffReply, HandoffTokens, decoder, encode
from shared.metrics import HANDOFF_SECONDS
from shared.tracing import context_from, trace_headers, tracer

_reply_decoder = decoder(HandoffReply)
_tracer = tracer("pdd.relay_decode")


class HandoffRunner:
    """The relay service's hands for handoffs (``service``: the ``RelayDecodeService``)."""

    def __init__(self, service):
        self.service = service

    def start(self, request: RelayedRequest, chunk: HandoffChunk | None):
        """Send ``chunk`` (and the chunks that follow it) unless a handoff is already under way."""
        if chunk is not None and not request.handing_over and not request.closed:
            request.spawn(self._hand_over(request, chunk), "handoff")

    def record(self, request: RelayedRequest):
        """Log what the request's machine decided since last asked, and mark it on its span."""
        for event in request.machine.take_events():
            name, fields = describe(event)
            self.service.log.info(name, request_id=request.request_id, **fields)
            if request.span is not None:
                request.span.add_event(name, fields)

    async def _hand_over(self, request: RelayedRequest, chunk: HandoffChunk | None):
        service, machine, rid = self.service, request.machine, request.request_id
        worker, engine = service.worker, service.engine
        subject = subjects.handoff(request.ready.site, request.ready.instance_id, service.instance_id)
        started_s = time.perf_counter()
        while chunk is not None:
            tokens = await worker.call(chunk_tokens, engine, rid, chunk)
            if tokens is None:
                machine.finished_locally("relay sequence ended before the handoff")
                self.record(request)
                return
            answer = await self._send_chunk(request, subject, chunk, tokens)
            if not isinstance(answer, HandoffAccepted):
                machine.failed("main decode did not accept the handoff")
                self.record(request)
                await worker.call(resume_if_paused, engine, rid)
                service.loop.wake()
                return
            emitted = await worker.call(emitted_tokens, engine, rid)
            chunk = machine.accepted(answer.next_index, emitted or answer.next_index, service.load())
            self.record(request)
        if machine.state is HandoffState.RELEASED:
            await self._released(request, time.perf_counter() - started_s)

    async def _released(self, request: RelayedRequest, handoff_s: float):
        """Main decode owns the request: free it here."""
        service, machine = self.service, request.machine
        HANDOFF_SECONDS.labels(service.config.served_model_name, machine.mode).observe(handoff_s)
        await request.close("handed over", handoff_mode=machine.mode, handoff_chunks=machine.chunks)
        service.log.info(
            "handed_over",
            request_id=request.request_id,
            mode=machine.mode,
            chunks=machine.chunks,
            tokens=machine.handed_index,
            main_decode=request.ready.instance_id,
        )

    async def _send_chunk(self, request: RelayedRequest, subject: str, chunk: HandoffChunk, tokens: list[int]):
        service, rid = self.service, request.request_id
        handoff = HandoffTokens(
            request_id=rid,
            start_index=chunk.start_index,
            token_ids=tokens,
            final=chunk.final,
            mode=chunk.mode,
            chunk=chunk.chunk,
            relay_instance_id=service.instance_id,
        )
        span = _tracer.start_span(
            "handoff",
            context=context_from(request.traceparent),
            attributes={
                "request_id": rid,
                "mode": chunk.mode,
                "chunk": chunk.chunk,
                "tokens": len(tokens),
                "final": chunk.final,
            },
        )
        answer = None
        try:
            with trace.use_span(span, end_on_exit=False):
                reply = await service.nc.request(
                    subject, encode(handoff), headers=trace_headers(), timeout=service.config.handoff_timeout_s
                )
            answer = service.bad_messages.decode(_reply_decoder, reply, "reply:handoff")
        except (TimeoutError, nats.errors.Error) as exc:
            service.log.warning(
                "handoff_failed", request_id=rid, chunk=chunk.chunk, error=str(exc) or type(exc).__name__
            )
        finally:  # also when the request closes meanwhile
            span.set_attribute("accepted", isinstance(answer, HandoffAccepted))
            span.end()
        return answer


def describe(event: HandoffEvent) -> tuple[str, dict[str, str | int | float | bool]]:
    """A machine's event as a log event name and its fields."""
    if isinstance(event, StateChanged):
        return "handoff_state", {"previous": event.previous.value, "state": event.state.value, **event.why}
    chunk = event.chunk
    return "handoff_chunk", {
        "mode": chunk.mode,
        "chunk": chunk.chunk,
        "start": chunk.start_index,
        "end": chunk.end_index,
        "final": chunk.final,
    }


# --- on the engine thread ----------------------------------------------------------------


def chunk_tokens(engine: EngineBackend, request_id: str, chunk: HandoffChunk) -> list[int] | None:
    """The chunk's tokens; a final chunk pauses the sequence and takes all it emitted."""
    seq = engine.request(request_id)
    if seq is None or seq.status is not RequestStatus.RUNNING:
        return None
    if chunk.final:
        engine.pause(request_id)
        return list(seq.output_token_ids[chunk.start_index :])
    return list(seq.output_token_ids[chunk.start_index : chunk.end_index])


def emitted_tokens(engine: EngineBackend, request_id: str) -> int | None:
    """Tokens the running sequence emitted; None when it is not running (importing, ended)."""
    seq = engine.request(request_id)
    if seq is None or seq.status is not RequestStatus.RUNNING:
        return None
    return len(seq.output_token_ids)


def resume_if_paused(engine: EngineBackend, request_id: str):
    """Let a sequence paused for a final chunk that failed decode on."""
    seq = engine.request(request_id)
    if seq is not None and seq.status is RequestStatus.PAUSED:
        engine.resume(request_id)
