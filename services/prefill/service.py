"""Prefill (P, site A): computes prompt KV, samples the first token, ships KV on both paths.

For each ``StartPrefill`` it starts a ``PrefillJob`` (``services/prefill/job.py``), which
opens the KV flows first (to main decode over the WAN, and to relay decode over the local
path for P→RLD→MD) so their handshakes overlap the compute; then prefills in chunks
(batched with other requests by the engine loop). Between two steps the service lets every
job export the blocks its last chunk completed, so they stream on both paths while the next
chunk computes; after the last chunk the job frees its sequence (the blocks stay in its own
prefix cache). The first token travels with the KV: the decoder that continues the stream
emits it.

The service holds what requests share: the engine and its loop, the prefill slots, the bulk
channel's TLS, and the table of jobs, one per request, which its cancels, its lease and its
engine loop's outputs reach.
"""

import asyncio

import msgspec
import structlog

from services.prefill.job import PrefillJob
from services.prefill.shipping_plan import ShippingPath
from services.prefill.speed import PrefillSpeed
from shared import subjects
from shared.bulk.link_turns import LinkTurns
from shared.bulk.path_sizing import PathStreams, plan_path
from shared.bulk.pool import BulkPool
from shared.bulk.sender import BulkFlow, open_flow
from shared.config import PrefillConfig
from shared.engine.backend import StepOutput
from shared.engine_loop import EngineLoop
from shared.engine_service import EngineService
from shared.messages import CancelRequest, FlowOpen, LoadReported, StartPrefill, decoder
from shared.metrics import ENGINE_STEP_SECONDS
from shared.tls import client_context

log = structlog.get_logger(__name__)
_start_decoder = decoder(StartPrefill)

RECEIVER_TLS_NAME = {"relay_decode": "relay-decode", "main_decode": "main-decode"}
"""The name a receiver's certificate must carry, by its role (whatever address reaches it)."""


class PrefillService(EngineService):
    """The prefill actor."""

    service_name = "prefill"

    def __init__(self, config: PrefillConfig, loaded=None):
        super().__init__(config, loaded)
        self.config: PrefillConfig = config
        self.jobs: dict[str, PrefillJob] = {}
        """Every request held here, by request (attempt) id; a job leaves when it closes."""
        self.loop: EngineLoop | None = None
        self.slots: asyncio.Semaphore | None = None
        self.speed = PrefillSpeed()
        self.bulk_pool = BulkPool()
        """Idle bulk connections, reused by the next flow to the same receiver."""
        self.path_streams: dict[str, PathStreams] = {
            "wan": plan_path(
                config.wan_bandwidth_mbit * 1e6, config.wan_rtt_ms, config.bulk_window_bytes, config.bulk_streams
            ),
            "local": plan_path(0, 0, config.bulk_window_bytes, config.bulk_streams_local),
        }
        """How each path's flows use the network (connections per flow, socket buffers)."""
        self.wan_turns = LinkTurns()
        """The WAN flows, which cross the link shortest-remaining-first."""

    async def on_start(self):
        config = self.config
        self.slots = asyncio.Semaphore(config.max_sequences)
        self._bulk_tls = (
            client_context(config.tls_ca_file, config.tls_cert_file, config.tls_key_file)
            if config.tls_ca_file
            else None
        )
        self.loop = EngineLoop(
            self.worker,
            self._on_outputs,
            between_steps=self._queue_exports,
            step_seconds=ENGINE_STEP_SECONDS.labels(config.served_model_name, self.service_name),
        )
        self.watch(self.loop.start())
        wan, local = self.path_streams["wan"], self.path_streams["local"]
        log.info(
            "bulk_streams_planned",
            wan_streams=wan.streams,
            wan_buffer_bytes=wan.buffer_bytes,
            local_streams=local.streams,
            local_buffer_bytes=local.buffer_bytes,
        )
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
        # Finish what was accepted (each job closes itself); refuse nothing silently
        # (subscriptions drain with NATS after this). A job that came in meanwhile is closed
        # and its router told to resume the request elsewhere.
        await asyncio.gather(*(job.task for job in list(self.jobs.values())), return_exceptions=True)
        late = list(self.jobs.values())
        for job in late:
            await job.close("prefill stopping")
        await asyncio.gather(*(job.task for job in late), return_exceptions=True)
        self.bulk_pool.close()
        if self.loop is not None:
            await self.loop.stop()

    def load_report(self) -> LoadReported:
        return msgspec.structs.replace(
            super().load_report(),
            prefill_first_chunk_tokens=self.config.first_chunk_tokens or self.config.max_batch_tokens,
            prefill_chunk_tokens=self.config.max_batch_tokens,
            prefill_tokens_per_s=round(self.speed.tokens_per_s, 1),
        )

    async def held_request_ids(self) -> list[str]:
        # A request that ended elsewhere ships on for main decode's cache: its router rightly no
        # longer lists it, and no lease must take that for a lost cancel.
        held = set(await super().held_request_ids()) | set(self.jobs)
        return list(held - {rid for rid, job in self.jobs.items() if job.ships_for_cache})

    async def on_cancel(self, cancel: CancelRequest):
        job = self.jobs.get(cancel.request_id)
        if job is None:
            return
        if cancel.kind == "finished":
            job.keep_shipping_for_cache()
        else:
            job.stop(cancel.reason)

    async def dial(self, flow_open: FlowOpen, route: ShippingPath) -> BulkFlow:
        """Open one KV flow to ``route``'s receiver: TLS to a main decoder (which listens with
        TLS wherever it runs) and locally if configured; through the WAN link, sized to the WAN
        path and counted as its bytes when the receiver is at another site (taking turns with
        the other WAN flows), else on the local path; striped over the path's streams on
        connections the pool keeps per receiver."""
        config, receiver = self.config, route.receiver
        network = route.network(config.site)
        plan = self.path_streams[network]
        return await open_flow(
            receiver.bulk_endpoint,
            flow_open,
            config.bulk_secret,
            path=network,
            timeout_s=config.connect_timeout_s,
            accept_timeout_s=config.accept_timeout_s,
            tls=self._bulk_tls if route.path == "wan" or config.bulk_tls_local else None,
            tls_name=RECEIVER_TLS_NAME[route.role],
            link=receiver.bulk_link if network == "wan" else "",
            streams=plan.streams,
            pool=self.bulk_pool,
            buffer_bytes=plan.buffer_bytes,
            turns=self.wan_turns if network == "wan" else None,
        )

    async def _on_start_msg(self, cmd: StartPrefill, msg):
        # NATS runs one callback at a time per subscription: the job runs as a task of its own.
        job = self.jobs[cmd.request_id] = PrefillJob(self, cmd, msg)
        job.start()

    async def _on_outputs(self, outputs: list[StepOutput]):
        for out in outputs:
            job = self.jobs.get(out.request_id)
            if job is not None:
                job.on_step_output(out)

    async def _queue_exports(self):
        """Before the engine's next step: every job whose receivers wait for KV queues the
        export of what the last step computed (on the engine thread, ahead of that step)."""
        jobs = [job for job in self.jobs.values() if job.wants_exports]
        if not jobs:
            return
        reach = await self.worker.call(_kv_reach, self.engine, [job.request_id for job in jobs])
        for job in jobs:
            job.queue_exports(reach.get(job.request_id, 0))


def _kv_reach(engine, request_ids: list[str]) -> dict[str, int]:
    """How many leading tokens of each live request have KV (on the engine thread)."""
    views = ((rid, engine.request(rid)) for rid in request_ids)
    return {rid: view.num_kv_tokens for rid, view in views if view is not None}
