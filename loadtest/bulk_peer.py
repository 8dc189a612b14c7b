"""The receiving end of ``pdd bench bulk``'s loopback runs, in a process of its own.

A deployment's sender (prefill) and receiver (main decode, relay) are separate processes, each
with its own interpreter lock and event loop. Measured in one process, each side's Python
(the sender's event loop, the receiver's hand-offs and checks) waits on the other's; so both
the raw pump and our channel are measured with their receiving side here, in a child process,
and the sending side in the caller's.

``ReceivingPeer`` starts the child and drives it over a pipe, one measurement at a time: the
child opens a listener (a ``BulkReceiver`` for our channel, a plain socket for the pump), sends
its port, receives, and sends back when the last byte landed. Times on both sides are
``CLOCK_MONOTONIC`` (``raw_pump.now_s``), which every process of the machine shares.
"""

import asyncio
import multiprocessing
import socket
import ssl
from dataclasses import dataclass
from typing import Self

from infra.credentials import Credentials
from loadtest.raw_pump import PUMP_TIMEOUT_S, now_s, pump_sink, receive_pump
from shared.bulk.auth import verify_key
from shared.bulk.receiver import BulkReceiver
from shared.kv_wire import FrameExpectation
from shared.tls import server_context

RECEIVER_NAME = "main-decode"
"""Whose certificate the receiving side presents (the bench's flows go to main decode)."""


@dataclass(frozen=True)
class PeerSetup:
    """What the child needs: the frames it accepts, the flows' secret, the deployment's
    credentials (its TLS server context is built from them) and how long any one run may take."""

    expectation: FrameExpectation
    secret: str
    credentials: Credentials
    timeout_s: float


class Discard:
    """Receives a flow's frames (already validated by the receiver) and keeps none."""

    def __init__(self):
        self.done = asyncio.Event()
        self.aborted = ""

    async def open_flow(self, flow_open, stats):
        return 0

    async def import_frame(self, request_id, frame):
        pass

    async def end_flow(self, request_id, end, stats):
        self.done.set()

    async def abort_flow(self, request_id, reason):
        self.aborted = reason
        self.done.set()


class ReceivingPeer:
    """The child process and the pipe to it; use as a context manager."""

    def __init__(self, setup: PeerSetup):
        self._setup = setup
        context = multiprocessing.get_context("spawn")  # no copy of the caller's threads or loop
        self._pipe, child_end = context.Pipe()
        self._process = context.Process(target=_serve, args=(child_end, setup), name="bulk-bench-peer", daemon=True)

    def __enter__(self) -> Self:
        self._process.start()
        return self

    def __exit__(self, exc_type, *_):
        """Stop the child: at once after a failure (it may be waiting out a run that will not
        come), else once it has read ``stop``, within the setup's ``timeout_s``."""
        if exc_type is None:
            try:
                self._pipe.send(("stop",))
            except OSError:
                pass
            self._process.join(self._setup.timeout_s)
        if self._process.is_alive():
            self._process.kill()
            self._process.join()
        self._pipe.close()

    def listen(self, kind: str, tls: bool, nbytes: int = 0) -> int:
        """Have the child listen for one run (``ours``: a ``BulkReceiver``; ``pump``: a socket
        taking ``nbytes``), TLS or not; returns its port on 127.0.0.1."""
        self._pipe.send((kind, tls, nbytes))
        return self._reply()

    def finished_s(self) -> float:
        """When the child's run received its last byte (``now_s``).

        Raises:
            RuntimeError: the run failed in the child.
            TimeoutError: no answer within the setup's ``timeout_s``.
        """
        return self._reply()

    def _reply(self):
        if not self._pipe.poll(self._setup.timeout_s):
            raise TimeoutError(f"the bench's receiving process did not answer in {self._setup.timeout_s:.0f} s")
        status, value = self._pipe.recv()
        if status != "ok":
            raise RuntimeError(f"the bench's receiving process failed: {value}")
        return value


def _serve(pipe, setup: PeerSetup):
    """The child: one run per command until ``stop``."""
    creds = setup.credentials
    tls = server_context(str(creds.ca_file), str(creds.cert_file(RECEIVER_NAME)), str(creds.key_file(RECEIVER_NAME)))
    sink = pump_sink()
    while (command := pipe.recv())[0] != "stop":
        kind, use_tls, nbytes = command
        context = tls if use_tls else None
        try:
            if kind == "ours":
                asyncio.run(_receive_flow(pipe, setup, context))
            else:
                _receive_pump(pipe, context, nbytes, sink, setup.timeout_s)
        except Exception as exc:  # noqa: BLE001 - reported to the measuring side, which raises it
            pipe.send(("failed", f"{type(exc).__name__}: {exc}"))


async def _receive_flow(pipe, setup: PeerSetup, tls: ssl.SSLContext | None):
    handler = Discard()
    receiver = BulkReceiver(
        handler,
        setup.expectation,
        verify_key(setup.secret),
        path="wan",
        frame_timeout_s=setup.timeout_s,
        receiver_id="bench",
        tls=tls,
    )
    _, port = await receiver.start()
    try:
        pipe.send(("ok", port))
        await asyncio.wait_for(handler.done.wait(), setup.timeout_s)
        finished = now_s()
    finally:
        await receiver.stop()
    if handler.aborted:
        raise RuntimeError(f"the flow was aborted: {handler.aborted}")
    pipe.send(("ok", finished))


def _receive_pump(pipe, tls: ssl.SSLContext | None, nbytes: int, sink: memoryview, timeout_s: float):
    with socket.create_server(("127.0.0.1", 0)) as listener:
        listener.settimeout(timeout_s)
        pipe.send(("ok", listener.getsockname()[1]))
        connection, _ = listener.accept()
    connection.settimeout(PUMP_TIMEOUT_S)
    if tls is not None:
        connection = tls.wrap_socket(connection, server_side=True)
    with connection:
        finished = receive_pump(connection, nbytes, sink)
    pipe.send(("ok", finished))
