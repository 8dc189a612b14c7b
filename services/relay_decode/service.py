"""Relay decode (RLD, site A): masks the WAN transfer with eager tokens.

It receives the prompt KV over the fast local path with the prefill's first token, starts
decoding at once and streams those eager tokens to the client. When main decode announces
``KvReady`` the request's ``HandoffMachine`` decides one-shot or catch-up; the relay hands
over token IDs (never KV) chunk by chunk and, once main decode owns the request, frees it.
If a handoff fails the relay simply finishes the request itself.

Each request is one ``RelayedRequest`` in ``self.requests``; ``HandoffRunner`` carries out
its handoff.
"""

from services.relay_decode.handoff import HandoffPolicy, HandoffState
from services.relay_decode.handoff_runner import HandoffRunner, emitted_tokens
from services.relay_decode.relayed_request import RelayedRequest
from shared import subjects
from shared.bulk.kv_importer import ImportState
from shared.bulk.receiver import FlowStats
from shared.config import RelayDecodeConfig
from shared.decode_request import RequestTable
from shared.decode_service import DecodeService
from shared.engine.backend import RequestView, StepOutput
from shared.messages import FlowOpen, KvReady, RequestEvent, decoder
from shared.metrics import EAGER_TOKENS, REFUSED_MESSAGES

_event_decoder = decoder(RequestEvent)


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
        self.requests: RequestTable[RelayedRequest] = RequestTable()
        self.handoffs = HandoffRunner(self)

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
        self.requests.add(RelayedRequest(flow_open, self.requests, self.policy))

    async def _on_import_complete(self, state: ImportState, seq: RequestView, stats: FlowStats):
        request = self.requests.get(seq.request_id)
        if request is not None:
            request.start_span("relay.decode")
        EAGER_TOKENS.inc(len(seq.output_token_ids))
        await super()._on_import_complete(state, seq, stats)
        if request is not None and request.ready is not None:  # main decode was ready before the local copy landed
            await self._main_decode_ready(request)

    async def _on_request_event(self, event, msg):
        request = self.requests.get(event.request_id) if isinstance(event, KvReady) else None
        if request is None:
            return
        if event.instance_id != request.main_decoder:
            REFUSED_MESSAGES.labels(self.service_name, "kv_ready_from_another_main_decode").inc()
            self.log.warning("kv_ready_refused", request_id=event.request_id, instance=event.instance_id)
            return
        request.ready = event
        await self._main_decode_ready(request)

    async def _main_decode_ready(self, request: RelayedRequest):
        if request.closed or request.machine.state is not HandoffState.DECODING:
            return
        emitted = await self.worker.call(emitted_tokens, self.engine, request.request_id)
        if emitted is None or request.closed or request.machine.state is not HandoffState.DECODING:
            return  # still importing (retried when the import completes), finished, dropped, or decided meanwhile
        chunk = request.machine.kv_ready(emitted, self.load())
        self.handoffs.record(request)
        self.handoffs.start(request, chunk)

    async def _on_outputs(self, outputs: list[StepOutput]):
        EAGER_TOKENS.inc(sum(1 for o in outputs if o.token_id is not None))
        await super()._on_outputs(outputs)
        for out in outputs:
            request = self.requests.get(out.request_id)
            if request is not None and not out.finished and out.token_id is not None:
                chunk = request.machine.tokens_emitted(out.token_index + 1, self.load())
                self.handoffs.record(request)
                self.handoffs.start(request, chunk)

    async def on_finished(self, out: StepOutput):
        request = self.requests.get(out.request_id)
        if request is not None:
            request.machine.finished_locally()
            self.handoffs.record(request)
        await super().on_finished(out)
