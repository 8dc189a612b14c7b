"""One request's journey as the router sees it: dispatch, ordered token stream, recovery, outcome.

The router's mailbox (subscribed once at start-up) collects the request's token stream and
events from before the dispatch, so nothing is missed. Tokens from the relay and the main
decoder are merged by index in the request's ``TokenLog``: every index reaches the client
exactly once, in order. Every wait has a timeout.

When an instance the stream needs dies, goes silent, or reports a retryable failure, the
request is resumed elsewhere by token replay: a new attempt (its own request id) is placed
avoiding the failed instance and dispatched with the tokens the client already has; the
decoder that continues computes their KV in one extend pass and samples on from the next
index, with the same seed, so the text is the one an undisturbed run gives. Failures of an
instance the stream no longer needs (main decode while the relay streams, prefill once its
KV has landed) cost nothing: the request goes on.
"""

import asyncio
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import msgspec
import nats
import structlog
from opentelemetry import trace

from services.router.kv_landings import KvLandings
from services.router.mailbox import Inbox, RequestMailbox
from services.router.odd_traffic import OddTrafficTracker, OddTransition
from services.router.outcome import Recovery, RequestOutcome
from services.router.placement import NoInstances, Placement
from services.router.recovery_plan import InstanceFailed, RecoveryPlan, UpstreamFailed
from services.router.registry import InstanceRegistry
from services.router.stream_watch import StreamWatch
from services.router.token_intake import DirectSink, TokenIntake
from services.router.token_log import TokenLog
from services.router.wan_estimate import WanEstimator
from shared import subjects
from shared.config import RouterConfig
from shared.engine.sampling import SamplingParams
from shared.messages import (
    CancelRequest,
    HandoffAccepted,
    KvImportAborted,
    KvReady,
    PrefillCompleted,
    PrefillReply,
    RequestFailed,
    ResendTokens,
    StartPrefill,
    decoder,
    encode,
)
from shared.metrics import ODD_TRAFFIC, RECOVERIES
from shared.tracing import trace_headers, tracer

log = structlog.get_logger(__name__)
_prefill_reply_decoder = decoder(PrefillReply)
_tracer = tracer("pdd.router")
LIVENESS_TICK_S = 0.5
RESEND_AFTER_S = 1.0
ODD_CANCEL_REPORT_S = 2.0

Replacer = Callable[[frozenset[str]], Awaitable[Placement]]


def new_request_id(origin: str) -> str:
    """A fresh request id minted by the router instance ``origin``."""
    return subjects.new_request_id(origin, secrets.token_hex(12))


@dataclass(frozen=True)
class FlowContext:
    """What every request flow of one router shares: its connections, its view of the fleet,
    its settings (timeouts, block size, recovery bounds)."""

    nc: nats.NATS
    mailbox: RequestMailbox
    registry: InstanceRegistry
    wan: WanEstimator
    config: RouterConfig
    kv_landings: KvLandings


class PlacedLoad:
    """The load one request counts on the instances it is placed on (placement weighs it)."""

    def __init__(self, registry: InstanceRegistry):
        self.registry = registry
        self.placement: Placement | None = None
        self.instance_ids: list[str] = []

    def assign(self, placement: Placement):
        self.release(self.instance_ids)
        self.placement, self.instance_ids = placement, list(placement.instance_ids)
        self.registry.assign(self.instance_ids, placement.num_prompt_blocks, placement.compute_blocks)

    def release(self, instance_ids: list[str]):
        """Stop counting the request on ``instance_ids``."""
        counted = [i for i in instance_ids if i in self.instance_ids]
        if counted:
            p = self.placement
            self.registry.release(counted, p.num_prompt_blocks, p.compute_blocks)
            self.instance_ids = [i for i in self.instance_ids if i not in counted]


class RequestFlow:
    """Runs one request; iterate ``tokens()`` for ordered output token batches."""

    def __init__(
        self,
        context: FlowContext,
        request_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingParams,
        placement: Placement,
        started: float,
        replace: Replacer | None = None,
    ):
        self.ctx, self.config = context, context.config
        self.request_id, self.prompt_token_ids, self.sampling = request_id, prompt_token_ids, sampling
        self.placement, self.started, self._replace = placement, started, replace
        # One seed for every attempt: token i is drawn from (seed, i) wherever it is sampled.
        self.seed = sampling.seed if sampling.seed is not None else secrets.randbits(63)
        self.log = TokenLog()
        self.attempt, self.attempt_id = 0, request_id
        self.recovery = RecoveryPlan(self.config.max_recoveries if replace is not None else 0)
        self.load = PlacedLoad(context.registry)
        self._wan_bytes_before = 0
        self.outcome = RequestOutcome(
            pipeline=placement.pipeline,
            prompt_tokens=len(prompt_token_ids),
            cached_blocks_md=placement.md_cached_blocks,
        )
        self.outcome.place(placement)
        self._inbox: Inbox | None = None
        self.sink: DirectSink | None = None
        self._start_attempt_state()

    def _start_attempt_state(self):
        self.odd = OddTrafficTracker(self.placement.odd_traffic)
        self._record_odd(self.odd.initial, log_it=self.odd.odd)
        self._wan_bytes_final = False
        self.watch = StreamWatch(
            self.placement,
            time.monotonic(),
            first_token_timeout_s=self.config.first_token_timeout_s,
            token_timeout_s=self.config.token_timeout_s,
            resend_after_s=RESEND_AFTER_S,
        )
        self.intake = TokenIntake(self.request_id, self.log, self.watch, self.outcome, self.started)

    def _record_odd(self, transition: OddTransition | None, log_it: bool = True):
        """Count an odd-traffic transition; log it and add it to the current span."""
        if transition is None:
            return
        state, why = transition.state.value, transition.why
        ODD_TRAFFIC.labels(state).inc()
        if not log_it:
            return
        log.info("odd_traffic_state", request_id=self.attempt_id, state=state, why=why)
        trace.get_current_span().add_event("odd_traffic", {"state": state, "why": why})

    async def tokens(self) -> AsyncIterator[list[int]]:
        """Ordered batches of new output token IDs until the request finishes.

        Raises:
            UpstreamFailed, UpstreamTimeout: the request cannot complete (after at most
                ``max_recoveries`` resumptions).
        """
        self.load.assign(self.placement)
        completed = False
        try:
            while True:
                try:
                    async for batch in self._attempt_tokens():
                        yield batch
                    break
                except InstanceFailed as failure:
                    await self._recover(failure)
            if self.outcome.finished_on == "RLD":
                cancelled = self.odd.relay_finished()
                if cancelled is not None:
                    self._record_odd(cancelled)
                    await self._cancel_wan_transfer()
            completed = True
        finally:
            self.load.release(self.load.instance_ids)
            for item in self._inbox.items if self._inbox is not None else ():
                if isinstance(item[1], KvReady):  # arrived while the last tokens went out
                    self._keep_landing(item[1])
            self.ctx.mailbox.close(self.attempt_id)
            await self._cancel(
                self.attempt_id,
                "finished" if completed else "stop",
                "request finished" if completed else "client gone or request failed",
            )

    async def _attempt_tokens(self) -> AsyncIterator[list[int]]:
        self._inbox = self.ctx.mailbox.open(self.attempt_id)
        dispatch = asyncio.create_task(self._dispatch(self._inbox))
        try:
            async for batch in self._ordered_tokens():
                yield batch
        except BaseException:
            dispatch.cancel()
            raise
        # Answered (the relay may finish before the prefill replies): the reply, when it comes,
        # still records the prompt's end beside the KV's late landing (``_dispatch``).

    async def _cancel(self, attempt_id: str, kind: str, reason: str):
        try:
            await self.ctx.nc.publish(
                subjects.cancel(subjects.origin_of(attempt_id)),
                encode(CancelRequest(request_id=attempt_id, kind=kind, reason=reason)),
            )
        except nats.errors.Error:
            log.warning("cancel_not_sent", request_id=self.request_id, attempt_id=attempt_id)

    async def _recover(self, failure: InstanceFailed):
        """Resume the request on a new attempt, or raise the error the client gets."""
        avoid = self.recovery.decide(failure, len(self.outcome.recoveries))
        self.ctx.kv_landings.supersede(self.attempt_id)
        if self.recovery.instance_gone(failure):
            self.ctx.registry.forget(failure.instance_id)
        placement = await self._place_again(failure, avoid)
        failed_id = self.attempt_id
        self.ctx.mailbox.close(failed_id)
        await self._cancel(failed_id, "kill", f"recovering from {failure.instance_id}: {failure.reason}")
        self.load.assign(placement)
        self._wan_bytes_before = self.outcome.wan_kv_bytes
        self.log.forget_pending()
        self.attempt += 1
        self.attempt_id = subjects.attempt_request_id(self.request_id, self.attempt)
        self.placement = placement
        self.outcome.place(placement)
        self._start_attempt_state()
        recovery = Recovery(failure.instance_id, self.watch.producer().instance_id, failure.reason, self.log.next_index)
        self.outcome.recoveries.append(recovery)
        RECOVERIES.labels(failure.reason).inc()
        attributes = {"attempt": self.attempt, "pipeline": placement.pipeline, **recovery.as_pdd()}
        log.warning(
            "request_recovering",
            request_id=self.request_id,
            attempt_id=self.attempt_id,
            error=str(failure),
            **attributes,
        )
        trace.get_current_span().add_event("recovery", {"request_id": self.request_id, **attributes})
        _tracer.start_span("router.recovery", attributes={"request_id": self.request_id, **attributes}).end()

    async def _place_again(self, failure: InstanceFailed, avoid: frozenset[str]) -> Placement:
        """A placement avoiding the failed instances; waits (bounded) while none is live, e.g.
        for a supervisor to bring the only prefill back."""
        deadline = time.monotonic() + self.config.recovery_wait_s
        while True:
            try:
                return await self._replace(avoid)
            except NoInstances as exc:
                if time.monotonic() > deadline:
                    raise UpstreamFailed(f"{failure}; nowhere to resume the request: {exc}") from None
            await asyncio.sleep(LIVENESS_TICK_S)

    async def _cancel_wan_transfer(self):
        """Odd traffic the relay finished: stop the WAN flow, learn how much had crossed."""
        self.ctx.wan.flow_stopped(self.request_id)
        await self._cancel(
            self.attempt_id, "stop", "odd traffic: the relay finished before main decode's KV was complete"
        )
        deadline = time.monotonic() + ODD_CANCEL_REPORT_S
        while time.monotonic() < deadline:
            for item in await self._inbox.take():  # [] on the mailbox's tick: the deadline is checked
                event = item[1]
                if isinstance(event, KvImportAborted):
                    self.outcome.wan_kv_bytes = self._wan_bytes_before + self._over_wan(event.wan_kv_bytes)
                    self._wan_bytes_final = True
                    return
                if isinstance(event, PrefillCompleted):
                    self._on_event(event)
                elif isinstance(event, KvReady):  # it landed before the stop reached main decode
                    self._keep_landing(event)

    async def _dispatch(self, inbox: Inbox):
        p = self.placement
        command = StartPrefill(
            request_id=self.attempt_id,
            attempt=self.attempt,
            token_ids=self.prompt_token_ids,
            sampling=self.sampling,
            seed=self.seed,
            pipeline=p.pipeline,
            main_decode=p.main_decode,
            relay_decode=p.relay_decode,
            deadline_unix_s=time.time() + self.config.first_token_timeout_s,
            resume_token_ids=list(self.log.token_ids),
            wan_after_prompt=p.odd_traffic,
        )
        subject = subjects.instance_work(p.prefill.site, "prefill", p.prefill.instance_id, subjects.START_PREFILL)
        attempt_id = self.attempt_id  # the reply is this attempt's, whatever the flow does meanwhile
        if p.main_decode is not None:
            self.ctx.kv_landings.expect(self.request_id, attempt_id, p.main_decode.instance_id, p.kv_crosses_sites)
        try:
            reply = await self.ctx.nc.request(
                subject, encode(command), headers=trace_headers(), timeout=self.config.first_token_timeout_s
            )
            answer = _prefill_reply_decoder.decode(reply.data)
            if isinstance(answer, PrefillCompleted):
                compute_ms = round(answer.compute_s * 1000, 1)
                self.ctx.kv_landings.prefill_done(attempt_id, answer.computed_unix_s, compute_ms)
            inbox.put(("prefill", answer))
        except (TimeoutError, nats.errors.Error, msgspec.DecodeError) as exc:
            inbox.put(("prefill", exc))

    async def _ordered_tokens(self) -> AsyncIterator[list[int]]:
        """Ordered token batches: everything that arrived together is merged into one batch
        (one SSE event), and an event is acted on only after the tokens before it are out."""
        while not self.log.complete:
            # A new attempt waits for its first token as long as a new request does.
            timeout = self.watch.timeout_exceeded(time.monotonic())
            if timeout is not None:
                raise InstanceFailed(
                    f"no token for {timeout:.0f} s (request {self.request_id})",
                    self.watch.producer().instance_id,
                    "timeout",
                )
            await self._repair_gap()
            intake = self.intake
            intake.sink = self.sink
            arrived = await self._inbox.take(intake.direct if intake.sink is not None else None)
            if not arrived:  # the mailbox's tick: quiet for a while
                self._check_liveness()
                continue
            batch: list[int] = []
            for item in arrived:
                kind = item[0]
                if kind == "step":
                    batch += intake.released_step(*item[1:])
                elif kind == "tokens":
                    batch += intake.released(item[1])
                elif kind == "raise":
                    raise item[1]
                else:
                    if batch:
                        yield intake.delivered(batch)
                        batch = []
                    self._on_event(item[1])
            if batch:
                yield intake.delivered(batch)

    async def _repair_gap(self):
        """Ask the decoders to resend from the first missing index when the stream has a hole
        or went quiet (core NATS drops what is published while a server restarts, even the
        first tokens). Harmless when nothing was lost: a producer sends only what it has."""
        if not self.watch.resend_due(time.monotonic()):
            return
        (log.info if self.log.has_gap else log.debug)(
            "tokens_resend_requested",
            request_id=self.request_id,
            attempt_id=self.attempt_id,
            from_index=self.log.next_index,
            gap=self.log.has_gap,
        )
        resend = encode(ResendTokens(request_id=self.attempt_id, from_index=self.log.next_index))
        for ref, service in (
            (self.placement.relay_decode, "relay_decode"),
            (self.placement.main_decode, "main_decode"),
        ):
            if ref is not None:
                try:
                    await self.ctx.nc.publish(
                        subjects.instance_work(ref.site, service, ref.instance_id, subjects.RESEND), resend
                    )
                except nats.errors.Error:
                    return  # NATS itself is down: ask again on the next tick

    def _on_event(self, event):
        prefill = self.placement.prefill.instance_id
        if isinstance(event, BaseException):
            raise InstanceFailed(
                f"prefill {prefill} did not answer: {type(event).__name__} {event}", prefill, "prefill_unreachable"
            )
        if isinstance(event, RequestFailed):
            self._on_failure(event)
        elif isinstance(event, PrefillCompleted):
            self.load.release([prefill])  # its work for the request is done: it is free for the next
            if self.placement.kv_crosses_sites:
                self.ctx.wan.add_rtt(event.wan_rtt_s)
            self.ctx.wan.prefill_done(self.request_id)
            self.outcome.prefill_compute_ms = round(event.compute_s * 1000, 1)
            self.outcome.prefill_computed_unix_s = event.computed_unix_s
            if self.attempt == 0:  # what the client's prompt reused (a recovery's prefill is ours)
                self.outcome.prefill_cached_tokens = event.cached_tokens
            if not self._wan_bytes_final:
                self.outcome.wan_kv_bytes = self._wan_bytes_before + self._over_wan(event.bytes_per_path.get("wan", 0))
        elif isinstance(event, KvReady):
            self.watch.on_kv_ready()
            self._record_odd(self.odd.kv_landed())
            if self.placement.kv_crosses_sites:
                self.ctx.wan.add_throughput(event.throughput_bps, event.wan_kv_bytes, self.request_id)
            self.ctx.wan.flow_landed(self.request_id)
            self.outcome.kv_transfer_ms = round(event.transfer_s * 1000, 1)
            self.outcome.kv_landed_unix_s = event.landed_unix_s
            self._keep_landing(event)
            self.outcome.cached_blocks_md = event.cached_tokens // self.config.block_size
        elif isinstance(event, HandoffAccepted):
            self.watch.on_handoff_accepted(event.final)
            self.outcome.handoff_chunks = max(self.outcome.handoff_chunks, event.chunk)
            self.outcome.handoff_mode = event.mode

    def _keep_landing(self, event: KvReady):
        """File a landing this flow received (through its inbox: the attempt's own events) for
        the request's holder, as late ones are (``kv_landings``)."""
        main_decode = self.placement.main_decode
        if main_decode is not None:
            self.ctx.kv_landings.landed(
                self.attempt_id, main_decode.instance_id, event.landed_unix_s, event.wan_kv_bytes
            )

    def _over_wan(self, kv_bytes: int) -> int:
        """``kv_bytes`` if this attempt's KV went to a main decoder at the other site, else 0
        (a same-site deployment's flows never touch the WAN)."""
        return kv_bytes if self.placement.kv_crosses_sites else 0

    def _on_failure(self, event: RequestFailed):
        message = f"{event.instance_id}: {event.code}: {event.message}"
        if not self.watch.failure_matters(event.instance_id):
            # E.g. main decode's import broke while the relay streams: the relay finishes.
            log.warning(
                "failure_not_on_stream_path", request_id=self.request_id, instance=event.instance_id, code=event.code
            )
            return
        if event.retryable:
            raise InstanceFailed(message, event.instance_id, event.code)
        raise UpstreamFailed(message)

    def _check_liveness(self):
        for ref in self.watch.needed():
            if self.ctx.registry.is_dead(ref):
                raise InstanceFailed(
                    f"instance {ref.instance_id} stopped responding (request {self.request_id})",
                    ref.instance_id,
                    "instance_unresponsive",
                )
