"""Main decode's side of a handoff: check a relay's chunk, absorb it, answer.

A chunk is taken only from the relay the request's flow named, only if it fits the request's
``max_tokens`` and vocabulary and continues exactly where main decode stands. Its token IDs
are extended into the sequence in one pass between decode steps: a catch-up chunk is answered
once its KV is computed (nothing sampled), the final one at once, after which main decode
owns the request and samples on.
"""

import asyncio

from services.main_decode.main_request import MainRequest
from shared import subjects
from shared.engine.backend import EngineBackend, RequestView
from shared.errors import HandoffRefused, InvalidRequestState, PddError, RequestCancelled, UnknownRequest
from shared.messages import HandoffAccepted, HandoffTokens, RequestFailed, encode
from shared.metrics import HANDOFF_CHUNKS, HANDOFFS, REFUSED_MESSAGES
from shared.tracing import context_from, tracer

_tracer = tracer("pdd.main_decode")


class HandoffIntake:
    """Takes relays' handoffs for the main decode service (``service``: the ``MainDecodeService``)."""

    def __init__(self, service):
        self.service = service

    async def accept(self, handoff: HandoffTokens, msg):
        """Absorb one chunk and answer the relay with ``HandoffAccepted`` or ``RequestFailed``."""
        recompute = _tracer.start_span(
            "main.recompute",
            context=context_from(headers=msg.headers),
            attributes={
                "request_id": handoff.request_id,
                "tokens": len(handoff.token_ids),
                "chunk": handoff.chunk,
                "mode": handoff.mode,
                "final": handoff.final,
            },
        )
        request = self.service.requests.get(handoff.request_id)
        try:
            seq = await self._absorb(request, handoff)
        except (TimeoutError, PddError) as exc:
            recompute.end()
            await self._refuse(msg, handoff.request_id, exc)
            return
        await self._answer(msg, handoff, seq)
        HANDOFF_CHUNKS.labels(handoff.mode).inc()
        if not handoff.final:
            recompute.end()
            return
        HANDOFFS.labels(handoff.mode).inc()
        await self._take_over(request, seq, recompute)

    async def _absorb(self, request: MainRequest | None, handoff: HandoffTokens) -> RequestView:
        service = self.service
        relay_id = request.relay_id if request is not None else None
        seq = await service.worker.call(extend_checked, service.engine, handoff, relay_id)
        if handoff.final:
            return seq
        # A catch-up chunk: answer once its KV is computed, so the relay sends the next
        # chunk only when this one is absorbed.
        if request.closed:
            raise RequestCancelled(f"request closed while absorbing: {request.closed_because}")
        absorbed = request.absorb()
        service.loop.wake()
        try:
            await asyncio.wait_for(absorbed, service.config.handoff_timeout_s)
        finally:
            if request.absorbing is absorbed:
                request.absorbing = None
        return seq

    async def _take_over(self, request: MainRequest, seq: RequestView, recompute):
        """After the final chunk main decode owns the request: decode on, or end it."""
        if request.closed:
            recompute.end()
            return
        if seq.finished:  # the relay's tokens reached the end: nothing left to sample
            recompute.end()
            await request.close("finished by the handoff")
            return
        request.recompute_span = recompute  # ends with the first token main decode samples
        if request.span is None:
            request.start_span("main.decode", pipeline="P-RLD-MD")
        self.service.loop.wake()

    async def _answer(self, msg, handoff: HandoffTokens, seq: RequestView):
        service, rid = self.service, handoff.request_id
        accepted = HandoffAccepted(
            request_id=rid,
            instance_id=service.instance_id,
            next_index=len(seq.output_token_ids),
            chunk=handoff.chunk,
            mode=handoff.mode,
            final=handoff.final,
        )
        await msg.respond(encode(accepted))
        await service.publish(subjects.request_events(rid, service.instance_id), accepted)
        service.log.info(
            "handoff_accepted",
            request_id=rid,
            tokens=len(handoff.token_ids),
            chunk=handoff.chunk,
            mode=handoff.mode,
            final=handoff.final,
        )

    async def _refuse(self, msg, request_id: str, exc: Exception):
        service = self.service
        if isinstance(exc, HandoffRefused):
            REFUSED_MESSAGES.labels(service.service_name, "handoff").inc()
        service.log.warning("handoff_refused", request_id=request_id, error=str(exc) or "timeout")
        await msg.respond(
            encode(
                RequestFailed(
                    request_id=request_id,
                    instance_id=service.instance_id,
                    code=getattr(exc, "code", "timeout"),
                    message=str(exc) or "absorbing timed out",
                )
            )
        )


def extend_checked(engine: EngineBackend, handoff: HandoffTokens, relay_id: str | None) -> RequestView:
    """Extend the sequence by the chunk's tokens if the chunk is acceptable (engine thread)."""
    seq = engine.request(handoff.request_id)
    if seq is None:
        raise UnknownRequest(f"unknown request {handoff.request_id!r}")
    if relay_id is None or handoff.relay_instance_id != relay_id:
        raise HandoffRefused(f"handoff from {handoff.relay_instance_id!r}; the request's relay is {relay_id!r}")
    room = seq.max_tokens - handoff.start_index
    if len(handoff.token_ids) > room:
        raise HandoffRefused(f"handoff of {len(handoff.token_ids)} tokens; only {room} fit max_tokens")
    vocab = engine.vocab_size
    if any(not 0 <= t < vocab for t in handoff.token_ids):
        raise HandoffRefused("handoff holds token ids outside the vocabulary")
    if handoff.start_index != len(seq.output_token_ids):
        raise InvalidRequestState(
            f"handoff starts at {handoff.start_index}, main decode holds {len(seq.output_token_ids)} output tokens"
        )
    return engine.extend(handoff.request_id, handoff.token_ids, sample=handoff.final)
