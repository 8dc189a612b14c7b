"""A prefill job's KV on its way to its receivers: one ``PathShipment`` per path (``wan`` to main
decode, ``local`` to the relay) and the exports they share.

Each path's flow opens before the compute (its handshake overlaps it); once the first token
is out, each path exports from where its receiver stands and sends, as soon as its own flow
is accepted. ``cancel`` stops all of it (the job's ``close`` calls it).
"""

import asyncio
from dataclasses import dataclass

from opentelemetry import trace

from services.prefill.host import PrefillHost
from services.prefill.shipping_plan import ExportRange, ShippingPath, ShippingPlan
from shared.bulk.sender import BulkFlow
from shared.engine.backend import StepOutput
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
        exported: The frames exported for this receiver (set once, or failed).
        opening: The task opening the flow (``FlowOpen`` until ``FlowAccepted``).
        flow: The flow once accepted.
        sending: The task that waits for the flow, exports what the receiver lacks and sends
            it; None until the first token is out.
        ended: The flow's end went out: the receiver has it all, nothing to cancel.
    """

    route: ShippingPath
    span: trace.Span
    exported: asyncio.Future
    opening: asyncio.Task | None = None
    flow: BulkFlow | None = None
    sending: asyncio.Task | None = None
    ended: bool = False

    @property
    def unfinished_flow(self) -> BulkFlow | None:
        """The flow if it was accepted and has not ended (one to cancel on a close)."""
        return self.flow if self.flow is not None and not self.ended else None


class KvShipping:
    """The paths of one job and the exports they share."""

    def __init__(self, host: PrefillHost, cmd: StartPrefill):
        self._host, self.cmd, self.request_id = host, cmd, cmd.request_id
        self.plan = ShippingPlan(cmd)
        self.paths: dict[str, PathShipment] = {}
        self.exports: dict[ExportRange, asyncio.Future] = {}

    def start_sending(self, first: StepOutput):
        """The first token is out: every path ships (its end carries the first token)."""
        for shipment in self.paths.values():
            end_tokens = self.plan.end_tokens(shipment.route.role, first.token_id, first.logprobs)
            shipment.sending = asyncio.create_task(self._ship(shipment, end_tokens))

    async def frames_exported(self) -> dict[str, list]:
        """Each path's frames, once all are exported (the sequence may then be freed)."""
        return {path: await shipment.exported for path, shipment in self.paths.items()}

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
        owned = [*tasks, *self.exports.values(), *(p.exported for p in self.paths.values())]
        for future in owned:
            future.cancel()
        await asyncio.gather(*owned, return_exceptions=True)
        flows = [p.unfinished_flow for p in self.paths.values() if p.unfinished_flow is not None]
        await asyncio.gather(*(f.cancel(reason) for f in flows), return_exceptions=True)

    def end_spans(self):
        for shipment in self.paths.values():
            shipment.span.end()

    def open_paths(self, parent):
        """Start opening every path's flow, each in its span, before the compute."""
        loop = asyncio.get_running_loop()
        for route in self.plan.paths:
            span = _tracer.start_span(
                f"kv.transfer.{route.path}",
                context=parent,
                attributes={"request_id": self.request_id, "path": route.path},
            )
            shipment = self.paths[route.path] = PathShipment(route, span, exported=loop.create_future())
            shipment.opening = asyncio.create_task(self._open(shipment))

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
                receiver_id=route.receiver.instance_id,
                receiver_incarnation=route.receiver.incarnation,
                unix_s=0.0,
                nonce="",
            )
            shipment.flow = await self._host.dial(flow_open, route)
            return shipment.flow

    def export_open_paths(self):
        """Queue the exports of the paths whose flows are already open, and let the engine
        step again: a prompt's KV then leaves before the next prompt's prefill, instead of
        waiting behind that whole step (the job then lets the engine loop step)."""
        for shipment in self.paths.values():
            opening = shipment.opening
            if not opening.done() or opening.cancelled() or opening.exception() is not None:
                continue
            export = self.plan.export_range(opening.result().first_token_index)
            if export is not None:
                self._export(export)

    def _export(self, export: ExportRange) -> asyncio.Future:
        """Queue the export on the engine thread now (before any step asked for later); paths
        whose receivers start at the same token share it."""
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

    async def _ship(self, shipment: PathShipment, end_tokens: tuple[list, list]):
        """One path: wait for its flow, export from where its receiver stands, send."""
        try:
            flow = await shipment.opening
            export = self.plan.export_range(flow.first_token_index)
            frames = [] if export is None else await self._export(export)
        except BaseException as exc:
            if not shipment.exported.done():
                shipment.exported.set_exception(exc)
            raise
        shipment.exported.set_result(frames)
        await self._send(shipment, frames, end_tokens)

    async def _send(self, shipment: PathShipment, frames: list, end_tokens: tuple[list, list]) -> int:
        flow, span, model = shipment.flow, shipment.span, self._host.config.served_model_name
        with trace.use_span(span, end_on_exit=False):

            async def stream():
                for parts in frames:
                    await flow.send_frame(parts)
                await flow.end(*end_tokens)

            await asyncio.wait_for(stream(), self._host.config.send_timeout_s)
            shipment.ended = True
            KV_TRANSFER_SECONDS.labels(model, flow.path).observe(flow.elapsed_s)
            KV_TRANSFER_BYTES.labels(model, flow.path).observe(flow.bytes_sent)
            span.set_attribute("kv_bytes", flow.bytes_sent)
            span.set_attribute("first_token_index", flow.first_token_index)
            return flow.bytes_sent
