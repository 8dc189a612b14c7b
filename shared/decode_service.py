"""Base of the two decoding services: receive KV flows, decode, stream tokens, free on cancel.

Tokens are delivered at least once: a producer answers ``ResendTokens`` from the live
sequence or, once the request ended here, from a short record of its output.
"""

import asyncio
import socket

from opentelemetry import trace

from shared import subjects
from shared.bulk.kv_importer import ImportState, KvImporter
from shared.bulk.receiver import BulkReceiver, FlowStats
from shared.config import BulkReceiverConfig
from shared.engine.backend import RequestView, StepOutput
from shared.engine.logprobs import TokenLogprobs
from shared.engine_loop import EngineLoop
from shared.engine_service import EngineService
from shared.messages import (
    CancelRequest,
    InstanceRef,
    KvImportAborted,
    RequestFailed,
    ResendTokens,
    TokensEmitted,
    decoder,
)
from shared.metrics import ENGINE_STEP_SECONDS, KV_BLOCKS_CACHE_FILL, KV_IMPORTS_WAITING
from shared.recent_outputs import RecentOutputs, live_outputs, logprobs_of
from shared.tls import server_context

_resend_decoder = decoder(ResendTokens)


class DecodeService(EngineService):
    """Relay decode and main decode share this; subclasses add the handoff."""

    producer = "MD"
    bulk_path = "wan"

    def __init__(self, config: BulkReceiverConfig, loaded=None):
        super().__init__(config, loaded)
        self.config: BulkReceiverConfig = config
        self.importer: KvImporter | None = None
        self.receiver: BulkReceiver | None = None
        self.loop: EngineLoop | None = None
        self.bulk_endpoint = ""
        self.spans: dict[str, trace.Span] = {}
        self.recent_outputs = RecentOutputs()

    def load_report(self):
        report = super().load_report()
        KV_BLOCKS_CACHE_FILL.labels(self.service_name, self.instance_id).set(self._cache_fill_blocks())
        if self.importer is not None:
            KV_IMPORTS_WAITING.labels(self.service_name, self.instance_id).set(len(self.importer.waiting))
        return report

    def _cache_fill_blocks(self) -> int:
        """Blocks only imports kept for the cache hold (their requests ended elsewhere)."""
        if self.importer is None:
            return 0
        filling = self.importer.kept_for_cache()
        # Read without the worker: a snapshot is enough for a gauge.
        return self.engine.blocks_held_only_by(filling) if filling else 0

    async def on_start(self):
        self.importer = KvImporter(
            self.worker,
            self._on_import_complete,
            self._on_import_open,
            in_flight_wait_s=self.config.kv_timeout_s,
            on_abort=self._on_import_aborted,
            max_sequences=self.config.max_sequences,
        )
        config = self.config
        encrypted = config.tls_cert_file and (self.bulk_path == "wan" or config.bulk_tls_local)
        self.receiver = BulkReceiver(
            self.importer,
            self.engine.frame_expectation,
            config.bulk_verify_key,
            path=self.bulk_path,
            frame_timeout_s=config.kv_timeout_s,
            host=config.bulk_host,
            port=config.bulk_port,
            receiver_id=self.instance_id,
            incarnation=self.incarnation,
            tls=server_context(config.tls_ca_file, config.tls_cert_file, config.tls_key_file) if encrypted else None,
        )
        host, port = await self.receiver.start()
        self.bulk_endpoint = self.config.bulk_advertise or f"{_reachable(host)}:{port}"
        self.loop = EngineLoop(
            self.worker,
            self._on_outputs,
            step_seconds=ENGINE_STEP_SECONDS.labels(self.config.served_model_name, self.service_name),
        )
        self.watch(self.loop.start())
        await self.subscribe(
            subjects.instance_work(self.config.site, self.service_name, self.instance_id, subjects.RESEND),
            _resend_decoder,
            self._on_resend,
        )

    async def on_stop(self):
        # Stop accepting KV; let running sequences finish for a short grace period.
        if self.receiver is None:
            return  # never started
        await self.receiver.stop()
        for _ in range(100):
            if not await self.worker.call(self.engine.has_work):
                break
            await asyncio.sleep(0.1)
        await self.loop.stop()

    async def held_request_ids(self) -> list[str]:
        held = set(await super().held_request_ids()) | self.importer.request_ids
        # An import kept for the cache belongs to a request that ended elsewhere: its router
        # rightly no longer lists it, and no lease must take that for a lost cancel.
        return list(held - self.importer.kept_for_cache())

    def instance_ref(self) -> InstanceRef:
        return InstanceRef(
            instance_id=self.instance_id,
            site=self.config.site,
            bulk_endpoint=self.bulk_endpoint,
            bulk_link=self.config.bulk_link,
            incarnation=self.incarnation,
        )

    async def on_cancel(self, cancel: CancelRequest):
        finished_elsewhere = cancel.kind == "finished"
        if self.importer.holds(cancel.request_id):
            # Its flow owns the sequence, even while the engine thread is still making it:
            # freeing it here would leave the flow's frames no import to land in.
            state = await self.importer.cancel(cancel.request_id, finished_elsewhere)
            if state is not None and not finished_elsewhere:
                await self.publish(
                    subjects.request_events(cancel.request_id, self.instance_id),
                    KvImportAborted(
                        request_id=cancel.request_id,
                        instance_id=self.instance_id,
                        wan_kv_bytes=state.stats.bytes_received,
                        reason=cancel.reason,
                    ),
                )
            return
        if await self.worker.call(self.engine.abort, cancel.request_id):
            self.log.info("request_dropped", request_id=cancel.request_id, kind=cancel.kind)
            self.end_span(cancel.request_id)
        else:  # its flow may not be here yet
            await self.importer.cancel(cancel.request_id, finished_elsewhere)

    async def _on_import_aborted(self, request_id: str, reason: str):
        """A flow broke before its KV was complete: tell the router, which may resume elsewhere."""
        await self.publish(
            subjects.request_events(request_id, self.instance_id),
            RequestFailed(
                request_id=request_id,
                instance_id=self.instance_id,
                code="kv_flow_broken",
                message=f"KV flow broke before the prompt was complete: {reason}",
                retryable=True,
            ),
        )

    # --- hooks for subclasses ------------------------------------------------------------

    async def _on_import_open(self, flow_open):
        """Called when a flow arrives, before it waits for earlier blocks or is accepted.

        Early on purpose: the relay must know the request before main decode's KvReady
        can arrive, even when its own import queues behind another.
        """

    async def _on_import_complete(self, state: ImportState, seq: RequestView, stats: FlowStats):
        """Called when a flow's KV is all in; the base emits already-known output tokens."""
        if seq.output_token_ids:
            await self.emit(
                seq.request_id,
                0,
                list(seq.output_token_ids),
                seq.finish_reason if seq.finished else None,
                logprobs_of(seq),
            )
            if seq.finished:
                self.recent_outputs.remember(await self.worker.call(self.engine.free, seq.request_id))
                return
        self.loop.wake()

    # --- token stream --------------------------------------------------------------------

    async def _on_resend(self, resend: ResendTokens, msg):
        rid = resend.request_id
        known = self.recent_outputs.get(rid) or await self.worker.call(live_outputs, self.engine, rid)
        if known is None or resend.from_index >= len(known.token_ids):
            return
        tokens, start = known.token_ids, resend.from_index
        await self.emit(
            rid,
            start,
            tokens[start:],
            known.finish_reason,
            known.logprobs[start:] if known.logprobs is not None else None,
        )
        self.log.info(
            "tokens_resent", request_id=rid, from_index=resend.from_index, tokens=len(tokens) - resend.from_index
        )

    async def emit(
        self,
        request_id: str,
        start_index: int,
        token_ids: list[int],
        finish_reason: str | None,
        logprobs: list[TokenLogprobs | None] | None = None,
    ):
        """Publish tokens (and their log-probabilities, if asked for) on the request's stream."""
        await self.publish(
            subjects.tokens(request_id, self.instance_id),
            TokensEmitted(
                request_id=request_id,
                start_index=start_index,
                token_ids=token_ids,
                producer=self.producer,
                instance_id=self.instance_id,
                finish_reason=finish_reason,
                logprobs=logprobs,
            ),
        )

    async def _on_outputs(self, outputs: list[StepOutput]):
        for out in outputs:
            if out.error:
                await self.publish(
                    subjects.request_events(out.request_id, self.instance_id),
                    RequestFailed(
                        request_id=out.request_id,
                        instance_id=self.instance_id,
                        code=out.error_code or "engine_error",
                        message=out.error,
                    ),
                )
            else:
                await self.emit(
                    out.request_id,
                    out.token_index,
                    [out.token_id],
                    out.finish_reason if out.finished else None,
                    [out.logprobs] if out.logprobs is not None else None,
                )
            if out.finished:
                self.recent_outputs.remember(await self.worker.call(self.engine.free, out.request_id))
                self.end_span(out.request_id)
                await self.on_finished(out)

    async def on_finished(self, out: StepOutput):
        """A sequence ended here."""

    def start_span(self, request_id: str, name: str, traceparent: str | None, **attributes):
        """Open this request's long-lived span (relay.decode / main.decode)."""
        from shared.tracing import context_from, tracer

        self.end_span(request_id)
        self.spans[request_id] = tracer(f"pdd.{self.service_name}").start_span(
            name, context=context_from(traceparent), attributes={"request_id": request_id, **attributes}
        )

    def end_span(self, request_id: str, **attributes):
        """Close this request's long-lived span, if open."""
        span = self.spans.pop(request_id, None)
        if span is not None:
            span.set_attributes(attributes)
            span.end()


def _reachable(host: str) -> str:
    """An address peers can dial for a listen address: this host's own for a wildcard (a
    container's or pod's address, so that replicas sharing one configuration differ)."""
    if host in ("0.0.0.0", "::", ""):
        return socket.gethostbyname(socket.gethostname())
    return host
