"""Relay decode (RLD, site A): masks the WAN transfer with eager tokens.

It receives the prompt KV over the fast local path with the prefill's first token, starts
decoding at once and streams those eager tokens to the client. When main decode announces
``KvReady`` it hands over the token IDs it produced (never KV); once main decode accepts,
it frees the request. If the handoff fails it simply finishes the request itself.
"""

import asyncio

import nats
from opentelemetry import trace

from shared import subjects
from shared.bulk.kv_importer import ImportState
from shared.bulk.receiver import FlowStats
from shared.decode_service import DecodeService
from shared.engine.engine import StepOutput
from shared.engine.sequence import Sequence, SequenceStatus
from shared.messages import (
    FlowOpen,
    HandoffAccepted,
    HandoffReply,
    HandoffTokens,
    KvReady,
    RequestEvent,
    decoder,
    encode,
)
from shared.metrics import EAGER_TOKENS
from shared.tracing import context_from, trace_headers, tracer

_event_decoder = decoder(RequestEvent)
_reply_decoder = decoder(HandoffReply)
_tracer = tracer("pdd.relay_decode")


class RelayDecodeService(DecodeService):
    """The relay decode actor."""

    service_name = "relay_decode"
    producer = "RLD"
    bulk_path = "local"

    def __init__(self, config, loaded=None):
        super().__init__(config, loaded)
        self._event_subs: dict[str, nats.aio.subscription.Subscription] = {}
        self._traceparents: dict[str, str | None] = {}

    async def _on_import_open(self, flow_open: FlowOpen):
        rid = flow_open.request_id
        self._traceparents[rid] = flow_open.traceparent
        self._event_subs[rid] = await self.nc.subscribe(
            subjects.request_events(rid), cb=self._on_request_event)

    async def _on_import_complete(self, state: ImportState, seq: Sequence, stats: FlowStats):
        self.start_span(seq.request_id, "relay.decode", state.flow_open.traceparent)
        EAGER_TOKENS.inc(len(seq.output_token_ids))
        await super()._on_import_complete(state, seq, stats)

    async def _on_request_event(self, msg):
        event = _event_decoder.decode(msg.data)
        if isinstance(event, KvReady):
            asyncio.create_task(self._hand_over(event))

    async def _hand_over(self, ready: KvReady):
        rid = ready.request_id
        token_ids = await self.worker.call(self._pause_for_handoff, rid)
        if token_ids is None:
            return  # finished here already, or dropped
        span = _tracer.start_span("handoff", context=context_from(self._traceparents.get(rid)),
                                  attributes={"request_id": rid, "mode": "one-shot", "chunk": 1,
                                              "tokens": len(token_ids)})
        subject = subjects.instance_work(ready.site, "main_decode", ready.instance_id, subjects.HANDOFF)
        handoff = HandoffTokens(request_id=rid, start_index=0, token_ids=token_ids, final=True)
        try:
            with trace.use_span(span, end_on_exit=False):
                reply = await self.nc.request(subject, encode(handoff), headers=trace_headers(),
                                              timeout=self.config.handoff_timeout_s)
            answer = _reply_decoder.decode(reply.data)
        except (nats.errors.Error, asyncio.TimeoutError) as exc:
            answer = None
            self.log.warning("handoff_failed", request_id=rid, error=str(exc) or type(exc).__name__)
        span.set_attribute("accepted", isinstance(answer, HandoffAccepted))
        span.end()
        if isinstance(answer, HandoffAccepted):
            await self.worker.call(self._free_if_live, rid)
            self.end_span(rid, handed_over_tokens=len(token_ids))
            await self._forget(rid)
            self.log.info("handed_over", request_id=rid, tokens=len(token_ids),
                          main_decode=ready.instance_id)
        else:
            # Main decode could not take it: finish the request here.
            await self.worker.call(self._resume_if_paused, rid)
            self.loop.wake()

    def _pause_for_handoff(self, request_id: str) -> list[int] | None:
        engine = self.engine
        if not engine.holds(request_id) or engine.get(request_id).status is not SequenceStatus.RUNNING:
            return None
        engine.pause(request_id)
        return list(engine.get(request_id).output_token_ids)

    def _resume_if_paused(self, request_id: str):
        engine = self.engine
        if engine.holds(request_id) and engine.get(request_id).status is SequenceStatus.PAUSED:
            engine.resume(request_id)

    async def _on_outputs(self, outputs: list[StepOutput]):
        EAGER_TOKENS.inc(sum(1 for o in outputs if o.token_id is not None))
        await super()._on_outputs(outputs)

    async def on_finished(self, out: StepOutput):
        await self._forget(out.request_id)

    async def on_cancel(self, cancel):
        await super().on_cancel(cancel)
        await self._forget(cancel.request_id)

    async def _forget(self, request_id: str):
        self._traceparents.pop(request_id, None)
        sub = self._event_subs.pop(request_id, None)
        if sub is not None:
            try:
                await sub.unsubscribe()
            except nats.errors.Error:
                pass
