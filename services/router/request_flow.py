"""One request's journey as the router sees it: dispatch, ordered token stream, outcome.

The router's mailbox (subscribed once at start-up) collects the request's token stream and
events from before the dispatch, so nothing is missed. Tokens from the relay and the main
decoder are merged by index: every index reaches the client exactly once, in order. Every
wait has a timeout, and a request whose producing instance stops heart-beating fails fast
with a clear error.
"""

import asyncio
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import nats

from services.router.mailbox import RequestMailbox
from services.router.odd_traffic import OddTrafficTracker
from services.router.placement import Placement
from services.router.registry import InstanceRegistry
from services.router.wan_estimate import WanEstimator
from shared import subjects
from shared.engine.sampling import SamplingParams
from shared.errors import PddError
from shared.messages import (
    CancelRequest,
    HandoffAccepted,
    KvImportAborted,
    KvReady,
    PrefillCompleted,
    PrefillReply,
    RequestEvent,
    RequestFailed,
    StartPrefill,
    TokensEmitted,
    decoder,
    encode,
)
from shared.tracing import trace_headers

_tokens_decoder = decoder(TokensEmitted)
_event_decoder = decoder(RequestEvent)
_prefill_reply_decoder = decoder(PrefillReply)
LIVENESS_TICK_S = 0.5
ODD_CANCEL_REPORT_S = 2.0


class UpstreamFailed(PddError):
    """A service reported the request failed, or its instance vanished."""

    code = "upstream_failed"


class UpstreamTimeout(PddError):
    """No token arrived within the configured wait."""

    code = "timeout"


def new_request_id(origin: str) -> str:
    """A fresh request id minted by the router instance ``origin``."""
    return subjects.new_request_id(origin, secrets.token_hex(12))


@dataclass
class RequestOutcome:
    """What the ``pdd`` response object reports about a request.

    Attributes mirror the response fields; ``finish_reason`` is OpenAI's.
    """

    pipeline: str
    prompt_tokens: int
    cached_blocks_md: int
    finished_on: str | None = None
    handoff_mode: str | None = None
    handoff_chunks: int = 0
    eager_tokens: int = 0
    wan_kv_bytes: int = 0
    odd_traffic: bool = False
    ttft_ms: float | None = None
    finish_reason: str | None = None
    output_tokens: int = 0
    instances: dict[str, str] = field(default_factory=dict)
    predicted_wan_ms: float = 0.0
    kv_transfer_ms: float | None = None

    def as_pdd(self) -> dict:
        """The ``pdd`` extension object."""
        return {
            "pipeline": self.pipeline, "finished_on": self.finished_on,
            "handoff_mode": self.handoff_mode, "handoff_chunks": self.handoff_chunks,
            "eager_tokens": self.eager_tokens, "prompt_tokens": self.prompt_tokens,
            "cached_blocks_md": self.cached_blocks_md, "wan_kv_bytes": self.wan_kv_bytes,
            "odd_traffic": self.odd_traffic, "ttft_ms": self.ttft_ms,
            "predicted_wan_ms": round(self.predicted_wan_ms, 1),
            "kv_transfer_ms": self.kv_transfer_ms, "instances": self.instances,
        }


class RequestFlow:
    """Runs one request; iterate ``tokens()`` for ordered output token batches."""

    def __init__(self, nc: nats.NATS, mailbox: RequestMailbox, registry: InstanceRegistry, *,
                 wan: WanEstimator, request_id: str,
                 prompt_token_ids: list[int], sampling: SamplingParams, placement: Placement,
                 first_token_timeout_s: float, token_timeout_s: float, started: float,
                 block_size: int):
        self.nc, self.mailbox, self.registry, self.wan = nc, mailbox, registry, wan
        self.request_id = request_id
        self.prompt_token_ids, self.sampling, self.placement = prompt_token_ids, sampling, placement
        self.first_token_timeout_s, self.token_timeout_s = first_token_timeout_s, token_timeout_s
        self.started = started
        self.block_size = block_size
        self.outcome = RequestOutcome(
            pipeline=placement.pipeline, prompt_tokens=len(prompt_token_ids),
            cached_blocks_md=placement.md_cached_blocks,
            predicted_wan_ms=placement.predicted_wan_s * 1000,
            instances={"prefill": placement.prefill.instance_id,
                       "main_decode": placement.main_decode.instance_id,
                       **({"relay_decode": placement.relay_decode.instance_id}
                          if placement.relay_decode else {})})
        self._queue: asyncio.Queue | None = None
        self.odd = OddTrafficTracker(request_id, placement.odd_traffic)
        self.outcome.odd_traffic = placement.odd_traffic
        self._wan_bytes_final = False
        self._handed_over = False
        self._prefill_done = False

    async def tokens(self) -> AsyncIterator[list[int]]:
        """Ordered batches of new output token IDs until the request finishes.

        Raises:
            UpstreamFailed, UpstreamTimeout: the request cannot complete.
        """
        self._queue = self.mailbox.open(self.request_id)
        prefill = asyncio.create_task(self._dispatch())
        completed = False
        try:
            async for batch in self._ordered_tokens():
                yield batch
            if self.outcome.finished_on == "RLD" and self.odd.relay_finished():
                await self._cancel_wan_transfer()
            completed = True
        finally:
            prefill.cancel()
            self.mailbox.close(self.request_id)
            kind = "finished" if completed else "stop"
            try:
                await self.nc.publish(subjects.CANCEL, encode(CancelRequest(
                    request_id=self.request_id, kind=kind,
                    reason="request finished" if completed else "client gone or request failed")))
            except nats.errors.Error:
                pass

    async def _cancel_wan_transfer(self):
        """Odd traffic the relay finished: stop the WAN flow, learn how much had crossed."""
        await self.nc.publish(subjects.CANCEL, encode(CancelRequest(
            request_id=self.request_id, kind="stop",
            reason="odd traffic: the relay finished before main decode's KV was complete")))
        deadline = time.monotonic() + ODD_CANCEL_REPORT_S
        while time.monotonic() < deadline:
            try:
                kind, item = await asyncio.wait_for(self._queue.get(), deadline - time.monotonic())
            except asyncio.TimeoutError:
                break
            event = _event_decoder.decode(item.data) if kind == "event" else item
            if isinstance(event, KvImportAborted):
                self.outcome.wan_kv_bytes, self._wan_bytes_final = event.wan_kv_bytes, True
                return
            if isinstance(event, PrefillCompleted):
                self._on_event(event)

    async def _dispatch(self):
        p = self.placement
        command = StartPrefill(
            request_id=self.request_id, token_ids=self.prompt_token_ids, sampling=self.sampling,
            seed=self.sampling.seed if self.sampling.seed is not None else secrets.randbits(63),
            pipeline=p.pipeline, main_decode=p.main_decode, relay_decode=p.relay_decode,
            deadline_unix_s=time.time() + self.first_token_timeout_s)
        subject = subjects.instance_work(p.prefill.site, "prefill", p.prefill.instance_id,
                                         subjects.START_PREFILL)
        try:
            reply = await self.nc.request(subject, encode(command), headers=trace_headers(),
                                          timeout=self.first_token_timeout_s)
            self._queue.put_nowait(("prefill", _prefill_reply_decoder.decode(reply.data)))
        except (nats.errors.Error, asyncio.TimeoutError) as exc:
            self._queue.put_nowait(("prefill", exc))

    async def _ordered_tokens(self) -> AsyncIterator[list[int]]:
        next_index, pending, final_index = 0, {}, None
        last_progress = time.monotonic()
        while final_index is None or next_index <= final_index:
            timeout = self.first_token_timeout_s if next_index == 0 else self.token_timeout_s
            if time.monotonic() - last_progress > timeout:
                raise UpstreamTimeout(f"no token for {timeout:.0f} s (request {self.request_id})")
            try:
                kind, item = await asyncio.wait_for(self._queue.get(), LIVENESS_TICK_S)
            except asyncio.TimeoutError:
                self._check_liveness()
                continue
            if kind == "tokens":
                message = _tokens_decoder.decode(item.data)
                for offset, token in enumerate(message.token_ids):
                    index = message.start_index + offset
                    if index >= next_index:
                        pending.setdefault(index, (token, message.producer))
                if message.finish_reason is not None:
                    final_index = message.start_index + len(message.token_ids) - 1
                    self.outcome.finish_reason = message.finish_reason
                    self.outcome.finished_on = message.producer
                batch = []
                while next_index in pending:
                    token, producer = pending.pop(next_index)
                    batch.append(token)
                    self.outcome.eager_tokens += producer == "RLD"
                    next_index += 1
                if batch:
                    last_progress = time.monotonic()
                    if self.outcome.ttft_ms is None:
                        self.outcome.ttft_ms = round((time.perf_counter() - self.started) * 1000, 1)
                    self.outcome.output_tokens = next_index
                    yield batch
            else:
                self._on_event(item if kind == "prefill" else _event_decoder.decode(item.data))

    def _on_event(self, event):
        if isinstance(event, BaseException):
            raise UpstreamFailed(f"prefill {self.placement.prefill.instance_id} did not answer: "
                                 f"{type(event).__name__} {event}")
        if isinstance(event, RequestFailed):
            raise UpstreamFailed(f"{event.instance_id}: {event.code}: {event.message}")
        if isinstance(event, PrefillCompleted):
            self._prefill_done = True
            self.wan.add_rtt(event.wan_rtt_s)
            if not self._wan_bytes_final:
                self.outcome.wan_kv_bytes = event.bytes_per_path.get("wan", 0)
        elif isinstance(event, KvReady):
            self.odd.kv_landed()
            self.wan.add_throughput(event.throughput_bps, event.wan_kv_bytes)
            self.outcome.kv_transfer_ms = round(event.transfer_s * 1000, 1)
            self.outcome.cached_blocks_md = event.cached_tokens // self.block_size
        elif isinstance(event, HandoffAccepted):
            self._handed_over = self._handed_over or event.final
            self.outcome.handoff_chunks = max(self.outcome.handoff_chunks, event.chunk)
            self.outcome.handoff_mode = event.mode

    def _check_liveness(self):
        p = self.placement
        if not self._prefill_done and not self.registry.is_alive(p.prefill.instance_id):
            raise UpstreamFailed(f"prefill instance {p.prefill.instance_id} stopped responding")
        relaying = p.relay_decode is not None and not self._handed_over
        if relaying and not self.registry.is_alive(p.relay_decode.instance_id):
            raise UpstreamFailed(f"relay decode instance {p.relay_decode.instance_id} stopped responding")
        if not relaying and not self.registry.is_alive(p.main_decode.instance_id):
            raise UpstreamFailed(f"main decode instance {p.main_decode.instance_id} stopped responding")
