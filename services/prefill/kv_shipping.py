"""A prefill job's KV on its way to its receivers: one ``PathShipment`` per path (``wan`` to main
decode, ``local`` to the relay) and the exports they share.

Each path's flow opens before the compute (its handshake overlaps it). A long prompt is
computed in chunks, one engine step each; between two steps the service calls
``queue_exports`` with how far the prompt's KV now reaches, and every accepted path exports
the complete blocks its receiver lacks and does not have yet, queued on the engine thread
before the next chunk computes. Each path sends its exports in order as they come out, so the
KV crosses while the rest of the prompt computes. Once the first token is out, the last export
(up to the prompt's end, the partial last block included) and the flow's end follow.
``cancel`` stops all of it (the job's ``close`` calls it).
"""

import asyncio
from dataclasses import dataclass, field

from opentelemetry import trace

from services.prefill.host import PrefillHost
from services.prefill.shipping_plan import ExportRange, ShippingPath, ShippingPlan
from shared.bulk.sender import BulkFlow
from shared.engine.backend import StepOutput
from shared.kv_wire import tokens_per_frame
from shared.messages import FlowOpen, StartPrefill
from shared.metrics import KV_TRANSFER_BYTES, KV_TRANSFER_SECONDS
from shared.tracing import current_traceparent, tracer

_tracer = tracer("pdd.prefill")


@dataclass(eq=False)
class PathShipment:
    """One path of a job (``wan`` to main decode, ``local`` to the relay), from its opening
    to its flow's end.

    Attributes:
        route: The path, its receiver and the role the receiver acts as.
        span: ``kv.transfer.<path>``, ended when the job closes.
        all_queued: Resolves once the path's last export is queued (fails with the opening's
            error if the flow could not be opened).
        exports: The path's exports in prompt order, as queued.
        queue: The same exports for the sending task, each with its first token, then None
            once the last is queued.
        exported_to: Token index the path's exports reach (None until the flow is accepted:
            it then starts where the receiver's cache ends).
        opening: The task opening the flow (``FlowOpen`` until ``FlowAccepted``).
        flow: The flow once accepted.
        sending: The task that waits for the flow and sends each export as it comes out,
            then the flow's end.
        ended: The flow's end went out: the receiver has it all, nothing to cancel.
    """

    route: ShippingPath
    span: trace.Span
    all_queued: asyncio.Future
    exports: list[asyncio.Future] = field(default_factory=list)
    queue: asyncio.Queue[tuple[int, asyncio.Future] | None] = field(default_factory=asyncio.Queue)
    exported_to: int | None = None
    opening: asyncio.Task | None = None
    flow: BulkFlow | None = None
    sending: asyncio.Task | None = None
    ended: bool = False

    @property
    def unfinished_flow(self) -> BulkFlow | None:
        """The flow if it was accepted and has not ended (one to cancel on a close)."""
        return self.flow if self.flow is not None and not self.ended else None

    @property
    def wants_exports(self) -> bool:
        """Accepted, and its last export not queued yet."""
        return self.exported_to is not None and not self.all_queued.done()

    def queue_export(self, export: asyncio.Future, export_range: ExportRange):
        self.exports.append(export)
        self.queue.put_nowait((export_range.start, export))
        self.exported_to = export_range.end

    def close_queue(self):
        """The last export is queued: the sender ends the flow after it."""
        self.queue.put_nowait(None)
        self.all_queued.set_result(None)


class KvShipping:
    """The paths of one job and the exports they share."""

    def __init__(self, host: PrefillHost, cmd: StartPrefill):
        self._host, self.cmd, self.request_id = host, cmd, cmd.request_id
        self.plan = ShippingPlan(cmd)
        self.paths: dict[str, PathShipment] = {}
        self.exports: dict[ExportRange, asyncio.Future] = {}
        self.first: StepOutput | None = None
        """The first token, once the whole prompt is computed (it ends the flows)."""

    @property
    def wants_exports(self) -> bool:
        """Some accepted path still waits for exports (``queue_exports`` has work)."""
        return any(p.wants_exports for p in self.paths.values())

    def queue_exports(self, num_kv_tokens: int, first: StepOutput | None):
        """Between two engine steps: queue, for every accepted path, the export of the complete
        blocks below ``num_kv_tokens`` its receiver lacks; with ``first`` (the prompt is
        computed), the rest of the prompt and the end of the flow."""
        if first is not None:
            self.first = first
        computed, block_size = self.first is not None, self._host.engine.block_size
        for shipment in self.paths.values():
            if not shipment.wants_exports:
                continue
            export = self.plan.next_export(
                shipment.route.path, shipment.exported_to, num_kv_tokens, computed, block_size
            )
            if export is not None:
                shipment.queue_export(self._export(export), export)
            if computed:
                shipment.close_queue()

    async def frames_exported(self) -> dict[str, int]:
        """Each path's bytes, once every export is done (the sequence may then be freed)."""
        sizes = {}
        for path, shipment in self.paths.items():
            await shipment.all_queued
            frames = await asyncio.gather(*shipment.exports)
            sizes[path] = sum(_frame_size(parts) for export in frames for parts in export)
        return sizes

    async def sent(self):
        """Every path's frames and end are sent (raises the first path's failure)."""
        await asyncio.gather(*(p.sending for p in self.paths.values()))

    @property
    def wan_handshake_s(self) -> float:
        """The WAN flow's handshake, one round trip (0 without a WAN path)."""
        wan = self.paths.get("wan")
        return wan.flow.handshake_s if wan is not None and wan.flow is not None else 0.0

    async def cancel(self, reason: str):
        """Cancel the paths' tasks and exports and wait for them to unwind (a cancelled opening
        closes its connection; nobody else takes their outcomes), then cancel the flows still
        open (receivers discard what arrived; ``reason`` tells them why)."""
        tasks = [t for p in self.paths.values() for t in (p.opening, p.sending) if t is not None]
        owned = [*tasks, *self.exports.values(), *(p.all_queued for p in self.paths.values())]
        for future in owned:
            future.cancel()
        await asyncio.gather(*owned, return_exceptions=True)
        flows = [p.unfinished_flow for p in self.paths.values() if p.unfinished_flow is not None]
        await asyncio.gather(*(f.cancel(reason) for f in flows), return_exceptions=True)

    def end_spans(self):
        for shipment in self.paths.values():
            shipment.span.end()

    def open_paths(self, parent):
        """Start opening every path's flow, each in its span, before the compute; each path's
        sender starts with it."""
        loop = asyncio.get_running_loop()
        for route in self.plan.paths:
            span = _tracer.start_span(
                f"kv.transfer.{route.path}",
                context=parent,
                attributes={"request_id": self.request_id, "path": route.path},
            )
            shipment = self.paths[route.path] = PathShipment(route, span, all_queued=loop.create_future())
            shipment.opening = asyncio.create_task(self._open(shipment))
            shipment.sending = asyncio.create_task(self._ship(shipment))

    async def _open(self, shipment: PathShipment) -> BulkFlow:
        cmd, route = self.cmd, shipment.route
        with trace.use_span(shipment.span, end_on_exit=False):
            flow_open = FlowOpen(
                request_id=self.request_id,
                role=route.role,
                token_ids=cmd.token_ids,
                sampling=cmd.sampling,
                seed=cmd.seed,
                traceparent=current_traceparent(),
                relay_instance_id=cmd.relay_decode.instance_id if cmd.relay_decode else None,
                main_decode_instance_id=cmd.main_decode.instance_id if cmd.main_decode else None,
                sender_id=self._host.instance_id,
                sender_site=self._host.config.site,
                receiver_id=route.receiver.instance_id,
                receiver_incarnation=route.receiver.incarnation,
                unix_s=0.0,
                nonce="",
            )
            shipment.flow = await self._host.dial(flow_open, route)
            return shipment.flow

    def _export(self, export: ExportRange) -> asyncio.Future:
        """Queue the export on the engine thread now (before any step asked for later); paths
        whose receivers stand at the same token share it."""
        if export not in self.exports:
            self.exports[export] = self._host.worker.submit(
                self._host.engine.export_frames,
                self.request_id,
                export.start,
                export.end,
                max_tokens_per_frame=self._host.config.frame_tokens,
                traceparent=current_traceparent(),
            )
        return self.exports[export]

    @staticmethod
    async def _next_export(shipment: PathShipment) -> tuple[int, asyncio.Future] | None:
        """The path's next export (None: the flow ends); while none is queued, its flow lets
        the other flows on its link send."""
        if shipment.queue.empty():
            shipment.flow.pause_turns()
        return await shipment.queue.get()

    async def _ship(self, shipment: PathShipment):
        """One path: wait for its flow, then send its exports as they come out, then its end."""
        try:
            flow = await shipment.opening
        except BaseException as exc:
            if not shipment.all_queued.done():
                shipment.all_queued.set_exception(exc)
            raise
        shipment.exported_to = flow.first_token_index
        self._host.loop.wake()  # the engine loop queues what is computed already, between steps
        await asyncio.wait_for(self._send(shipment), self._host.config.send_timeout_s)

    async def _send(self, shipment: PathShipment):
        flow, span, model = shipment.flow, shipment.span, self._host.config.served_model_name
        frame_tokens = tokens_per_frame(self._host.config.frame_tokens, self._host.engine.block_size)
        num_prompt_tokens = len(self.cmd.token_ids)
        with trace.use_span(span, end_on_exit=False):
            while (queued := await self._next_export(shipment)) is not None:
                start, export = queued
                if not export.done():
                    flow.pause_turns()  # the engine thread may be computing a chunk first
                for index, parts in enumerate(await export):
                    await flow.send_frame(parts, tokens_left=num_prompt_tokens - start - index * frame_tokens)
            first = self.first
            await flow.end(*self.plan.end_tokens(shipment.route.role, first.token_id, first.logprobs))
            shipment.ended = True
            KV_TRANSFER_SECONDS.labels(model, flow.path).observe(flow.elapsed_s)
            KV_TRANSFER_BYTES.labels(model, flow.path).observe(flow.bytes_sent)
            span.set_attribute("kv_bytes", flow.bytes_sent)
            span.set_attribute("first_token_index", flow.first_token_index)


def _frame_size(parts: list) -> int:
    return sum(len(p) if isinstance(p, bytes) else p.nbytes for p in parts)
