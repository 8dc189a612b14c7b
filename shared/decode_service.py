"""Base of the two decoding services: receive KV flows, decode, stream tokens, free on cancel.

Each request held here is one ``DecodeRequest`` in ``self.requests``, from its flow's arrival
to its ``close``: finished here, cancelled (or its lease expired), its import failed or was
refused, handed over (relay) or the service stopping all end there.

Tokens are delivered at least once: a producer answers ``ResendTokens`` from the live
sequence or, once the request ended here, from a short record of its output.
"""

import asyncio
import socket

from shared import subjects
from shared.bulk.kv_importer import ImportState, KvImporter
from shared.bulk.receiver import BulkReceiver, FlowStats
from shared.config import BulkReceiverConfig
from shared.decode_request import DecodeRequest, RequestTable
from shared.engine.backend import EngineBackend, RequestView, StepOutput
from shared.engine.logprobs import TokenLogprobs
from shared.engine_loop import EngineLoop
from shared.engine_service import EngineService
from shared.messages import (
    CancelRequest,
    FlowOpen,
    InstanceRef,
    KvImportAborted,
    RequestFailed,
    ResendTokens,
    StepTokens,
    TokensEmitted,
    decoder,
)
from shared.metrics import ENGINE_STEP_SECONDS, KV_BLOCKS_CACHE_FILL, KV_IMPORTS_WAITING
from shared.recent_outputs import RecentOutputs, live_outputs, logprobs_of
from shared.tls import server_context

_resend_decoder = decoder(ResendTokens)


class DecodeService(EngineService):
    """Relay decode and main decode share this; subclasses add the handoff.

    Attributes:
        requests: The requests held here, one ``DecodeRequest`` (or specialisation) each.
    """

    producer = "MD"
    bulk_path = "wan"
    overlap_steps = False
    """Whether the engine thread starts the next step while this service handles the last
    one's outputs (``shared.engine_loop``): only where handling them never needs to change
    the next step."""

    def __init__(self, config: BulkReceiverConfig, loaded=None):
        super().__init__(config, loaded)
        self.config: BulkReceiverConfig = config
        self.importer: KvImporter | None = None
        self.receiver: BulkReceiver | None = None
        self.loop: EngineLoop | None = None
        self.bulk_endpoint = ""
        self.requests: RequestTable = RequestTable()
        self.recent_outputs = RecentOutputs()

    def load_report(self):
        report = super().load_report()
        fill_blocks = _cache_fill_blocks(self.importer, self.engine) if self.importer is not None else 0
        KV_BLOCKS_CACHE_FILL.labels(self.service_name, self.instance_id).set(fill_blocks)
        if self.importer is not None:
            KV_IMPORTS_WAITING.labels(self.service_name, self.instance_id).set(len(self.importer.waiting))
        return report

    async def on_start(self):
        self.importer = KvImporter(
            self.worker,
            self._on_import_complete,
            self._on_import_open,
            in_flight_wait_s=self.config.kv_timeout_s,
            on_abort=self._on_import_aborted,
            max_sequences=self.config.max_sequences,
            on_refused=self._on_import_refused,
            on_kept=self._on_import_kept,
        )
        self.requests.attach(self.worker, self.importer)
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
            site=config.site,
            tls=server_context(config.tls_ca_file, config.tls_cert_file, config.tls_key_file) if encrypted else None,
        )
        host, port = await self.receiver.start()
        self.bulk_endpoint = self.config.bulk_advertise or f"{_reachable(host)}:{port}"
        self.loop = EngineLoop(
            self.worker,
            self._on_outputs,
            step_seconds=ENGINE_STEP_SECONDS.labels(self.config.served_model_name, self.service_name),
            overlap=self.overlap_steps,
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
        if self.loop is None:
            return  # the receiver never listened
        for _ in range(100):
            if not await self.worker.call(self.engine.has_work):
                break
            await asyncio.sleep(0.1)
        await self.loop.stop()
        await self.requests.close_all("service stopping")

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
        """A cancel, or an expired lease: free the request's import or sequence, then close it.

        ``finished`` (the request ended elsewhere) lets an import go on for the cache and a
        handoff in flight hear its answer; ``stop`` and ``kill`` drop everything now.
        """
        rid, finished_elsewhere = cancel.request_id, cancel.kind == "finished"
        if self.importer.holds(rid):
            # Its flow owns the sequence, even while the engine thread is still making it:
            # freeing it here would leave the flow's frames no import to land in.
            state = await self.importer.cancel(rid, finished_elsewhere)
            if state is not None and not finished_elsewhere:
                await self.publish(
                    subjects.request_events(rid, self.instance_id),
                    KvImportAborted(
                        request_id=rid,
                        instance_id=self.instance_id,
                        wan_kv_bytes=state.stats.bytes_received,
                        reason=cancel.reason,
                    ),
                )
        elif await self.worker.call(self.engine.abort, rid):
            self.log.info("request_dropped", request_id=rid, kind=cancel.kind)
        else:  # its flow may not be here yet
            await self.importer.cancel(rid, finished_elsewhere)
        await self.requests.close(rid, f"cancelled ({cancel.kind})", cancel_tasks=not finished_elsewhere)

    async def _on_import_refused(self, request_id: str, reason: str):
        """A flow heard of was refused before its import began (the sender is told)."""
        await self.requests.close(request_id, f"import refused: {reason}")

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
        await self.requests.close(request_id, f"import aborted: {reason}")

    # --- hooks for subclasses ------------------------------------------------------------

    async def _on_import_open(self, flow_open: FlowOpen):
        """Called when a flow arrives, before it waits for earlier blocks or is accepted: the
        request's object starts here (subclasses make their specialisation).

        Early on purpose: the relay must know the request before main decode's KvReady
        can arrive, even when its own import queues behind another.
        """
        self.requests.add(DecodeRequest(flow_open, self.requests))

    async def _on_import_kept(self, state: ImportState, stats: FlowStats):
        """Called when the KV of a request that ended elsewhere is all in the cache."""

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
                await self.requests.close(seq.request_id, "finished")
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
        """One step's outputs: its plain tokens as one ``StepTokens`` per router, everything
        else (a request's last token, tokens with log-probabilities, failures) per request."""
        await self._publish_step_tokens(outputs)
        finished: list[StepOutput] = []
        for out in outputs:
            if _is_plain(out):
                continue
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
                finished.append(out)
        if finished:  # one engine-thread call for the step's ends, not one (and a loop turn) each
            views = await self.worker.call(free_finished, self.engine, [out.request_id for out in finished])
            for out, view in zip(finished, views, strict=True):
                if view is not None:
                    self.recent_outputs.remember(view)
                await self.on_finished(out)

    async def _publish_step_tokens(self, outputs: list[StepOutput]):
        """The step's plain tokens, one ``StepTokens`` message per router that minted their requests."""
        by_router: dict[str, tuple[list[str], list[int], list[int]]] = {}
        for out in outputs:
            if _is_plain(out):
                rid = out.request_id
                origin = rid[: rid.rindex("-")]  # subjects.origin_of, inlined: once per token
                entries = by_router.get(origin)
                if entries is None:
                    entries = by_router[origin] = ([], [], [])
                entries[0].append(rid)
                entries[1].append(out.token_index)
                entries[2].append(out.token_id)
        for origin, (request_ids, indices, token_ids) in by_router.items():
            await self.publish(
                subjects.step_tokens(origin, self.instance_id),
                StepTokens(producer=self.producer, request_ids=request_ids, indices=indices, token_ids=token_ids),
            )

    async def on_finished(self, out: StepOutput):
        """A sequence ended here (its output, or an error for it alone) and the engine freed
        it: close its request."""
        await self.requests.close(out.request_id, "failed" if out.error else "finished", sequence_freed=True)


def free_finished(engine: EngineBackend, request_ids: list[str]) -> list[RequestView | None]:
    """On the engine thread: free each request, None for one no longer live (a cancel freed it
    between the step and this call)."""
    views: list[RequestView | None] = []
    for request_id in request_ids:
        views.append(engine.free(request_id) if engine.request(request_id) is not None else None)
    return views


def _is_plain(out: StepOutput) -> bool:
    """A sampled token that ends nothing and carries no log-probabilities (``StepTokens``)."""
    return out.token_id is not None and not out.finished and out.error is None and out.logprobs is None


def _cache_fill_blocks(importer: KvImporter, engine: EngineBackend) -> int:
    """Blocks only imports kept for the cache hold (their requests ended elsewhere)."""
    filling = importer.kept_for_cache()
    # Read without the worker: a snapshot is enough for a gauge.
    return engine.blocks_held_only_by(filling) if filling else 0


def _reachable(host: str) -> str:
    """An address peers can dial for a listen address: this host's own for a wildcard (a
    container's or pod's address, so that replicas sharing one configuration differ)."""
    if host in ("0.0.0.0", "::", ""):
        return socket.gethostbyname(socket.gethostname())
    return host
