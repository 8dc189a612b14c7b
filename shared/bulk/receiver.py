"""Bulk receiver: accepts authenticated KV flows and hands their frames to a FlowHandler, in
the flow's order whichever of the flow's connections (streams) each frame came on."""

import asyncio
import collections
import socket
import ssl
import time
from typing import Protocol

import structlog

from shared.bulk.auth import FlowAuthenticator
from shared.bulk.connection import BulkConnection
from shared.bulk.flow_stats import FlowStats
from shared.bulk.path_sizing import MAX_STREAMS
from shared.bulk.striped_flow import StreamBroken, StripedFlow
from shared.errors import KvFrameError, PddError
from shared.kv_wire import FrameExpectation, KvFrame
from shared.messages import (
    BulkControl,
    FlowAccepted,
    FlowCancel,
    FlowEnd,
    FlowJoin,
    FlowOpen,
    FlowRejected,
    StreamEnd,
)
from shared.metrics import KV_BYTES

__all__ = ["BulkReceiver", "FlowHandler", "FlowStats"]

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
IDLE_TIMEOUT_S = 60.0
"""Longest an authenticated connection waits idle between two flows (a sender's pool keeps it
for ``pool.POOL_IDLE_S``, less); the socket's stall timeout bounds it too."""
MAX_IDLE_CONNECTIONS = 256
"""Idle connections kept at once, all senders together; one more is closed as its flow ends."""
LISTEN_BACKLOG = 128
ACCEPT_RETRY_S = 0.5
"""Pause after a failed accept (out of file descriptors) before accepting again."""


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
    """TCP server for one receiving instance. Each connection has its own I/O thread
    (``BulkConnection``, so TLS and the kernel's copies of several connections run on several
    cores) that reads every frame into one buffer, one frame ahead of the frame being checked
    (on a check thread, in place) and imported.

    A connection opens with a signed FlowOpen (it leads a new flow) or a signed FlowJoin (it
    becomes one more stream of a flow already accepted, ``striped_flow``); once its part of a
    flow ended cleanly it waits, idle, for the next opening (a sender's pool reuses it), and
    each opening is authenticated again."""

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
        site: str = "",
        tls: ssl.SSLContext | None = None,
        max_flows_per_sender: int = MAX_FLOWS_PER_SENDER,
    ):
        self._handler = handler
        self._expect = expectation
        self._auth = FlowAuthenticator(verify_key, receiver_id, incarnation)
        self._tls = tls
        self._unauthenticated = 0
        self._idle = 0
        self._max_flows_per_sender = max_flows_per_sender
        self._flows_by_sender: collections.Counter[str] = collections.Counter()
        self._flows: dict[str, StripedFlow] = {}
        """Accepted flows by their FlowOpen's nonce (what a FlowJoin names)."""
        self._path, self._site = path, site
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

    @property
    def num_connections(self) -> int:
        """Connections open now (authenticating, in a flow or idle)."""
        return len(self._connections)

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
        """One connection: its first opening, then one flow (or stream of a flow) after another."""
        try:
            try:
                opening = await self._authenticate(connection)
            finally:
                self._unauthenticated -= 1
            while opening is not None and await self._run(opening, connection):
                opening = await self._next_opening(connection)
        except (OSError, KvFrameError) as exc:  # timeouts, resets, failed TLS handshakes, bad bytes
            log.warning("bulk_connection_dropped", path=self._path, error=str(exc) or type(exc).__name__)
        finally:
            connection.close()

    async def _authenticate(self, connection: BulkConnection) -> FlowOpen | FlowJoin | None:
        """The peer's first opening if it is authentic, fresh and for this receiver, else None;
        the TLS handshake and the opening must both be done within ``AUTH_TIMEOUT_S``."""
        async with asyncio.timeout(AUTH_TIMEOUT_S):
            if self._tls is not None:
                await connection.start_tls(self._tls, server_side=True)
            message, _ = await connection.read_message(None, MAX_PREAUTH_CONTROL_BYTES)
        return await self._verified(message, connection)

    async def _next_opening(self, connection: BulkConnection) -> FlowOpen | FlowJoin | None:
        """The next opening on a connection whose flow ended cleanly, or None: closed by the
        peer, idle for ``IDLE_TIMEOUT_S``, or ``MAX_IDLE_CONNECTIONS`` idle already."""
        if self._idle >= MAX_IDLE_CONNECTIONS:
            return None
        self._idle += 1
        try:
            async with asyncio.timeout(IDLE_TIMEOUT_S):
                message, _ = await connection.read_message(None, MAX_PREAUTH_CONTROL_BYTES)
        except TimeoutError:
            return None
        finally:
            self._idle -= 1
        return None if message is None else await self._verified(message, connection)

    async def _verified(self, message: BulkControl | None, connection: BulkConnection) -> FlowOpen | FlowJoin | None:
        """``message`` if it is a signed opening for this receiver, fresh and unseen, else None
        (a refused FlowOpen is answered; a refused FlowJoin only closed)."""
        if not isinstance(message, FlowOpen | FlowJoin):
            log.warning("bulk_flow_refused", path=self._path, reason="first message is not FlowOpen")
            return None
        problem = self._auth.verify(message)
        if problem is None:
            return message
        log.warning("bulk_flow_refused", path=self._path, request_id=message.request_id, reason=problem)
        if isinstance(message, FlowOpen):
            await connection.send_control(
                FlowRejected(request_id=message.request_id, code="unauthenticated", message=problem), AUTH_TIMEOUT_S
            )
        return None

    async def _run(self, opening: FlowOpen | FlowJoin, connection: BulkConnection) -> bool:
        """Serve one opening; whether the connection ended it cleanly (and may serve another)."""
        if isinstance(opening, FlowJoin):
            return await self._serve_join(opening, connection)
        if not await self._bounded(opening, connection):
            return False
        self._flows_by_sender[opening.sender_id] += 1
        try:
            flow = await self._admit(opening, connection)
            if flow is None:
                return False
            try:
                return await self._receive(flow, connection)
            finally:
                del self._flows[opening.nonce]
        finally:
            self._flows_by_sender[opening.sender_id] -= 1

    async def _bounded(self, flow_open: FlowOpen, connection: BulkConnection) -> bool:
        """Whether the sender may open one more flow now, over a stream count within
        ``MAX_STREAMS``; refuse it otherwise."""
        if not 1 <= flow_open.streams <= MAX_STREAMS:
            code, message = "bad_streams", f"streams must be within 1..{MAX_STREAMS}, got {flow_open.streams}"
        elif self._flows_by_sender[flow_open.sender_id] < self._max_flows_per_sender:
            return True
        else:
            code = "too_many_flows"
            message = f"{self._max_flows_per_sender} flows from {flow_open.sender_id!r} are open already"
        log.warning(
            "bulk_flow_refused",
            path=self._path,
            request_id=flow_open.request_id,
            reason=code,
            sender=flow_open.sender_id,
        )
        await connection.send_control(
            FlowRejected(request_id=flow_open.request_id, code=code, message=message), AUTH_TIMEOUT_S
        )
        return False

    async def _admit(self, flow_open: FlowOpen, connection: BulkConnection) -> StripedFlow | None:
        """Ask the handler (which may wait for blocks in flight); register the flow (so its
        streams can join), then answer the sender. None: refused, or the sender left."""
        received, stats = time.monotonic(), FlowStats()
        try:
            first_index = await self._handler.open_flow(flow_open, stats)
        except PddError as exc:
            await connection.send_control(
                FlowRejected(request_id=flow_open.request_id, code=exc.code, message=str(exc)), self._frame_timeout_s
            )
            return None
        flow = self._flows[flow_open.nonce] = StripedFlow(flow_open, connection, first_index, stats)
        try:
            await connection.send_control(
                FlowAccepted(
                    request_id=flow_open.request_id, first_token_index=first_index, queued_s=time.monotonic() - received
                ),
                self._frame_timeout_s,
            )
        except OSError as exc:
            # The sender left while we waited for room (it was cancelled): free what we reserved.
            del self._flows[flow_open.nonce]
            await self._handler.abort_flow(flow_open.request_id, f"sender gone before acceptance: {exc}")
            return None
        except asyncio.CancelledError:  # stopped while the acceptance went out: free it too
            del self._flows[flow_open.nonce]
            await self._handler.abort_flow(flow_open.request_id, flow.fail("receiver stopping"))
            raise
        return flow

    async def _receive(self, flow: StripedFlow, connection: BulkConnection) -> bool:
        """The lead stream: import its frames in the flow's order until its FlowEnd, then, once
        every stream ended, end the flow (True); or abort it (False)."""
        request_id = flow.request_id
        try:
            message = await self._stream_frames(flow, connection)
            if isinstance(message, FlowEnd):
                flow.stream_done(0)
                await flow.all_streams_done(self._frame_timeout_s)
                flow.stats.finished_monotonic = time.monotonic()
                await self._handler.end_flow(request_id, message, flow.stats)
                return True
            if isinstance(message, FlowCancel):
                reason = f"cancelled by sender: {message.reason}"
            else:
                reason = "connection closed" if message is None else f"unexpected {type(message).__name__}"
        except asyncio.CancelledError:
            await self._handler.abort_flow(request_id, flow.fail("receiver stopping"))
            raise
        except (StreamBroken, TimeoutError, PddError, OSError) as exc:
            reason = _stream_end_reason(exc, self._frame_timeout_s)
        await self._handler.abort_flow(request_id, flow.fail(reason))
        return False

    async def _serve_join(self, join: FlowJoin, connection: BulkConnection) -> bool:
        """A further stream of an accepted flow: import its frames in the flow's order until its
        StreamEnd (True); anything else fails the whole flow (False)."""
        flow = self._flows.get(join.flow_nonce)
        if flow is None or flow.request_id != join.request_id or flow.flow_open.sender_id != join.sender_id:
            problem = "no open flow of this sender and request has that nonce"
        else:
            problem = flow.join(join.stream, connection)
        if problem is not None:
            log.warning("bulk_stream_refused", path=self._path, request_id=join.request_id, reason=problem)
            return False
        try:
            accepted = FlowAccepted(request_id=join.request_id, first_token_index=flow.first_token_index)
            await connection.send_control(accepted, self._frame_timeout_s)
            message = await self._stream_frames(flow, connection)
            if isinstance(message, StreamEnd):
                flow.stream_done(join.stream)
                return True
            reason = "closed before its StreamEnd" if message is None else f"unexpected {type(message).__name__}"
        except asyncio.CancelledError:
            flow.fail("receiver stopping")
            raise
        except (StreamBroken, TimeoutError, PddError, OSError) as exc:
            reason = _stream_end_reason(exc, self._frame_timeout_s)
        flow.fail(f"stream {join.stream}: {reason}")
        return False

    async def _stream_frames(self, flow: StripedFlow, connection: BulkConnection) -> BulkControl | None:
        """Import one stream's frames, each in its turn, until a control message (returned; None
        at the end of the stream).

        One read ahead: once frame N is read, the read of the next message is queued before
        frame N is checked (on a check thread), waits for its turn and is imported, so the
        socket keeps draining meanwhile. At most one frame beyond the one being handled is
        held, and nothing is read past a control message (only a frame starts a read ahead),
        so a connection whose part ended cleanly holds nothing unread. The next message's
        ``frame_timeout_s`` counts from when the stream is ready for it; the socket's stall
        timeout (no byte at all for as long) bounds the read itself.

        Raises:
            StreamBroken, TimeoutError, KvFrameError, PddError, OSError: the stream broke.
        """
        received = KV_BYTES.labels(_network(self._path, self._site, flow.flow_open), "received")
        pending: asyncio.Future | None = connection.start_read(self._expect)
        try:
            while True:
                async with asyncio.timeout(self._frame_timeout_s):
                    message, size = await asyncio.shield(pending)
                pending = None
                if isinstance(message, memoryview):  # a KV frame, read but not yet checked
                    pending = connection.start_read(self._expect)
                    message = await connection.check_frame(message, self._expect, self._frame_timeout_s)
                flow.stats.bytes_received += size
                received.inc(size)
                if not isinstance(message, KvFrame):
                    return message
                if message.header.request_id != flow.request_id:
                    raise StreamBroken(f"frame of request {message.header.request_id!r} on this flow")
                await flow.turn(message.header, self._frame_timeout_s)
                await self._handler.import_frame(flow.request_id, message)
                flow.imported(message.header, size)
        finally:
            if pending is not None:
                pending.cancel()  # a read ahead still running: the connection closes next, which ends it


def _stream_end_reason(exc: BaseException, frame_timeout_s: float) -> str:
    """Why a stream ended, for the flow's abort."""
    if isinstance(exc, StreamBroken):
        return str(exc)
    if isinstance(exc, TimeoutError):
        return f"no data for {frame_timeout_s:.0f} s"
    if isinstance(exc, PddError):
        return f"{exc.code}: {exc}"
    return f"connection lost: {exc}"


def _network(path: str, site: str, flow_open: FlowOpen) -> str:
    """The network a flow's bytes came over, as ``pdd_kv_bytes_total`` counts them: ``wan``
    from a sender at another site than the receiver's, ``local`` from its own site, the
    listener's ``path`` when either site is unknown."""
    if not (site and flow_open.sender_site):
        return path
    return "wan" if flow_open.sender_site != site else "local"
