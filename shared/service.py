"""What every service process shares: NATS connection, heartbeats, cancels, graceful stop.

No zombies: a task a service cannot live without (its engine loop, heartbeat, KV event
publisher) that ends with an exception fails the service — it stops heart-beating (the
router then counts it dead and resumes its requests elsewhere) and its process exits
non-zero, for a supervisor to restart. A publish that fails (NATS reconnecting, outbound
buffer full, connection closed) is counted and logged, never fatal: the router repairs
what went missing.
"""

import asyncio
import gc
import secrets
import signal
import time

import msgspec
import nats
import structlog

from shared import nats_client, subjects
from shared.config import CommonConfig
from shared.dead_letters import BadMessageSink
from shared.lease import RequestLeases
from shared.lease_keeper import LeaseKeeper
from shared.logging import configure_logging
from shared.messages import CancelRequest, InstanceRef, LoadReported, decoder, encode
from shared.metrics import PUBLISH_FAILURES
from shared.ops_server import start_ops_server
from shared.tracing import configure_tracing

log = structlog.get_logger(__name__)
_cancel_decoder = decoder(CancelRequest)
_load_decoder = decoder(LoadReported)
STOP_TASKS_S = 5.0
"""How long ``stop`` waits for the service's own tasks to end once cancelled."""


class Service:
    """Base of the five services: one actor, one asyncio loop, one NATS connection."""

    service_name = "service"
    holds_requests = False
    """Engine services: they hold request state, kept only while its router's lease lives."""

    def __init__(self, config: CommonConfig):
        self.config = config
        self.instance_id = config.instance_id
        self.incarnation = secrets.token_hex(8)
        self.nc: nats.NATS | None = None
        self.bad_messages: BadMessageSink | None = None
        self._tasks: list[asyncio.Task] = []
        self._lease_keeper: LeaseKeeper | None = None
        self.failed = asyncio.Event()
        self.failure: str | None = None
        self.log = log.bind(service=self.service_name, instance=self.instance_id)
        self._ops = None
        self._started = False
        self.freeze_start_up_heap = False
        """Set by ``run_service`` for a service in its own process (see there)."""

    # --- to override -------------------------------------------------------------------

    async def on_start(self):
        """Subscribe and start serving (NATS is connected)."""

    async def on_stop(self):
        """Stop taking work and finish or hand back what is in flight."""

    async def on_cancel(self, cancel: CancelRequest):
        """Drop a request, if held here."""

    def load_report(self) -> LoadReported:
        """The heartbeat to publish."""
        return LoadReported(instance=self.instance_ref(), service=self.service_name, unix_s=time.time())

    def health(self) -> tuple[bool, dict]:
        """Healthy once started and until it fails. A lost NATS connection is reported but is not
        unhealthy: the client reconnects by itself, and a restart would drop what it holds."""
        connected = self.nc is not None and self.nc.is_connected
        healthy = self._started and self.failure is None
        return healthy, {
            "service": self.service_name,
            "instance": self.instance_id,
            "nats_connected": connected,
            **({"failure": self.failure} if self.failure else {}),
        }

    def instance_ref(self) -> InstanceRef:
        """How other instances reach this one."""
        return InstanceRef(instance_id=self.instance_id, site=self.config.site, incarnation=self.incarnation)

    async def held_request_ids(self) -> list[str]:
        """Requests (attempt ids) this instance holds any state for."""
        return []

    # --- lifecycle ---------------------------------------------------------------------

    async def start(self):
        """Connect to this site's NATS server and start serving."""
        self.nc = await nats_client.connect(
            self.config.nats_url,
            role=self.service_name,
            instance_id=self.instance_id,
            seed_file=self.config.nats_seed_file,
            ca_file=self.config.tls_ca_file,
            name=self.instance_id,
            max_reconnect_attempts=-1,
            reconnect_time_wait=0.5,
            connect_timeout=5,
        )
        self.bad_messages = BadMessageSink(self.nc, self.config.site, self.service_name, self.instance_id)
        await self.subscribe(subjects.CANCEL_ALL, _cancel_decoder, lambda cancel, _msg: self.on_cancel(cancel))
        if self.config.metrics_port:
            self._ops = await start_ops_server(
                self.config.metrics_host, self.config.metrics_port, self.health, self.config.metrics_key_sha256
            )
            self.log.info("metrics_listening", url=f"http://{self.config.metrics_host}:{self._ops.port}/metrics")
        await self.on_start()
        if self.freeze_start_up_heap:
            # Before the first heartbeat: the collection holds the interpreter (the loop and the
            # engine thread) for hundreds of ms, and announced, the instance would take work.
            gc.collect()  # start-up's own garbage first: frozen, it would never be freed
            gc.freeze()
        self._started = True
        self._tasks.append(asyncio.create_task(self._heartbeat(), name="heartbeat"))
        if self.holds_requests:
            leases = RequestLeases(
                self.config.request_lease_s,
                grace_s=2 * self.config.heartbeat_s + 0.5,
                cut_off_lease_s=self.config.cut_off_lease_s,
            )
            keeper = LeaseKeeper(leases, self.service_name, self.held_request_ids, self.on_cancel, self.log)
            self._lease_keeper = keeper
            await self.subscribe(subjects.LOAD_ALL, _load_decoder, keeper.on_heartbeat)
            self._tasks.append(asyncio.create_task(keeper.run(self.config.heartbeat_s), name="lease-reaper"))
        for task in self._tasks:
            self.watch(task)
        self.log.info("service_started", site=self.config.site)

    async def subscribe(self, subject: str, message_decoder, handler, queue: str = ""):
        """Call ``handler(message, msg)`` for each message on ``subject`` that decodes.

        A message that does not decode is counted, logged and dead-lettered, never passed on;
        one whose body names another sender than its subject proves is refused and counted.
        """

        async def callback(msg):
            message = self.bad_messages.decode(message_decoder, msg, subject)
            if message is not None:
                await handler(message, msg)

        return await self.nc.subscribe(subject, queue=queue, cb=callback)

    def watch(self, task: asyncio.Task):
        """Fail the service if ``task`` ends with an exception (cancelling it is fine)."""

        def done(finished: asyncio.Task):
            if not finished.cancelled() and finished.exception() is not None:
                exc = finished.exception()
                self.fail(f"task {finished.get_name()} died: {type(exc).__name__}: {exc}")

        task.add_done_callback(done)

    def fail(self, reason: str):
        """Stop serving for good: no more heartbeats, and ``run_service`` exits non-zero."""
        if self.failure is not None:
            return
        self.failure = reason
        self.log.error("service_failed", reason=reason)
        for task in self._tasks:
            if task.get_name() == "heartbeat":
                task.cancel()
        self.failed.set()

    async def stop(self):
        """Graceful stop: stop taking work, finish in-flight work, drain NATS."""
        self.log.info("service_stopping")
        left = await cancel_and_wait(self._tasks, STOP_TASKS_S)
        if left:
            self.log.warning("tasks_left_running", tasks=left)
        await self.on_stop()
        if self.nc and not self.nc.is_closed:
            try:
                await asyncio.wait_for(self.nc.drain(), 5)
            except (TimeoutError, nats.errors.Error):
                await self.nc.close()
        if self._ops is not None:
            await self._ops.stop()
        self.log.info("service_stopped")

    async def publish(self, subject: str, message, headers: dict | None = None) -> bool:
        """Publish a schema message; return False if it could not be (counted, logged, not raised)."""
        try:
            await self.nc.publish(subject, encode(message), headers=headers)
            return True
        except nats.errors.Error as exc:
            PUBLISH_FAILURES.labels(self.service_name, subject.split(".")[1]).inc()
            self.log.warning(
                "publish_failed", subject=subject, message=type(message).__name__, error=str(exc) or type(exc).__name__
            )
            return False

    async def _heartbeat(self):
        subject = subjects.load(self.config.site, self.service_name, self.instance_id)
        while True:
            report = self.load_report()
            if self._lease_keeper is not None:  # what it holds for each router (routers share it)
                report = msgspec.structs.replace(report, sequences_by_router=self._lease_keeper.held_by_router)
            await self.publish(subject, report)
            await asyncio.sleep(self.config.heartbeat_s)


async def cancel_and_wait(tasks: list[asyncio.Task], timeout_s: float) -> list[str]:
    """Cancel ``tasks`` and wait for them to end, cancelling again while any runs on (a cancel
    can be lost in a ``wait_for`` race on Python 3.11); return the names of those still
    running after ``timeout_s``."""
    pending = {task for task in tasks if not task.done()}
    deadline = time.monotonic() + timeout_s
    while pending and time.monotonic() < deadline:
        for task in pending:
            task.cancel()
        _, pending = await asyncio.wait(pending, timeout=min(0.5, max(0.0, deadline - time.monotonic())))
    return sorted(task.get_name() for task in pending)


async def wait_for_termination(failed: asyncio.Event | None = None):
    """Return at the first SIGTERM or SIGINT, or as soon as ``failed`` is set."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    waits = [asyncio.ensure_future(event.wait()) for event in (stop, failed) if event is not None]
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for waiting in waits:
            waiting.cancel()


async def run_service(service: Service, freeze_start_up_heap: bool = False) -> int:
    """Run until SIGTERM/SIGINT or a failure, then stop; return the process exit code.

    ``freeze_start_up_heap`` (a service's own process): once started, and before its first
    heartbeat announces it, what start-up made (imports, the model's metadata and tokenizer,
    the engine) leaves the garbage collector's sight (``gc.freeze``), so a full collection
    scans only what the service made since. Measured under ``pdd bench control-plane``: full
    collections of ~210k start-up objects paused main decoders 235-350 ms and the prefill
    300 ms mid-load, each a stall of every stream there; with the heap frozen the main
    decoders' took 2-10 ms, the prefill's 23-69 ms. The collection before the freeze takes as
    long, so it runs before the first heartbeat: no request is placed on the instance while it
    holds the interpreter.
    """
    configure_logging(service.config.log_level)
    configure_tracing(f"pdd-{service.service_name}", service.config.otlp_endpoint, instance_id=service.instance_id)
    service.freeze_start_up_heap = freeze_start_up_heap
    await service.start()
    await wait_for_termination(service.failed)
    await service.stop()
    return 1 if service.failure is not None else 0
