"""Bulk sender: opens an authenticated per-request flow and streams KV frames with back-pressure,
striped over one or more connections (``path_sizing`` says how many), pooled per peer."""

import asyncio
import collections
import functools
import ssl
import time
from collections.abc import Awaitable, Callable

import msgspec

from shared.bulk.auth import new_nonce, sign
from shared.bulk.connection import BulkConnection, dial
from shared.bulk.link_route import route_key, sign_route
from shared.bulk.link_turns import PIECE_BYTES, LinkTurns, pieces
from shared.bulk.path_sizing import MAX_STREAMS
from shared.bulk.pool import BulkPool
from shared.errors import PddError
from shared.messages import BulkControl, FlowAccepted, FlowCancel, FlowEnd, FlowJoin, FlowOpen, FlowRejected, StreamEnd
from shared.metrics import KV_BYTES


class FlowRefused(PddError):
    """The receiver refused the flow (authentication, capacity, unknown request…)."""

    code = "bulk_flow_refused"


SEND_STALL_TIMEOUT_S = 120.0
"""Longest a send waits without progress (the receiver stopped reading) before it fails."""
CANCEL_TIMEOUT_S = 1.0
"""Longest a cancelled flow waits to tell the receiver before it just closes."""


class BulkFlow:
    """One request's KV flow to one receiver, its frames striped over one or more connections
    (``streams``): frame k goes on connection ``k mod streams``, so each connection carries
    its frames in the flow's order and the receiver puts the connections' frames back in order.
    The first connection (the lead) carried the FlowOpen and carries the FlowEnd or FlowCancel."""

    def __init__(
        self,
        request_id: str,
        path: str,
        connection: BulkConnection | list[BulkConnection],
        first_token_index: int,
        handshake_s: float = 0.0,
        release: Callable[[list[BulkConnection]], None] | None = None,
        turns: LinkTurns | None = None,
    ):
        """``release`` takes the connections back once the flow ended cleanly (a pool keeps
        them); without it they are closed. ``turns``: the link's flows of this process, which
        send shortest-remaining-first (``shared/bulk/link_turns.py``)."""
        self.request_id = request_id
        self.handshake_s = handshake_s
        self.path = path
        self.first_token_index = first_token_index
        self.bytes_sent = 0
        self._streams = connection if isinstance(connection, list) else [connection]
        self._release = release
        self._in_flight: collections.deque[asyncio.Task] = collections.deque()
        self._frames_sent = 0
        self._opened = time.monotonic()
        self._turns = turns
        self._on_link = turns.open() if turns is not None else None
        self._pieced_frames: set[asyncio.Future] = set()

    @property
    def _connection(self) -> BulkConnection:
        """The lead connection."""
        return self._streams[0]

    @property
    def streams(self) -> int:
        """Connections the flow's frames are striped over."""
        return len(self._streams)

    @property
    def elapsed_s(self) -> float:
        """Seconds since the flow was accepted."""
        return time.monotonic() - self._opened

    @property
    def tls_cipher(self) -> str | None:
        """The TLS cipher suite of the connection (None: plaintext)."""
        return self._connection.cipher

    async def send_frame(self, parts: list[bytes | memoryview], tokens_left: int | None = None):
        """Write one frame from its buffers as they are (no copy) on the flow's next connection
        (on a link's turns: in pieces, each when its turn comes, ``tokens_left`` saying how
        much of the prompt's KV is still to send from this frame on; the flow keeps its place
        until ``pause_turns``); returns once at most ``streams - 1`` frames are still on their
        way to the kernel (one
        stream: once the kernel holds all of this one), so a receiver that stops reading stalls
        the sender within the sockets' buffers. The buffers must stay unchanged until then (if
        this is cancelled: until the flow is closed). A frame whose sender is cancelled still
        goes out whole before a FlowCancel, unless the receiver does not take it within
        ``CANCEL_TIMEOUT_S``: the connection then closes mid-frame and the receiver drops the
        flow as truncated.

        Raises:
            ConnectionError, OSError: a connection broke, or no byte left for the connection's
                stall timeout (``TimeoutError``).
            ValueError: the flow takes turns and ``tokens_left`` is not given.
        """
        if self._turns is not None:
            if tokens_left is None:
                raise ValueError("a flow that takes turns on its link needs each frame's tokens_left")
            self._turns.hold(self._on_link, tokens_left)
        try:
            await self._send_frame(parts)
        except BaseException:  # a flow that failed or was given up holds no place on the link
            self.pause_turns()
            raise

    async def _send_frame(self, parts: list[bytes | memoryview]):
        stream = self._streams[self._frames_sent % len(self._streams)]
        self._frames_sent += 1
        if len(self._streams) == 1:  # nothing to overlap: the send itself, as before striping
            await self._send_on(stream, parts)
            return
        sending = asyncio.ensure_future(self._send_on(stream, parts))
        sending.add_done_callback(_retrieve_exception)
        self._in_flight.append(sending)
        while len(self._in_flight) >= len(self._streams):
            await asyncio.shield(self._in_flight[0])
            self._in_flight.popleft()

    async def _send_on(self, stream: BulkConnection, parts: list[bytes | memoryview]):
        if self._turns is None:
            self._count_sent(await stream.send(parts))
            return
        # the pieces go on if the caller is cancelled: the frame goes out whole
        frame = asyncio.ensure_future(self._send_pieces(stream, parts))
        frame.add_done_callback(_retrieve_exception)
        self._pieced_frames.add(frame)
        frame.add_done_callback(self._pieced_frames.discard)
        await asyncio.shield(frame)

    async def _send_pieces(self, stream: BulkConnection, parts: list[bytes | memoryview]):
        for piece in pieces(parts, PIECE_BYTES):
            async with self._turns.turn(self._on_link):
                self._count_sent(await stream.send(piece))

    def _count_sent(self, size: int):
        self.bytes_sent += size
        KV_BYTES.labels(self.path, "sent").inc(size)

    def pause_turns(self):
        """On a link's turns: the sender has no frame in hand (the next is still being computed
        or exported), so flows behind this one may send meanwhile; the next ``send_frame``
        takes its place again. Without turns: nothing."""
        if self._turns is not None:
            self._turns.let_go(self._on_link)

    async def end(self, output_token_ids: list[int], output_logprobs: list | None = None):
        """Once every frame is sent, tell the receiver so (and which output tokens it starts
        from): a StreamEnd on each joined connection, the FlowEnd on the lead. The connections
        then go back to the pool (without one: they close); on a failure they close."""
        try:
            while self._in_flight:
                await asyncio.shield(self._in_flight[0])
                self._in_flight.popleft()
            for frame in list(self._pieced_frames):  # one whose sender was cancelled goes out whole
                await asyncio.shield(frame)
            self._leave_link()
            await asyncio.gather(*(self._end_stream(stream) for stream in self._streams[1:]))
            await self._connection.send_control(
                FlowEnd(
                    request_id=self.request_id,
                    output_token_ids=output_token_ids,
                    output_logprobs=output_logprobs or [],
                )
            )
        except BaseException:
            await self.close()
            raise
        if self._release is None:
            await self.close()
        else:
            self._release(self._streams)

    async def _end_stream(self, stream: BulkConnection):
        """Read the receiver's answer to the stream's FlowJoin (long arrived: nothing waits on
        it), then end the stream."""
        reply, _ = await stream.read_message(None)
        if not isinstance(reply, FlowAccepted):
            raise ConnectionError(f"the receiver did not accept a stream of flow {self.request_id!r}")
        await stream.send_control(StreamEnd(request_id=self.request_id))

    async def cancel(self, reason: str):
        """Abandon the flow; the receiver discards what arrived. A frame cut into pieces that
        has started is finished first (its pieces no longer wait for turns), within
        ``CANCEL_TIMEOUT_S``; else the connections just close."""
        try:
            self._leave_link()
            if self._pieced_frames:
                _, unfinished = await asyncio.wait(list(self._pieced_frames), timeout=CANCEL_TIMEOUT_S)
                if unfinished:
                    return
            await self._connection.send_control(FlowCancel(request_id=self.request_id, reason=reason), CANCEL_TIMEOUT_S)
        except (TimeoutError, ConnectionError, OSError):
            pass
        finally:
            await self.close()

    async def close(self):
        """Close the connections (idempotent); bytes already sent are still delivered."""
        self._leave_link()
        for stream in self._streams:
            stream.close()

    def _leave_link(self):
        if self._turns is not None:
            self._turns.close(self._on_link)


def _retrieve_exception(task: asyncio.Task):
    # A send nobody awaits any more (its flow failed or was cancelled) must not warn at exit.
    if not task.cancelled():
        task.exception()


async def open_flow(
    endpoint: str,
    flow_open: FlowOpen,
    secret: str,
    *,
    path: str,
    timeout_s: float,
    accept_timeout_s: float | None = None,
    tls: ssl.SSLContext | None = None,
    tls_name: str = "",
    link: str = "",
    stall_timeout_s: float = SEND_STALL_TIMEOUT_S,
    streams: int = 1,
    pool: BulkPool | None = None,
    buffer_bytes: int = 0,
    turns: LinkTurns | None = None,
) -> BulkFlow:
    """Connect to ``endpoint`` (``host:port``), authenticate and wait for FlowAccepted; with
    ``streams`` > 1, join that many connections in all to the flow (each with a signed FlowJoin).
    ``timeout_s`` bounds each connection (TLS included), ``accept_timeout_s`` (default the same)
    the answer, which a receiver may delay (``BulkFlow.handshake_s`` excludes that delay), and
    ``stall_timeout_s`` each later send's wait without progress. ``tls``: mutual TLS for
    ``tls_name``; ``link``: through the WAN link (signed ``LinkRoute``, TLS end to end); ``pool``:
    connections taken from it, given back after a clean end (a stale pooled lead is replaced
    once); ``buffer_bytes`` sizes new sockets; ``turns``: the flow takes turns with this
    process's other flows on the same link (``BulkFlow``).

    Raises:
        FlowRefused: the receiver said no. ValueError: ``streams`` not within 1 .. ``MAX_STREAMS``.
        ConnectionError, OSError, asyncio.TimeoutError: not reached in time (or a route refused).
    """
    if not 1 <= streams <= MAX_STREAMS:
        raise ValueError(f"streams must be within 1..{MAX_STREAMS}, got {streams}")
    peer = (endpoint, link, tls_name, id(tls) if tls is not None else None, buffer_bytes)
    stall_s = max(stall_timeout_s, accept_timeout_s or timeout_s)
    dial = functools.partial(_connect, endpoint, secret, tls, tls_name, link, stall_s, buffer_bytes)
    connect = functools.partial(_pooled_or_dialled, pool, peer, dial, timeout_s)
    extra = [asyncio.ensure_future(connect()) for _ in range(streams - 1)]
    try:
        lead, signed, reply, started = await _open_lead(
            connect, flow_open, secret, streams, timeout_s, accept_timeout_s
        )
        joined = list(await asyncio.gather(*extra))
    except BaseException:
        await _close_all(extra)
        raise
    if isinstance(reply, FlowAccepted):
        flow = _accepted_flow(flow_open, path, [lead, *joined], reply, started, pool, peer, turns)
        await _join(flow, signed, joined, secret, timeout_s)
        return flow
    raise _refused(endpoint, reply, [lead, *joined])


def _accepted_flow(
    flow_open: FlowOpen,
    path: str,
    connections: list,
    reply: FlowAccepted,
    started: float,
    pool,
    peer: tuple,
    turns: LinkTurns | None,
) -> "BulkFlow":
    """The flow over ``connections`` the receiver accepted (``started``: when the lead's
    FlowOpen went out; the receiver's queueing is not handshake time)."""
    handshake_s = max(0.0, time.monotonic() - started - reply.queued_s)
    release = functools.partial(_give_back, pool, peer) if pool is not None else None
    return BulkFlow(flow_open.request_id, path, connections, reply.first_token_index, handshake_s, release, turns)


async def _pooled_or_dialled(pool: BulkPool | None, peer: tuple, dial, timeout_s: float) -> BulkConnection:
    """An idle pooled connection to ``peer``, else a new one dialled within ``timeout_s`` (a
    pool's turn to dial that peer included: ``BulkPool.dial_slot``)."""
    if pool is None:
        return await asyncio.wait_for(dial(), timeout_s)
    taken = pool.take(peer)
    if taken is not None:
        return taken
    async with asyncio.timeout(timeout_s), pool.dial_slot(peer):
        taken = pool.take(peer)  # a flow that ended while this one waited may have left one
        return taken if taken is not None else await dial()


def _refused(endpoint: str, reply, connections: list[BulkConnection]) -> FlowRefused:
    """Close a refused flow's connections (never read to the end: not fit for a pool); the error."""
    for connection in connections:
        connection.close()
    if isinstance(reply, FlowRejected):
        return FlowRefused(f"{endpoint} refused flow: {reply.code}: {reply.message}")
    return FlowRefused(f"{endpoint} closed the flow without answering")


async def _open_lead(
    connect: Callable[[], Awaitable[BulkConnection]],
    flow_open: FlowOpen,
    secret: str,
    streams: int,
    timeout_s: float,
    accept_timeout_s: float | None,
) -> tuple[BulkConnection, FlowOpen, BulkControl | None, float]:
    """(lead connection, the signed FlowOpen it carried, the receiver's answer, when it was sent
    (monotonic)). A pooled connection that turns out closed (no answer, a reset) is replaced once."""
    for attempt in range(2):
        connection = await connect()
        reused = connection.reused
        signed = sign(_stamp_fresh(msgspec.structs.replace(flow_open, streams=streams)), secret)
        started = time.monotonic()
        try:
            await connection.send_control(signed, timeout_s)
            reply, _ = await connection.read_message(None, timeout_s=accept_timeout_s or timeout_s)
        except ConnectionError:
            connection.close()
            if reused and attempt == 0:
                continue
            raise
        except BaseException:
            connection.close()
            raise
        if reply is None and reused and attempt == 0:
            connection.close()
            continue
        return connection, signed, reply, started
    raise AssertionError("unreachable")


async def _join(flow: BulkFlow, signed: FlowOpen, joined: list[BulkConnection], secret: str, timeout_s: float):
    """Send each further connection's signed FlowJoin without waiting for its answer (read at
    the flow's end: a receiver that refuses one closes that connection, and the flow's next
    send on it fails)."""
    joins = [
        sign(
            FlowJoin(
                request_id=signed.request_id,
                flow_nonce=signed.nonce,
                stream=index,
                sender_id=signed.sender_id,
                receiver_id=signed.receiver_id,
                receiver_incarnation=signed.receiver_incarnation,
                unix_s=time.time(),
                nonce=new_nonce(),
            ),
            secret,
        )
        for index in range(1, len(joined) + 1)
    ]
    try:
        await asyncio.gather(*(c.send_control(j, timeout_s) for c, j in zip(joined, joins, strict=True)))
    except BaseException:
        await flow.cancel("a stream could not join")
        raise


def _give_back(pool: BulkPool, peer, connections: list[BulkConnection]):
    for connection in connections:
        pool.give(peer, connection)


async def _close_all(futures: list[asyncio.Future]):
    for future in futures:
        future.cancel()
    for outcome in await asyncio.gather(*futures, return_exceptions=True):
        if isinstance(outcome, BulkConnection):
            outcome.close()


async def _connect(
    endpoint: str,
    secret: str,
    tls: ssl.SSLContext | None,
    tls_name: str,
    link: str,
    stall_timeout_s: float,
    buffer_bytes: int = 0,
) -> BulkConnection:
    host, _, port = (link or endpoint).rpartition(":")
    connection = await dial(host, int(port), stall_timeout_s, buffer_bytes)
    try:
        if link:
            await connection.send_control(sign_route(endpoint, route_key(secret)))
        if tls is not None:
            await connection.start_tls(tls, server_side=False, server_hostname=tls_name or host)
    except BaseException:
        connection.close()
        raise
    return connection


def _stamp_fresh(flow_open: FlowOpen) -> FlowOpen:
    """Stamp a fresh clock reading and nonce (the MAC covers both)."""
    return msgspec.structs.replace(flow_open, unix_s=time.time(), nonce=new_nonce())
