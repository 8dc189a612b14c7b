"""Prefill (P, site A): computes prompt KV, samples the first token, ships KV on both paths.

For each ``StartPrefill`` it opens the KV flows first (to main decode over the WAN, and to
relay decode over the local path for P→RLD→MD) so their handshakes overlap the compute;
then it prefills (batched with other requests by the engine loop), exports the blocks each
receiver lacks, frees its sequence (the blocks stay in its own prefix cache) and streams
the frames on both paths at once. The first token travels with the KV: the decoder that
continues the stream emits it.
"""

import asyncio
import time

import msgspec
import nats
from opentelemetry import trace

from services.prefill.shipping_plan import ExportRange, ShippingPlan
from shared import subjects
from shared.bulk.sender import BulkFlow, open_flow
from shared.config import PrefillConfig
from shared.engine.backend import StepOutput
from shared.engine_loop import EngineLoop
from shared.engine_service import EngineService
from shared.errors import PddError, error_with_code
from shared.messages import (
    CancelRequest,
    FlowOpen,
    InstanceRef,
    PrefillCompleted,
    RequestFailed,
    StartPrefill,
    decoder,
    encode,
)
from shared.metrics import (
    ENGINE_STEP_SECONDS,
    KV_TRANSFER_BYTES,
    KV_TRANSFER_SECONDS,
    PREFILL_SECONDS,
    PREFIX_HIT_BLOCKS,
    PREFIX_LOOKUP_BLOCKS,
)
from shared.tls import client_context
from shared.tracing import context_from, current_traceparent, tracer

_start_decoder = decoder(StartPrefill)
EXPORT_QUEUE_WAIT_S = 1.0
"""How long the engine loop holds its next step for a finished prompt to queue its exports
(they are queued within a few event-loop turns; this only bounds a stuck one)."""
_tracer = tracer("pdd.prefill")

RECEIVER_TLS_NAME = {"relay_decode": "relay-decode", "main_decode": "main-decode"}
"""The name a receiver's certificate must carry, by its role (whatever address reaches it)."""


class PrefillService(EngineService):
    """The prefill actor."""

    service_name = "prefill"

    def __init__(self, config: PrefillConfig, loaded=None):
        super().__init__(config, loaded)
        self.config: PrefillConfig = config
        self._first_tokens: dict[str, asyncio.Future] = {}
        self._exports_due: dict[str, asyncio.Event] = {}
        self._active: dict[str, asyncio.Task] = {}
        self._shipping_for_cache: set[str] = set()
        self._loop: EngineLoop | None = None

    async def on_start(self):
        config = self.config
        self._slots = asyncio.Semaphore(config.max_sequences)
        self._bulk_tls = (
            client_context(config.tls_ca_file, config.tls_cert_file, config.tls_key_file)
            if config.tls_ca_file
            else None
        )
        self._loop = EngineLoop(
            self.worker,
            self._on_outputs,
            between_steps=self._await_exports_queued,
            step_seconds=ENGINE_STEP_SECONDS.labels(config.served_model_name, self.service_name),
        )
        self.watch(self._loop.start())
        site = self.config.site
        await self.subscribe(
            subjects.instance_work(site, self.service_name, self.instance_id, subjects.START_PREFILL),
            _start_decoder,
            self._on_start_msg,
        )
        await self.subscribe(
            subjects.shared_work(site, self.service_name, subjects.START_PREFILL),
            _start_decoder,
            self._on_start_msg,
            queue=f"{self.service_name}-{site}",
        )

    async def on_stop(self):
        # Finish what was accepted; refuse nothing silently (subscriptions drain with NATS).
        await asyncio.gather(*self._active.values(), return_exceptions=True)
        if self._loop is not None:
            await self._loop.stop()

    async def held_request_ids(self) -> list[str]:
        # A request that ended elsewhere ships on for main decode's cache: its router rightly no
        # longer lists it, and no lease must take that for a lost cancel.
        return list((set(await super().held_request_ids()) | set(self._active)) - self._shipping_for_cache)

    async def on_cancel(self, cancel: CancelRequest):
        task = self._active.get(cancel.request_id)
        if task is None:
            return
        if cancel.kind == "finished":
            self._shipping_for_cache.add(cancel.request_id)
            return
        self.log.info("prefill_cancelled", request_id=cancel.request_id, reason=cancel.reason)
        task.cancel()

    async def _on_start_msg(self, cmd: StartPrefill, msg):
        # NATS runs one callback at a time per subscription: hand the request to a task.
        task = asyncio.create_task(self._serve(cmd, msg))
        self._active[cmd.request_id] = task
        task.add_done_callback(lambda _: self._forget(cmd.request_id))

    def _forget(self, request_id: str):
        self._active.pop(request_id, None)
        self._shipping_for_cache.discard(request_id)

    async def _serve(self, cmd: StartPrefill, msg):
        log = self.log.bind(request_id=cmd.request_id, attempt=cmd.attempt, pipeline=cmd.pipeline)
        reply: PrefillCompleted | RequestFailed
        try:
            async with self._slots:  # at most max_sequences prompts held; the rest wait their turn
                reply, sending = await self._prefill(cmd, context_from(headers=msg.headers))
        except asyncio.CancelledError:
            reply, sending = self._failure(cmd, "cancelled", "request cancelled"), None
        except (TimeoutError, PddError, ConnectionError, OSError) as exc:
            code = getattr(exc, "code", "timeout" if isinstance(exc, asyncio.TimeoutError) else "bulk_unreachable")
            log.warning("prefill_failed", code=code, error=str(exc) or type(exc).__name__)
            reply, sending = self._failure(cmd, code, str(exc) or type(exc).__name__), None
        except Exception as exc:
            log.exception("prefill_crashed")
            reply, sending = self._failure(cmd, "internal_error", repr(exc)), None
        # The router learns the KV plan now; the frames keep streaming meanwhile.
        try:
            await msg.respond(encode(reply))
        except nats.errors.Error:
            pass
        if sending is not None:
            try:
                await sending
                log.info(
                    "kv_shipped",
                    **{f"{p}_bytes": n for p, n in reply.bytes_per_path.items()},
                    cached_tokens=reply.cached_tokens,
                )
            except (TimeoutError, PddError, ConnectionError, OSError) as exc:
                log.warning("kv_shipping_failed", error=str(exc) or type(exc).__name__)
                await self.publish(
                    subjects.request_events(cmd.request_id, self.instance_id),
                    self._failure(cmd, "kv_transfer_failed", f"KV transfer failed: {exc or type(exc).__name__}"),
                )

    def _failure(self, cmd: StartPrefill, code: str, message: str) -> RequestFailed:
        return RequestFailed(
            request_id=cmd.request_id,
            instance_id=self.instance_id,
            code=code,
            message=message,
            retryable=code != "cancelled",
        )

    async def _prefill(self, cmd: StartPrefill, parent):
        """Compute, export and free; return the completion and the coroutine still sending.

        Each path ships as soon as its own flow is accepted and its frames are exported: a
        main decoder that waits for blocks already in flight never delays the relay's copy.
        """
        rid = cmd.request_id
        plan = ShippingPlan(cmd)
        spans = {
            p.path: _tracer.start_span(
                f"kv.transfer.{p.path}", context=parent, attributes={"request_id": rid, "path": p.path}
            )
            for p in plan.paths
        }
        opens = {
            p.path: asyncio.create_task(self._open(cmd, spans[p.path], p.path, p.receiver, p.role)) for p in plan.paths
        }
        flows: dict[str, BulkFlow] = {}
        ships: dict[str, asyncio.Task] = {}
        try:
            with _tracer.start_as_current_span(
                "prefill.compute", context=parent, attributes={"request_id": rid}
            ) as span:
                started = time.perf_counter()
                first, cached_tokens = await self._compute_first_token(cmd)
                first_token = first.token_id
                compute_s = time.perf_counter() - started
                PREFILL_SECONDS.labels(self.config.served_model_name).observe(compute_s)
                span.set_attribute("cached_tokens", cached_tokens)
            loop = asyncio.get_running_loop()
            exports = self._export_open_paths(plan, rid, opens)
            exported = {p.path: loop.create_future() for p in plan.paths}
            ships = {
                p.path: asyncio.create_task(
                    self._ship(
                        plan,
                        rid,
                        p.path,
                        spans[p.path],
                        plan.end_tokens(p.role, first.token_id, first.logprobs),
                        opens[p.path],
                        flows,
                        exports,
                        exported[p.path],
                    )
                )
                for p in plan.paths
            }
            frames = {path: await future for path, future in exported.items()}
            await self.worker.call(self.engine.free, rid)
        except BaseException:
            await self._abandon(rid, opens, ships, flows)
            for span in spans.values():
                span.end()
            raise
        finally:
            self._export_submitted(rid)
        completed = PrefillCompleted(
            request_id=rid,
            instance_id=self.instance_id,
            first_token=first_token,
            prompt_tokens=len(cmd.token_ids),
            cached_tokens=cached_tokens,
            compute_s=compute_s,
            bytes_per_path={path: sum(_frame_size(f) for f in frames[path]) for path in frames},
            wan_rtt_s=flows["wan"].handshake_s if "wan" in flows else 0.0,
        )

        async def send_all():
            try:
                await asyncio.gather(*ships.values())
            except BaseException:
                await self._abandon(rid, opens, ships, flows)
                raise
            finally:
                for span in spans.values():
                    span.end()

        return completed, send_all()

    async def _ship(
        self,
        plan: ShippingPlan,
        request_id: str,
        path: str,
        span,
        end_tokens: tuple[list, list],
        opening,
        flows: dict,
        exports: dict,
        exported: asyncio.Future,
    ):
        """One path: wait for its flow, export from where its receiver stands, send."""
        try:
            flow = flows[path] = await opening
            export = plan.export_range(flow.first_token_index)
            if export is None:
                frames = []
            else:
                if export not in exports:
                    exports[export] = self._export(request_id, export)
                frames = await exports[export]
        except BaseException as exc:
            if not exported.done():
                exported.set_exception(exc)
            raise
        exported.set_result(frames)
        await self._send(flow, span, frames, end_tokens)

    def _export(self, request_id: str, export: ExportRange) -> asyncio.Future:
        """Queue the export on the engine thread now (before any step asked for later)."""
        return self.worker.submit(
            self.engine.export_frames,
            request_id,
            export.start,
            export.end,
            max_tokens_per_frame=self.config.frame_tokens,
            traceparent=current_traceparent(),
        )

    def _export_open_paths(self, plan: ShippingPlan, request_id: str, opens: dict) -> dict:
        """Queue the exports of the paths whose flows are already open, and let the engine
        step again: a prompt's KV then leaves before the next prompt's prefill, instead of
        waiting behind that whole step."""
        exports: dict[ExportRange, asyncio.Future] = {}
        for opening in opens.values():
            if not opening.done() or opening.cancelled() or opening.exception() is not None:
                continue
            export = plan.export_range(opening.result().first_token_index)
            if export is not None and export not in exports:
                exports[export] = self._export(request_id, export)
        self._export_submitted(request_id)
        return exports

    def _export_submitted(self, request_id: str):
        event = self._exports_due.pop(request_id, None)
        if event is not None:
            event.set()

    async def _await_exports_queued(self):
        """Before the engine's next step: wait (briefly) until every prompt that has just
        produced its first token has queued the exports it can already make."""
        if not self._exports_due:
            return
        pending = [asyncio.create_task(event.wait()) for event in self._exports_due.values()]
        _, late = await asyncio.wait(pending, timeout=EXPORT_QUEUE_WAIT_S)
        for task in late:
            task.cancel()

    async def _abandon(self, rid: str, opens: dict, ships: dict, flows: dict):
        """Stop every flow of a failed or cancelled request and free its sequence."""
        for task in [*opens.values(), *ships.values()]:
            task.cancel()
        await asyncio.gather(*(f.cancel("prefill failed or cancelled") for f in flows.values()), return_exceptions=True)
        await self.worker.call(self.engine.abort, rid)

    async def _compute_first_token(self, cmd: StartPrefill) -> tuple[StepOutput, int]:
        future = asyncio.get_running_loop().create_future()
        self._first_tokens[cmd.request_id] = future
        # The prefill samples exactly one token, with the request's own seed and parameters.
        sampling = msgspec.structs.replace(cmd.sampling, max_tokens=1, min_tokens=min(1, cmd.sampling.min_tokens))
        seq = await self.worker.call(self.engine.add_request, cmd.request_id, cmd.token_ids, sampling, cmd.seed)
        block_size = self.engine.block_size
        PREFIX_HIT_BLOCKS.labels(self.service_name).inc(seq.num_cached_tokens // block_size)
        PREFIX_LOOKUP_BLOCKS.labels(self.service_name).inc(len(cmd.token_ids) // block_size)
        self._loop.wake()
        try:
            timeout = max(0.1, cmd.deadline_unix_s - time.time())
            first_token = await asyncio.wait_for(future, timeout)
        finally:
            self._first_tokens.pop(cmd.request_id, None)
        return first_token, seq.num_cached_tokens

    async def _open(self, cmd: StartPrefill, span, path: str, target: InstanceRef, role: str) -> BulkFlow:
        with trace.use_span(span, end_on_exit=False):
            flow_open = FlowOpen(
                request_id=cmd.request_id,
                role=role,
                token_ids=cmd.token_ids,
                sampling=cmd.sampling,
                seed=cmd.seed,
                traceparent=current_traceparent(),
                relay_instance_id=cmd.relay_decode.instance_id if cmd.relay_decode else None,
                main_decode_instance_id=cmd.main_decode.instance_id if cmd.main_decode else None,
                sender_id=self.instance_id,
                receiver_id=target.instance_id,
                receiver_incarnation=target.incarnation,
                unix_s=0.0,
                nonce="",
            )
            return await open_flow(
                target.bulk_endpoint,
                flow_open,
                self.config.bulk_secret,
                path=path,
                timeout_s=self.config.connect_timeout_s,
                accept_timeout_s=self.config.accept_timeout_s,
                tls=self._bulk_tls if path == "wan" or self.config.bulk_tls_local else None,
                tls_name=RECEIVER_TLS_NAME[role],
                link=target.bulk_link if target.site != self.config.site else "",
            )

    async def _send(self, flow: BulkFlow, span, frames: list, end_tokens: tuple[list, list]) -> int:
        with trace.use_span(span, end_on_exit=False):

            async def stream():
                for parts in frames:
                    await flow.send_frame(parts)
                await flow.end(*end_tokens)

            await asyncio.wait_for(stream(), self.config.send_timeout_s)
            KV_TRANSFER_SECONDS.labels(self.config.served_model_name, flow.path).observe(flow.elapsed_s)
            KV_TRANSFER_BYTES.labels(self.config.served_model_name, flow.path).observe(flow.bytes_sent)
            span.set_attribute("kv_bytes", flow.bytes_sent)
            span.set_attribute("first_token_index", flow.first_token_index)
            return flow.bytes_sent

    async def _on_outputs(self, outputs: list[StepOutput]):
        for out in outputs:
            future = self._first_tokens.get(out.request_id)
            if future is None or future.done():
                continue
            if out.error:
                future.set_exception(error_with_code(out.error_code or "engine_error", out.error))
            else:
                self._exports_due[out.request_id] = asyncio.Event()
                future.set_result(out)


def _frame_size(parts: list) -> int:
    return sum(len(p) if isinstance(p, bytes) else p.nbytes for p in parts)
