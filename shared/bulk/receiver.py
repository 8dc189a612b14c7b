"""Bulk receiver: accepts authenticated KV flows and hands their frames to a FlowHandler."""

import asyncio
import collections
import socket
import ssl
import time
from dataclasses import dataclass, field
from typing import Protocol

import structlog

from shared.bulk.auth import FlowAuthenticator
from shared.bulk.connection import BulkConnection
from shared.errors import KvFrameError, PddError
from shared.kv_wire import FrameExpectation, KvFrame
from shared.messages import FlowAccepted, FlowCancel, FlowEnd, FlowOpen, FlowRejected
from shared.metrics import KV_BYTES

log = structlog.get_logger(__name__)
AUTH_TIMEOUT_S = 5.0
"""A peer must authenticate (TLS handshake, then a valid FlowOpen) within this."""
MAX_PREAUTH_CONTROL_BYTES = 64 << 10
"""Largest message read from a peer that has not authenticated yet (a FlowOpen with ~20K tokens)."""
MAX_UNAUTHENTICATED = 32
"""Connections still authenticating (TLS handshake included) at once; more are closed on
arrival, before any handshake."""
MAX_FLOWS_PER_SENDER = 128
"""Open flows one authenticated sender may hold at once (a prefill ships each request once per
receiver, so this is far above an honest sender's need); more are refused (``too_many_flows``)."""
LISTEN_BACKLOG = 128
ACCEPT_RETRY_S = 0.5
"""Pause after a failed accept (out of file descriptors) before accepting again."""


@dataclass
class FlowStats:
    """What one flow delivered.

    Attributes:
        bytes_received: Bytes of frames and control messages after the FlowOpen.
        frames: KV frames imported.
        opened_monotonic: When the FlowOpen arrived.
        first_frame_monotonic: When the first KV frame was complete.
        first_frame_bytes: Size of that frame.
        finished_monotonic: When the FlowEnd arrived.
    """

    bytes_received: int = 0
    frames: int = 0
    opened_monotonic: float = field(default_factory=time.monotonic)
    first_frame_monotonic: float = 0.0
    first_frame_bytes: int = 0
    finished_monotonic: float = 0.0

    @property
    def transfer_s(self) -> float:
        """Seconds from FlowOpen to FlowEnd (includes the sender's compute)."""
        return max(0.0, self.finished_monotonic - self.opened_monotonic)

    @property
    def streaming_bytes_per_s(self) -> float | None:
        """Link throughput seen between the first and the last frame (None: too few frames)."""
        elapsed = self.finished_monotonic - self.first_frame_monotonic
        if self.frames < 2 or elapsed <= 0:
            return None
        return (self.bytes_received - self.first_frame_bytes) / elapsed


class FlowHandler(Protocol):
    """What a receiving service does with a flow (relay decode, main decode)."""

    async def open_flow(self, flow_open: FlowOpen, stats: FlowStats) -> int:
        """Prepare the import; return the first token index to receive. Raise PddError to refuse.

        ``stats`` is the flow's live counter (bytes and frames received so far).
        """

    async def import_frame(self, request_id: str, frame: KvFrame) -> None:
        """Store one validated frame."""

    async def end_flow(self, request_id: str, end: FlowEnd, stats: FlowStats) -> None:
        """All frames arrived; ``end`` carries the output tokens to start from."""

    async def abort_flow(self, request_id: str, reason: str) -> None:
        """The flow broke or was cancelled: discard what arrived."""


class BulkReceiver:
    """TCP server for one receiving instance; one flow per connection, each with its own I/O
    thread (``BulkConnection``) that reads every frame into one buffer, one frame ahead of the
    frame being checked (on a check thread, in place) and imported."""

    def __init__(
        self,
        handler: FlowHandler,
        expectation: FrameExpectation,
        verify_key: str,
        *,
        path: str,
        frame_timeout_s: float,
        host: str = "127.0.0.1",
        port: int = 0,
        receiver_id: str = "",
        incarnation: str = "",
        tls: ssl.SSLContext | None = None,
        max_flows_per_sender: int = MAX_FLOWS_PER_SENDER,
    ):
        self._handler = handler
        self._expect = expectation
        self._auth = FlowAuthenticator(verify_key, receiver_id, incarnation)
        self._tls = tls
        self._unauthenticated = 0
        self._max_flows_per_sender = max_flows_per_sender
        self._flows_by_sender: collections.Counter[str] = collections.Counter()
        self._path = path
        self._frame_timeout_s = frame_timeout_s
        self._host, self._port = host, port
        self._listener: socket.socket | None = None
        self._accepting: asyncio.Task | None = None
        self._connections: set[asyncio.Task] = set()

    async def start(self) -> tuple[str, int]:
        """Listen (on the first address ``host`` resolves to); return the bound (host, port)."""
        loop = asyncio.get_running_loop()
        family, kind, proto, _, address = (
            await loop.getaddrinfo(self._host, self._port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        )[0]
        listener = socket.socket(family, kind, proto)
        try:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind(address)
            listener.listen(LISTEN_BACKLOG)
            listener.setblocking(False)
        except BaseException:
            listener.close()
            raise
        self._listener = listener
        self._host, self._port = listener.getsockname()[:2]
        self._accepting = asyncio.create_task(self._accept_loop(listener))
        return self._host, self._port

    async def stop(self):
        """Stop listening and drop open flows (their handlers abort them)."""
        if self._accepting is not None:
            self._accepting.cancel()
            await asyncio.gather(self._accepting, return_exceptions=True)
        if self._listener is not None:
            self._listener.close()
        for task in list(self._connections):
            task.cancel()
        await asyncio.gather(*self._connections, return_exceptions=True)

    async def _accept_loop(self, listener: socket.socket):
        loop = asyncio.get_running_loop()
        while True:
            try:
                sock, _ = await loop.sock_accept(listener)
            except OSError as exc:  # out of descriptors, say: let connections end, then accept again
                log.warning("bulk_accept_failed", path=self._path, error=str(exc))
                await asyncio.sleep(ACCEPT_RETRY_S)
                continue
            if self._unauthenticated >= MAX_UNAUTHENTICATED:
                log.warning("bulk_connection_refused", path=self._path, reason="too many unauthenticated peers")
                sock.close()
                continue
            self._unauthenticated += 1  # until _serve has authenticated it (or given up)
            connection = BulkConnection(sock, self._stall_timeout_s, name=f"bulk-recv-{self._path}")
            task = asyncio.create_task(self._serve(connection))
            self._connections.add(task)
            task.add_done_callback(self._connections.discard)
            task.add_done_callback(lambda _, connection=connection: connection.close())  # even if never started

    @property
    def _stall_timeout_s(self) -> float:
        """The connections' socket timeout: never shorter than a wait the receiver allows."""
        return max(AUTH_TIMEOUT_S, self._frame_timeout_s)

    async def _serve(self, connection: BulkConnection):
        try:
            stats = FlowStats()
            try:
                flow_open = await self._authenticate(connection)
            finally:
                self._unauthenticated -= 1
            if flow_open is not None and await self._bounded(flow_open, connection):
                self._flows_by_sender[flow_open.sender_id] += 1
                try:
                    if await self._admit(flow_open, connection, stats):
                        await self._receive(flow_open, connection, stats)
                finally:
                    self._flows_by_sender[flow_open.sender_id] -= 1
        except (OSError, KvFrameError) as exc:  # timeouts, resets, failed TLS handshakes, bad bytes
            log.warning("bulk_connection_dropped", path=self._path, error=str(exc) or type(exc).__name__)
        finally:
            connection.close()

    async def _authenticate(self, connection: BulkConnection) -> FlowOpen | None:
        """The peer's FlowOpen if it is authentic, fresh and for this receiver, else None; the
        TLS handshake and the FlowOpen must both be done within ``AUTH_TIMEOUT_S``."""
        async with asyncio.timeout(AUTH_TIMEOUT_S):
            if self._tls is not None:
                await connection.start_tls(self._tls, server_side=True)
            message, _ = await connection.read_message(None, MAX_PREAUTH_CONTROL_BYTES)
        if not isinstance(message, FlowOpen):
            log.warning("bulk_flow_refused", path=self._path, reason="first message is not FlowOpen")
            return None
        problem = self._auth.verify(message)
        if problem is None:
            return message
        log.warning("bulk_flow_refused", path=self._path, request_id=message.request_id, reason=problem)
        await connection.send_control(
            FlowRejected(request_id=message.request_id, code="unauthenticated", message=problem), AUTH_TIMEOUT_S
        )
        return None

    async def _bounded(self, flow_open: FlowOpen, connection: BulkConnection) -> bool:
        """Whether the sender may open one more flow now; refuse it otherwise."""
        if self._flows_by_sender[flow_open.sender_id] < self._max_flows_per_sender:
            return True
        log.warning(
            "bulk_flow_refused",
            path=self._path,
            request_id=flow_open.request_id,
            reason="too many flows from this sender",
            sender=flow_open.sender_id,
        )
        await connection.send_control(
            FlowRejected(
                request_id=flow_open.request_id,
                code="too_many_flows",
                message=f"{self._max_flows_per_sender} flows from {flow_open.sender_id!r} are open already",
            ),
            AUTH_TIMEOUT_S,
        )
        return False

    async def _admit(self, flow_open: FlowOpen, connection: BulkConnection, stats: FlowStats) -> bool:
        """Ask the handler (which may wait for blocks in flight); answer the sender."""
        received = time.monotonic()
        try:
            first_index = await self._handler.open_flow(flow_open, stats)
        except PddError as exc:
            await connection.send_control(
                FlowRejected(request_id=flow_open.request_id, code=exc.code, message=str(exc)), self._frame_timeout_s
            )
            return False
        try:
            await connection.send_control(
                FlowAccepted(
                    request_id=flow_open.request_id, first_token_index=first_index, queued_s=time.monotonic() - received
                ),
                self._frame_timeout_s,
            )
        except OSError as exc:
            # The sender left while we waited for room (it was cancelled): free what we reserved.
            await self._handler.abort_flow(flow_open.request_id, f"sender gone before acceptance: {exc}")
            return False
        return True

    async def _receive(self, flow_open: FlowOpen, connection: BulkConnection, stats: FlowStats):
        """Import the flow's frames in order until its FlowEnd (or abort it).

        One read ahead: once frame N is read, the read of the next message is queued before
        frame N is checked (on a check thread) and imported, so the socket keeps draining
        meanwhile. At most one frame beyond the one being handled is held, and nothing is read
        past a FlowEnd or FlowCancel (only a frame starts a read ahead). The next message's
        ``frame_timeout_s`` counts from when the receiver is ready for it, as without the read
        ahead; the socket's stall timeout (no byte at all for as long) bounds the read itself.
        """
        request_id, reason = flow_open.request_id, "connection closed"
        pending: asyncio.Future | None = None
        try:
            pending = connection.start_read(self._expect)
            while True:
                async with asyncio.timeout(self._frame_timeout_s):
                    message, size = await asyncio.shield(pending)
                if isinstance(message, memoryview):  # a KV frame, read but not yet checked
                    pending = connection.start_read(self._expect)
                    message = await connection.check_frame(message, self._expect, self._frame_timeout_s)
                stats.bytes_received += size
                KV_BYTES.labels(self._path, "received").inc(size)
                if isinstance(message, KvFrame):
                    if message.header.request_id != request_id:
                        reason = f"frame of request {message.header.request_id!r} on this flow"
                        break
                    await self._handler.import_frame(request_id, message)
                    stats.frames += 1
                    if stats.frames == 1:
                        stats.first_frame_monotonic, stats.first_frame_bytes = time.monotonic(), size
                elif isinstance(message, FlowEnd):
                    stats.finished_monotonic = time.monotonic()
                    await self._handler.end_flow(request_id, message, stats)
                    return
                elif isinstance(message, FlowCancel):
                    reason = f"cancelled by sender: {message.reason}"
                    break
                else:
                    if message is not None:
                        reason = f"unexpected {type(message).__name__}"
                    break
        except TimeoutError:
            reason = f"no data for {self._frame_timeout_s:.0f} s"
        except asyncio.CancelledError:
            reason = "receiver stopping"
            await self._handler.abort_flow(request_id, reason)
            raise
        except PddError as exc:
            reason = f"{exc.code}: {exc}"
        except (ConnectionError, OSError) as exc:
            reason = f"connection lost: {exc}"
        finally:
            if pending is not None:
                pending.cancel()  # a read ahead still running: the connection closes next, which ends it
        await self._handler.abort_flow(request_id, reason)
