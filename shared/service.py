"""What every service process shares: NATS connection, heartbeats, cancels, graceful stop."""

import asyncio
import signal
import time

import nats
import structlog

from shared import subjects
from shared.config import CommonConfig
from shared.logging import configure_logging
from shared.messages import CancelRequest, InstanceRef, LoadReported, decoder, encode
from shared.metrics import serve_metrics
from shared.tracing import configure_tracing

log = structlog.get_logger(__name__)
_cancel_decoder = decoder(CancelRequest)


class Service:
    """Base of the five services: one actor, one asyncio loop, one NATS connection."""

    service_name = "service"

    def __init__(self, config: CommonConfig):
        self.config = config
        self.instance_id = config.instance_id
        self.nc: nats.NATS | None = None
        self._tasks: list[asyncio.Task] = []
        self._stopping = asyncio.Event()
        self.log = log.bind(service=self.service_name, instance=self.instance_id)

    # --- to override -------------------------------------------------------------------

    async def on_start(self):
        """Subscribe and start serving (NATS is connected)."""

    async def on_stop(self):
        """Stop taking work and finish or hand back what is in flight."""

    async def on_cancel(self, cancel: CancelRequest):
        """Drop a request, if held here."""

    def load_report(self) -> LoadReported:
        """The heartbeat to publish."""
        return LoadReported(instance=self.instance_ref(), service=self.service_name,
                            unix_s=time.time())

    def instance_ref(self) -> InstanceRef:
        """How other instances reach this one."""
        return InstanceRef(instance_id=self.instance_id, site=self.config.site)

    # --- lifecycle ---------------------------------------------------------------------

    async def start(self):
        """Connect to this site's NATS server and start serving."""
        self.nc = await nats.connect(
            self.config.nats_url, name=self.instance_id, max_reconnect_attempts=-1,
            reconnect_time_wait=0.5, connect_timeout=5,
        )
        await self.nc.subscribe(subjects.CANCEL, cb=self._on_cancel_msg)
        if self.config.metrics_port:
            port = serve_metrics(self.config.metrics_host, self.config.metrics_port)
            self.log.info("metrics_listening", url=f"http://{self.config.metrics_host}:{port}/metrics")
        await self.on_start()
        self._tasks.append(asyncio.create_task(self._heartbeat(), name="heartbeat"))
        self.log.info("service_started", site=self.config.site)

    async def stop(self):
        """Graceful stop: stop taking work, finish in-flight work, drain NATS."""
        self.log.info("service_stopping")
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.on_stop()
        if self.nc and not self.nc.is_closed:
            try:
                await asyncio.wait_for(self.nc.drain(), 5)
            except (asyncio.TimeoutError, nats.errors.Error):
                await self.nc.close()
        self.log.info("service_stopped")

    async def publish(self, subject: str, message, headers: dict | None = None):
        """Publish a schema message."""
        await self.nc.publish(subject, encode(message), headers=headers)

    async def _heartbeat(self):
        subject = subjects.load(self.config.site, self.instance_id)
        while True:
            try:
                await self.publish(subject, self.load_report())
            except nats.errors.Error as exc:
                self.log.warning("heartbeat_failed", error=str(exc))
            await asyncio.sleep(self.config.heartbeat_s)

    async def _on_cancel_msg(self, msg):
        cancel = _cancel_decoder.decode(msg.data)
        await self.on_cancel(cancel)


async def wait_for_termination():
    """Return at the first SIGTERM or SIGINT."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()


async def run_service(service: Service):
    """Run until SIGTERM/SIGINT, then stop gracefully."""
    configure_logging(service.config.log_level)
    configure_tracing(f"pdd-{service.service_name}", service.config.otlp_endpoint)
    await service.start()
    await wait_for_termination()
    await service.stop()
