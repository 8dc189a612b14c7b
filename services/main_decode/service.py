"""Main decode (MD, site B): the decode-strong side where every request ends.

It receives prompt KV over the WAN into its decode-side prefix cache (only the blocks it
lacks cross the link), announces ``KvReady``, and then either decodes at once (P→MD: the
prefill's first token came with the KV) or waits for the relay's handoff (P→RLD→MD): token
IDs it absorbs in one extend pass between decode steps of its running batch.

Each request is one ``MainRequest`` in ``self.requests``; ``HandoffIntake`` takes handoffs.
"""

import asyncio
import time

from services.main_decode.handoff_intake import HandoffIntake
from services.main_decode.main_request import MainRequest
from shared import subjects
from shared.bulk.kv_importer import ImportState
from shared.bulk.receiver import FlowStats
from shared.config import BulkReceiverConfig
from shared.decode_request import RequestTable
from shared.decode_service import DecodeService
from shared.engine.backend import RequestView, StepOutput
from shared.messages import FlowOpen, HandoffTokens, KvReady, decoder

_handoff_decoder = decoder(HandoffTokens)


class MainDecodeService(DecodeService):
    """The main decode actor."""

    service_name = "main_decode"
    producer = "MD"
    bulk_path = "wan"
    overlap_steps = True  # nothing it does with a step's outputs changes the next step

    def __init__(self, config: BulkReceiverConfig, loaded=None):
        super().__init__(config, loaded)
        self.requests: RequestTable[MainRequest] = RequestTable()
        self.handoffs = HandoffIntake(self)

    async def on_start(self):
        await super().on_start()
        await self.subscribe(
            subjects.handoff(self.config.site, self.instance_id, "*"), _handoff_decoder, self._on_handoff_msg
        )

    async def _on_import_open(self, flow_open: FlowOpen):
        self.requests.add(MainRequest(flow_open, self.requests))

    async def _on_import_complete(self, state: ImportState, seq: RequestView, stats: FlowStats):
        rid = seq.request_id
        request = self.requests.get(rid)
        if request is not None:  # before KvReady: the relay hands over once it hears it
            request.relay_id = state.flow_open.relay_instance_id or None
        await self._publish_kv_ready(state, stats, seq.num_imported_tokens)
        if seq.output_token_ids and request is not None:
            request.start_span("main.decode", pipeline="P-MD")
        await super()._on_import_complete(state, seq, stats)

    async def _on_import_kept(self, state: ImportState, stats: FlowStats):
        """The KV of a request the relay finished landed all the same: the router learns the
        link from its transfer and takes the flow off its ledger."""
        await self._publish_kv_ready(state, stats, len(state.flow_open.token_ids) - state.cached_tokens)

    async def _publish_kv_ready(self, state: ImportState, stats: FlowStats, imported_tokens: int):
        rid = state.flow_open.request_id
        await self.publish(
            subjects.request_events(rid, self.instance_id),
            KvReady(
                request_id=rid,
                instance_id=self.instance_id,
                site=self.config.site,
                cached_tokens=state.cached_tokens,
                imported_tokens=imported_tokens,
                wan_kv_bytes=stats.bytes_received,
                transfer_s=stats.transfer_s,
                throughput_bps=(stats.streaming_bytes_per_s or 0.0) * 8,
                landed_unix_s=time.time() - (time.monotonic() - stats.finished_monotonic),
            ),
        )

    async def _on_handoff_msg(self, handoff: HandoffTokens, msg):
        asyncio.create_task(self.handoffs.accept(handoff, msg))

    async def _on_outputs(self, outputs: list[StepOutput]):
        live = []
        for out in outputs:
            request = self.requests.get(out.request_id)
            if request is None:
                continue  # closed (cancelled) while its step ran: nothing more of it leaves
            if out.absorbed:
                request.absorbed(out.token_index)
            else:
                request.end_recompute_span()
                live.append(out)
        await super()._on_outputs(live)
