"""Relay decode (RLD, site A): masks the WAN transfer with eager tokens.

It receives the prompt KV over the fast local path with the prefill's first token, starts
decoding at once and streams those eager tokens to the client. When main decode announces
``KvReady`` the request's ``HandoffMachine`` decides one-shot or catch-up; the relay hands
over token IDs (never KV) chunk by chunk and, once main decode owns the request, frees it.
If a handoff fails the relay simply finishes the request itself.
"""

import asyncio
import time

import nats
from opentelemetry import trace

from services.relay_decode.handoff import (
    HandoffChunk,
    HandoffEvent,
    HandoffMachine,
    HandoffPolicy,
    HandoffState,
    StateChanged,
)
from shared import subjects
from shared.bulk.kv_importer import ImportState
from shared.bulk.receiver import FlowStats
from shared.config import RelayDecodeConfig
from shared.decode_service import DecodeService
from shared.engine.backend import RequestStatus, RequestView, StepOutput
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
from shared.metrics import EAGER_TOKENS, HANDOFF_SECONDS, REFUSED_MESSAGES
from shared.tracing import context_from, trace_headers, tracer

_event_decoder = decoder(RequestEvent)
_reply_decoder = decoder(HandoffReply)
_tracer = tracer("pdd.relay_decode")


class RelayDecodeService(DecodeService):
    """The relay decode actor."""

    service_name = "relay_decode"
    producer = "RLD"
    bulk_path = "local"
    publishes_kv_events = False  # a relay's cache is not a routing target

    def __init__(self, config: RelayDecodeConfig, loaded=None):
        super().__init__(config, loaded)
        self.config: RelayDecodeConfig = config
        self.policy = HandoffPolicy(
            config.catch_up_threshold_tokens,
            config.final_gap_tokens,
            config.load_watermark,
            config.max_catch_up_chunks,
            config.max_chunk_tokens,
        )
        self.machines: dict[str, HandoffMachine] = {}
        self._main: dict[str, KvReady] = {}
        self._main_decoders: dict[str, str | None] = {}  # the main decoder each FlowOpen named
        self._traceparents: dict[str, str | None] = {}
        self._handoffs: dict[str, asyncio.Task] = {}

    async def on_start(self):
        await super().on_start()
        # One standing subscription: a per-request one, made when the flow opens, could miss
        # a KvReady that the main decoder publishes before the interest reaches its site.
        await self.subscribe(subjects.REQUEST_EVENTS_ALL, _event_decoder, self._on_request_event)

    def load(self) -> float:
        """Active sequences over capacity: what the handoff mode switch looks at."""
        # Per emitted token, on the event loop: count requests only, not the pool's blocks.
        return len(self.engine.request_ids()) / self.config.max_sequences

    async def _on_import_open(self, flow_open: FlowOpen):
        rid = flow_open.request_id
        self._traceparents[rid] = flow_open.traceparent
        self._main_decoders[rid] = flow_open.main_decode_instance_id
        self.machines[rid] = HandoffMachine(rid, self.policy)

    async def _on_import_complete(self, state: ImportState, seq: RequestView, stats: FlowStats):
        self.start_span(seq.request_id, "relay.decode", state.flow_open.traceparent)
        EAGER_TOKENS.inc(len(seq.output_token_ids))
        await super()._on_import_complete(state, seq, stats)
        early = self._main.get(seq.request_id)
        if early is not None:  # main decode was ready before the local copy landed
            await self._main_decode_ready(early)

    async def _on_request_event(self, event, msg):
        if isinstance(event, KvReady) and event.request_id in self.machines:
            if event.instance_id != self._main_decoders.get(event.request_id):
                REFUSED_MESSAGES.labels(self.service_name, "kv_ready_from_another_main_decode").inc()
                self.log.warning("kv_ready_refused", request_id=event.request_id, instance=event.instance_id)
                return
            self._main[event.request_id] = event
            await self._main_decode_ready(event)

    async def _main_decode_ready(self, event: KvReady):
        machine = self.machines.get(event.request_id)
        if machine is None or machine.state is not HandoffState.DECODING:
            return
        emitted = await self.worker.call(self._emitted, event.request_id)
        if emitted is None:
            return  # still importing (retried when the import completes), finished, or dropped
        chunk = machine.kv_ready(emitted, self.load())
        self._record(machine)
        self._start_handoff(event.request_id, chunk)

    def _start_handoff(self, request_id: str, chunk: HandoffChunk | None):
        if chunk is not None and request_id not in self._handoffs:
            task = asyncio.create_task(self._hand_over(request_id, chunk))
            self._handoffs[request_id] = task
            task.add_done_callback(lambda _: self._handoffs.pop(request_id, None))

    async def _hand_over(self, rid: str, chunk: HandoffChunk | None):
        machine, ready = self.machines[rid], self._main[rid]
        subject = subjects.handoff(ready.site, ready.instance_id, self.instance_id)
        started = time.perf_counter()
        while chunk is not None:
            tokens = await self.worker.call(self._chunk_tokens, rid, chunk)
            if tokens is None:
                machine.finished_locally("relay sequence ended before the handoff")
                self._record(machine)
                return
            answer = await self._send_chunk(rid, subject, chunk, tokens)
            if not isinstance(answer, HandoffAccepted):
                machine.failed("main decode did not accept the handoff")
                self._record(machine)
                await self.worker.call(self._resume_if_paused, rid)
                self.loop.wake()
                return
            emitted = await self.worker.call(self._emitted, rid)
            chunk = machine.accepted(answer.next_index, emitted or answer.next_index, self.load())
            self._record(machine)
        if machine.state is HandoffState.RELEASED:
            HANDOFF_SECONDS.labels(self.config.served_model_name, machine.mode).observe(time.perf_counter() - started)
            await self.worker.call(self.engine.abort, rid)
            self.end_span(rid, handoff_mode=machine.mode, handoff_chunks=machine.chunks)
            self.log.info(
                "handed_over",
                request_id=rid,
                mode=machine.mode,
                chunks=machine.chunks,
                tokens=machine.handed_index,
                main_decode=ready.instance_id,
            )
            await self._forget(rid)

    async def _send_chunk(self, rid: str, subject: str, chunk: HandoffChunk, tokens: list[int]):
        handoff = HandoffTokens(
            request_id=rid,
            start_index=chunk.start_index,
            token_ids=tokens,
            final=chunk.final,
            mode=chunk.mode,
            chunk=chunk.chunk,
            relay_instance_id=self.instance_id,
        )
        span = _tracer.start_span(
            "handoff",
            context=context_from(self._traceparents.get(rid)),
            attributes={
                "request_id": rid,
                "mode": chunk.mode,
                "chunk": chunk.chunk,
                "tokens": len(tokens),
                "final": chunk.final,
            },
        )
        try:
            with trace.use_span(span, end_on_exit=False):
                reply = await self.nc.request(
                    subject, encode(handoff), headers=trace_headers(), timeout=self.config.handoff_timeout_s
                )
            answer = self.bad_messages.decode(_reply_decoder, reply, "reply:handoff")
        except (TimeoutError, nats.errors.Error) as exc:
            self.log.warning("handoff_failed", request_id=rid, chunk=chunk.chunk, error=str(exc) or type(exc).__name__)
            answer = None
        span.set_attribute("accepted", isinstance(answer, HandoffAccepted))
        span.end()
        return answer

    def _chunk_tokens(self, rid: str, chunk: HandoffChunk) -> list[int] | None:
        """The chunk's tokens; a final chunk pauses the sequence and takes all it emitted."""
        seq = self.engine.request(rid)
        if seq is None or seq.status is not RequestStatus.RUNNING:
            return None
        if chunk.final:
            self.engine.pause(rid)
            return list(seq.output_token_ids[chunk.start_index :])
        return list(seq.output_token_ids[chunk.start_index : chunk.end_index])

    def _emitted(self, rid: str) -> int | None:
        seq = self.engine.request(rid)
        if seq is None or seq.status is not RequestStatus.RUNNING:
            return None
        return len(seq.output_token_ids)

    def _resume_if_paused(self, request_id: str):
        seq = self.engine.request(request_id)
        if seq is not None and seq.status is RequestStatus.PAUSED:
            self.engine.resume(request_id)

    async def _on_outputs(self, outputs: list[StepOutput]):
        EAGER_TOKENS.inc(sum(1 for o in outputs if o.token_id is not None))
        await super()._on_outputs(outputs)
        for out in outputs:
            machine = self.machines.get(out.request_id)
            if machine is not None and not out.finished and out.token_id is not None:
                chunk = machine.tokens_emitted(out.token_index + 1, self.load())
                self._record(machine)
                self._start_handoff(out.request_id, chunk)

    async def on_finished(self, out: StepOutput):
        machine = self.machines.get(out.request_id)
        if machine is not None:
            machine.finished_locally()
            self._record(machine)
        await self._forget(out.request_id)

    def _record(self, machine: HandoffMachine):
        """Log what the machine decided since last asked, and mark it on the request's span."""
        for event in machine.take_events():
            name, fields = describe(event)
            self.log.info(name, request_id=machine.request_id, **fields)
            span = self.spans.get(machine.request_id)
            if span is not None:
                span.add_event(name, fields)

    async def on_cancel(self, cancel):
        await super().on_cancel(cancel)
        task = self._handoffs.get(cancel.request_id)
        if task is not None and cancel.kind != "finished":
            task.cancel()
        await self._forget(cancel.request_id)

    async def _forget(self, request_id: str):
        self._traceparents.pop(request_id, None)
        self._main.pop(request_id, None)
        self._main_decoders.pop(request_id, None)
        self.machines.pop(request_id, None)


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
