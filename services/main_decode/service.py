"""Main decode (MD, site B): the decode-strong side where every request ends.

It receives prompt KV over the WAN into its decode-side prefix cache (only the blocks it
lacks cross the link), announces ``KvReady``, and then either decodes at once (P→MD: the
prefill's first token came with the KV) or waits for the relay's handoff (P→RLD→MD): token
IDs it absorbs in one extend pass between decode steps of its running batch.
"""

import asyncio

from opentelemetry import trace

from shared import subjects
from shared.bulk.kv_importer import ImportState
from shared.bulk.receiver import FlowStats
from shared.config import BulkReceiverConfig
from shared.decode_service import DecodeService
from shared.engine.backend import RequestView, StepOutput
from shared.errors import HandoffRefused, InvalidRequestState, PddError, UnknownRequest
from shared.messages import HandoffAccepted, HandoffTokens, KvReady, RequestFailed, decoder, encode
from shared.metrics import HANDOFF_CHUNKS, HANDOFFS, REFUSED_MESSAGES
from shared.tracing import context_from, tracer

_handoff_decoder = decoder(HandoffTokens)
_tracer = tracer("pdd.main_decode")


class MainDecodeService(DecodeService):
    """The main decode actor."""

    service_name = "main_decode"
    producer = "MD"
    bulk_path = "wan"

    def __init__(self, config: BulkReceiverConfig, loaded=None):
        super().__init__(config, loaded)
        self._traceparents: dict[str, str | None] = {}
        self._recompute_spans: dict[str, trace.Span] = {}
        self._absorbing: dict[str, asyncio.Future] = {}
        self._relays: dict[str, str] = {}

    async def on_start(self):
        await super().on_start()
        await self.subscribe(
            subjects.handoff(self.config.site, self.instance_id, "*"), _handoff_decoder, self._on_handoff_msg
        )

    async def _on_import_complete(self, state: ImportState, seq: RequestView, stats: FlowStats):
        rid = seq.request_id
        if state.flow_open.relay_instance_id:  # before KvReady: the relay hands over once it hears it
            self._relays[rid] = state.flow_open.relay_instance_id
        await self.publish(
            subjects.request_events(rid, self.instance_id),
            KvReady(
                request_id=rid,
                instance_id=self.instance_id,
                site=self.config.site,
                cached_tokens=state.cached_tokens,
                imported_tokens=seq.num_imported_tokens,
                wan_kv_bytes=stats.bytes_received,
                transfer_s=stats.transfer_s,
                throughput_bps=(stats.streaming_bytes_per_s or 0.0) * 8,
            ),
        )
        self._traceparents[rid] = state.flow_open.traceparent
        if seq.output_token_ids:
            self.start_span(rid, "main.decode", state.flow_open.traceparent, pipeline="P-MD")
        await super()._on_import_complete(state, seq, stats)

    async def _on_handoff_msg(self, handoff: HandoffTokens, msg):
        asyncio.create_task(self._accept_handoff(handoff, msg))

    async def _accept_handoff(self, handoff: HandoffTokens, msg):
        rid = handoff.request_id
        parent = context_from(headers=msg.headers)
        recompute = _tracer.start_span(
            "main.recompute",
            context=parent,
            attributes={
                "request_id": rid,
                "tokens": len(handoff.token_ids),
                "chunk": handoff.chunk,
                "mode": handoff.mode,
                "final": handoff.final,
            },
        )
        try:
            seq = await self.worker.call(self._extend, handoff)
            if not handoff.final:
                # A catch-up chunk: answer once its KV is computed, so the relay sends the
                # next chunk only when this one is absorbed.
                absorbed = asyncio.get_running_loop().create_future()
                self._absorbing[rid] = absorbed
                self.loop.wake()
                await asyncio.wait_for(absorbed, self.config.handoff_timeout_s)
        except (TimeoutError, PddError) as exc:
            recompute.end()
            self._absorbing.pop(rid, None)
            if isinstance(exc, HandoffRefused):
                REFUSED_MESSAGES.labels(self.service_name, "handoff").inc()
            self.log.warning("handoff_refused", request_id=rid, error=str(exc) or "timeout")
            await msg.respond(
                encode(
                    RequestFailed(
                        request_id=rid,
                        instance_id=self.instance_id,
                        code=getattr(exc, "code", "timeout"),
                        message=str(exc) or "absorbing timed out",
                    )
                )
            )
            return
        accepted = HandoffAccepted(
            request_id=rid,
            instance_id=self.instance_id,
            next_index=len(seq.output_token_ids),
            chunk=handoff.chunk,
            mode=handoff.mode,
            final=handoff.final,
        )
        await msg.respond(encode(accepted))
        await self.publish(subjects.request_events(rid, self.instance_id), accepted)
        self.log.info(
            "handoff_accepted",
            request_id=rid,
            tokens=len(handoff.token_ids),
            chunk=handoff.chunk,
            mode=handoff.mode,
            final=handoff.final,
        )
        HANDOFF_CHUNKS.labels(handoff.mode).inc()
        if not handoff.final:
            recompute.end()
            return
        HANDOFFS.labels(handoff.mode).inc()
        if seq.finished:
            recompute.end()
            await self.worker.call(self.engine.abort, rid)
            return
        self._recompute_spans[rid] = recompute  # ends with the first token main decode samples
        if rid not in self.spans:
            self.start_span(rid, "main.decode", self._traceparents.get(rid), pipeline="P-RLD-MD")
        self.loop.wake()

    def _extend(self, handoff: HandoffTokens):
        seq = self.engine.request(handoff.request_id)
        if seq is None:
            raise UnknownRequest(f"unknown request {handoff.request_id!r}")
        relay = self._relays.get(handoff.request_id)
        if relay is None or handoff.relay_instance_id != relay:
            raise HandoffRefused(f"handoff from {handoff.relay_instance_id!r}; the request's relay is {relay!r}")
        room = seq.max_tokens - handoff.start_index
        if len(handoff.token_ids) > room:
            raise HandoffRefused(f"handoff of {len(handoff.token_ids)} tokens; only {room} fit max_tokens")
        vocab = self.engine.vocab_size
        if any(not 0 <= t < vocab for t in handoff.token_ids):
            raise HandoffRefused("handoff holds token ids outside the vocabulary")
        if handoff.start_index != len(seq.output_token_ids):
            raise InvalidRequestState(
                f"handoff starts at {handoff.start_index}, main decode holds {len(seq.output_token_ids)} output tokens"
            )
        return self.engine.extend(handoff.request_id, handoff.token_ids, sample=handoff.final)

    async def _on_outputs(self, outputs: list[StepOutput]):
        for out in outputs:
            if out.absorbed:
                future = self._absorbing.pop(out.request_id, None)
                if future is not None and not future.done():
                    future.set_result(out.token_index)
                continue
            span = self._recompute_spans.pop(out.request_id, None)
            if span is not None:
                span.end()
        await super()._on_outputs([o for o in outputs if not o.absorbed])

    async def on_finished(self, out: StepOutput):
        self._traceparents.pop(out.request_id, None)
        self._relays.pop(out.request_id, None)

    async def on_cancel(self, cancel):
        self._traceparents.pop(cancel.request_id, None)
        self._relays.pop(cancel.request_id, None)
        span = self._recompute_spans.pop(cancel.request_id, None)
        if span is not None:
            span.end()
        await super().on_cancel(cancel)
