"""One prefill request on this instance, from its ``StartPrefill`` to its last KV frame.

A ``PrefillJob`` owns everything the request holds here: its engine sequence, the flows to
its receivers (one ``PathShipment`` per path: span, opening task, flow, exports, sending
task), the exports queued on the engine thread and the first-token future. Whichever way
the request ends (every frame shipped, cancelled by its router or its lease, failed, the
service stopping), ``close`` frees all of it, once, and takes the job out of its service's
table.

The order of work:

- The flows open first, so their handshakes overlap the compute.
- The engine loop computes the prompt in chunks, batched with other prompts. Between two
  steps the service hands every job how far its KV reaches (``queue_exports``): each
  accepted path exports the blocks completed since, before the next chunk computes, and
  sends them while it computes. When the first token comes out, the rest of the prompt is
  exported the same way, before the loop steps again.
- Each path ships as soon as its own flow is accepted: a main decoder that waits for blocks
  already in flight never delays the relay's copy.
- Once every path's last export is done, the sequence is freed (its blocks stay in the
  prefix cache) and so is the prefill slot; the router gets ``PrefillCompleted`` while the
  frames keep streaming. The first token travels in each flow's end: the decoder that
  continues the stream emits it.
- A request its router finished while its KV still crosses (``keep_shipping_for_cache``)
  ships on, so main decode's cache stays aligned with ours, and then closes.
"""

import asyncio
import time

import msgspec
import nats

from services.prefill.host import PrefillHost
from services.prefill.kv_shipping import KvShipping
from shared import subjects
from shared.engine.backend import StepOutput
from shared.errors import PddError, error_with_code
from shared.messages import PrefillCompleted, RequestFailed, StartPrefill, encode
from shared.metrics import (
    PREFILL_SECONDS,
    PREFIX_HIT_BLOCKS,
    PREFIX_LOOKUP_BLOCKS,
)
from shared.tracing import context_from, tracer

_tracer = tracer("pdd.prefill")

FAILURES = (TimeoutError, PddError, ConnectionError, OSError)
"""What a prefill or a transfer fails with, short of a bug: reported to the router with a code."""


class PrefillJob:
    """One ``StartPrefill``: compute, export, free, reply, ship; then ``close``."""

    def __init__(self, host: PrefillHost, cmd: StartPrefill, msg):
        """``msg``: the NATS message to reply to (its headers carry the trace context)."""
        self._host = host
        self.cmd = cmd
        self.request_id = cmd.request_id
        self._msg = msg
        self.log = host.log.bind(request_id=cmd.request_id, attempt=cmd.attempt, pipeline=cmd.pipeline)
        self.shipping: KvShipping | None = None
        self.first_token: asyncio.Future | None = None
        self.ships_for_cache = False
        """Its router finished the request; the KV still ships, for main decode's cache."""
        self.task: asyncio.Task | None = None
        self._holds_sequence = False
        self._serving = self._stopping = self._closing = False

    # --- what the service calls ----------------------------------------------------------

    def start(self) -> asyncio.Task:
        """Serve the request in a task of its own (NATS runs one callback at a time)."""
        self.task = asyncio.create_task(self.serve(), name=f"prefill-{self.request_id}")
        return self.task

    def stop(self, reason: str):
        """Cancel the request (a ``stop`` or ``kill`` from its router or its lease): it stops
        where it is, tells a router still waiting ``cancelled``, and closes."""
        if self._stopping or self._closing:
            return
        self._stopping = True
        self.log.info("prefill_cancelled", reason=reason)
        if self._serving:
            self.task.cancel()
        # else: the task has not run yet; ``serve`` closes at once (a task cancelled before
        # its first step would never run its body, nor its close).

    def keep_shipping_for_cache(self):
        """Its router finished the request (cancel ``finished``): ship on for main decode's
        cache, then close; no lease may take it for a request whose cancel was lost."""
        self.ships_for_cache = True

    def on_step_output(self, out: StepOutput):
        """The engine loop's output for this request: its first token, or its failure."""
        future = self.first_token
        if future is None or future.done():
            return
        if out.error:
            future.set_exception(error_with_code(out.error_code or "engine_error", out.error))
        else:
            future.set_result(out)

    @property
    def wants_exports(self) -> bool:
        """Whether ``queue_exports`` has work: a path waits for KV the sequence holds."""
        return self._holds_sequence and not self._closing and self.shipping is not None and self.shipping.wants_exports

    def queue_exports(self, num_kv_tokens: int):
        """Between two engine steps (the service calls it on the engine loop's turn): queue the
        exports of the KV computed since, up to ``num_kv_tokens``; all of it once the first
        token is out."""
        if not self.wants_exports:
            return
        future = self.first_token
        done = future is not None and future.done() and not future.cancelled() and future.exception() is None
        self.shipping.queue_exports(num_kv_tokens, future.result() if done else None)

    async def close(self, reason: str):
        """Free everything the request holds here, once: cancel its tasks and exports, cancel
        the flows still open (receivers discard what arrived; ``reason`` tells them why),
        abort its engine sequence if still held, end its spans, leave the service's table."""
        if self._closing:
            return
        self._closing = True
        try:
            if self.first_token is not None:
                self.first_token.cancel()
            if self.task is not None and self.task is not asyncio.current_task():
                self.task.cancel()
            if self.shipping is not None:
                await self.shipping.cancel(reason)
            if self._holds_sequence:
                self._holds_sequence = False
                await self._host.worker.call(self._host.engine.abort, self.request_id)
        finally:
            if self.shipping is not None:
                self.shipping.end_spans()
            if self._host.jobs.get(self.request_id) is self:
                del self._host.jobs[self.request_id]

    # --- the request's course --------------------------------------------------------------

    async def serve(self):
        """Prefill, answer the router, ship; every way out of here closes the job."""
        self._serving = True
        reason = "prefill cancelled"
        try:
            if not self._stopping:  # else stopped before it began: nothing to answer
                reply = await self._prefill_reply()
                await self._respond(reply)
                if isinstance(reply, PrefillCompleted):
                    reason = await self._ship_all(reply)
                else:
                    reason = f"prefill failed: {reply.code}"
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            reason = f"prefill crashed: {exc!r}"
            raise
        finally:
            await self.close(reason)

    async def _prefill_reply(self) -> PrefillCompleted | RequestFailed:
        """Compute, export and free in a prefill slot; what to answer the router."""
        try:
            async with self._host.slots:  # at most max_sequences prompts held; the rest wait their turn
                return await self._prefill(context_from(headers=self._msg.headers))
        except asyncio.CancelledError:
            if self._closing and not self._stopping:  # closed by its service, not cancelled by its router
                return self._failure("prefill_stopping", "prefill stopped before the request was done")
            return self._failure("cancelled", "request cancelled")
        except FAILURES as exc:
            code = getattr(exc, "code", "timeout" if isinstance(exc, asyncio.TimeoutError) else "bulk_unreachable")
            self.log.warning("prefill_failed", code=code, error=str(exc) or type(exc).__name__)
            return self._failure(code, str(exc) or type(exc).__name__)
        except Exception as exc:
            self.log.exception("prefill_crashed")
            return self._failure("internal_error", repr(exc))

    async def _prefill(self, parent) -> PrefillCompleted:
        """Open the paths (their senders ship each chunk's KV as the engine loop exports it),
        compute the first token, wait until every path's last export is done and free the
        sequence. A failure closes the job before the router hears of it (and before the slot
        goes to the next prompt)."""
        try:
            self.shipping = KvShipping(self._host, self.cmd)
            self.shipping.open_paths(parent)
            first, cached_tokens, compute_s = await self._compute(parent)
            computed_unix_s = time.time()
            bytes_per_path = await self.shipping.frames_exported()
            await self._host.worker.call(self._host.engine.free, self.request_id)
            self._holds_sequence = False
        except asyncio.CancelledError:
            await self.close("prefill cancelled")
            raise
        except BaseException as exc:
            await self.close(f"prefill failed: {getattr(exc, 'code', None) or type(exc).__name__}")
            raise
        return PrefillCompleted(
            request_id=self.request_id,
            instance_id=self._host.instance_id,
            first_token=first.token_id,
            prompt_tokens=len(self.cmd.token_ids),
            cached_tokens=cached_tokens,
            compute_s=compute_s,
            bytes_per_path=bytes_per_path,
            wan_rtt_s=self.shipping.wan_handshake_s,
            computed_unix_s=computed_unix_s,
        )

    async def _respond(self, reply: PrefillCompleted | RequestFailed):
        """The router learns the KV plan (or the failure) now; the frames keep streaming."""
        try:
            await self._msg.respond(encode(reply))
        except nats.errors.Error:
            pass

    async def _ship_all(self, completed: PrefillCompleted) -> str:
        """Wait for every path to be sent; on a failure close the job, then tell the router
        (it may resume the request elsewhere). Return why the job ends."""
        try:
            await self.shipping.sent()
        except FAILURES as exc:
            await self.close("KV transfer failed")
            self.log.warning("kv_shipping_failed", error=str(exc) or type(exc).__name__)
            await self._host.publish(
                subjects.request_events(self.request_id, self._host.instance_id),
                self._failure("kv_transfer_failed", f"KV transfer failed: {exc or type(exc).__name__}"),
            )
            return "KV transfer failed"
        await self.close("every path shipped")
        self.log.info(
            "kv_shipped",
            **{f"{p}_bytes": n for p, n in completed.bytes_per_path.items()},
            cached_tokens=completed.cached_tokens,
        )
        return "every path shipped"

    def _failure(self, code: str, message: str) -> RequestFailed:
        return RequestFailed(
            request_id=self.request_id,
            instance_id=self._host.instance_id,
            code=code,
            message=message,
            retryable=code != "cancelled",
        )

    # --- compute -----------------------------------------------------------------------

    async def _compute(self, parent) -> tuple[StepOutput, int, float]:
        """The first token, the prompt tokens found in the prefix cache, and the seconds it took."""
        with _tracer.start_as_current_span(
            "prefill.compute", context=parent, attributes={"request_id": self.request_id}
        ) as span:
            started = time.perf_counter()
            self._host.speed.started(self.request_id)
            try:
                first, cached_tokens = await self._sample_first_token()
            except BaseException:
                self._host.speed.abandoned(self.request_id)
                raise
            self._host.speed.finished(self.request_id, len(self.cmd.token_ids) - cached_tokens)
            compute_s = time.perf_counter() - started
            PREFILL_SECONDS.labels(self._host.config.served_model_name).observe(compute_s)
            span.set_attribute("cached_tokens", cached_tokens)
        return first, cached_tokens, compute_s

    async def _sample_first_token(self) -> tuple[StepOutput, int]:
        host, cmd = self._host, self.cmd
        self.first_token = asyncio.get_running_loop().create_future()
        # The prefill samples exactly one token, with the request's own seed and parameters.
        sampling = msgspec.structs.replace(cmd.sampling, max_tokens=1, min_tokens=min(1, cmd.sampling.min_tokens))
        self._holds_sequence = True  # from here on: even if cancelled meanwhile, the add may land
        seq = await host.worker.call(host.engine.add_request, self.request_id, cmd.token_ids, sampling, cmd.seed)
        block_size = host.engine.block_size
        PREFIX_HIT_BLOCKS.labels(host.service_name).inc(seq.num_cached_tokens // block_size)
        PREFIX_LOOKUP_BLOCKS.labels(host.service_name).inc(len(cmd.token_ids) // block_size)
        host.loop.wake()
        timeout_s = max(0.1, cmd.deadline_unix_s - time.time())
        return await asyncio.wait_for(self.first_token, timeout_s), seq.num_cached_tokens
