"""Bulk sender: opens an authenticated per-request flow and streams KV frames with back-pressure."""

import asyncio
import ssl
import time

import msgspec

from shared.bulk.auth import new_nonce, sign
from shared.bulk.connection import BulkConnection, dial
from shared.bulk.link_route import route_key, sign_route
from shared.errors import PddError
from shared.messages import FlowAccepted, FlowCancel, FlowEnd, FlowOpen, FlowRejected
from shared.metrics import KV_BYTES


class FlowRefused(PddError):
    """The receiver refused the flow (authentication, capacity, unknown request…)."""

    code = "bulk_flow_refused"


SEND_STALL_TIMEOUT_S = 120.0
"""Longest a send waits without progress (the receiver stopped reading) before it fails."""
CANCEL_TIMEOUT_S = 1.0
"""Longest a cancelled flow waits to tell the receiver before it just closes."""


class BulkFlow:
    """One request's KV flow to one receiver."""

    def __init__(
        self,
        request_id: str,
        path: str,
        connection: BulkConnection,
        first_token_index: int,
        handshake_s: float = 0.0,
    ):
        self.request_id = request_id
        self.handshake_s = handshake_s
        self.path = path
        self.first_token_index = first_token_index
        self.bytes_sent = 0
        self._connection = connection
        self._opened = time.monotonic()

    @property
    def elapsed_s(self) -> float:
        """Seconds since the flow was accepted."""
        return time.monotonic() - self._opened

    @property
    def tls_cipher(self) -> str | None:
        """The TLS cipher suite of the connection (None: plaintext)."""
        return self._connection.cipher

    async def send_frame(self, parts: list[bytes | memoryview]):
        """Write one frame from its buffers as they are (no copy); returns once the kernel holds
        all of it, so a receiver that stops reading stalls the sender within the sockets'
        buffers. The buffers must stay unchanged until then (if this is cancelled: until the
        flow is closed). A frame whose sender is cancelled still goes out whole before a
        FlowCancel, unless the receiver does not take it within ``CANCEL_TIMEOUT_S``: the
        connection then closes mid-frame and the receiver drops the flow as truncated.

        Raises:
            ConnectionError, OSError: the connection broke, or no byte left for the
                connection's stall timeout (``TimeoutError``).
        """
        size = await self._connection.send(parts)
        self.bytes_sent += size
        KV_BYTES.labels(self.path, "sent").inc(size)

    async def end(self, output_token_ids: list[int], output_logprobs: list | None = None):
        """Tell the receiver every frame is sent (and which output tokens it starts from), then close."""
        try:
            await self._connection.send_control(
                FlowEnd(
                    request_id=self.request_id,
                    output_token_ids=output_token_ids,
                    output_logprobs=output_logprobs or [],
                )
            )
        finally:
            await self.close()

    async def cancel(self, reason: str):
        """Abandon the flow; the receiver discards what arrived."""
        try:
            await self._connection.send_control(FlowCancel(request_id=self.request_id, reason=reason), CANCEL_TIMEOUT_S)
        except (TimeoutError, ConnectionError, OSError):
            pass
        await self.close()

    async def close(self):
        """Close the connection (idempotent); bytes already sent are still delivered."""
        self._connection.close()


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
) -> BulkFlow:
    """Connect to ``endpoint`` (``host:port``), authenticate and wait for FlowAccepted.

    ``timeout_s`` bounds the connection (TLS handshake included); ``accept_timeout_s``
    (default the same) bounds the wait for the answer, which a receiver may delay while blocks
    this prompt needs are still arriving on another flow. ``BulkFlow.handshake_s`` excludes
    that delay: one round trip. ``stall_timeout_s`` bounds each later send's wait without
    progress. With ``tls`` the connection is mutual TLS: the receiver must present a
    certificate of the deployment's CA for ``tls_name`` (its service name, e.g.
    ``main-decode``; default the host dialled), and we present ours. With ``link`` (the WAN
    link's routed port) the connection goes there and opens with a signed ``LinkRoute``
    naming ``endpoint``; it costs no round trip, and TLS then runs end to end through the link.

    Raises:
        FlowRefused: the receiver said no.
        ConnectionError, OSError, asyncio.TimeoutError: it could not be reached in time (a
            link that refuses the route closes the connection: the TLS handshake or the
            FlowOpen then fails).
    """
    signed = sign(_stamp_fresh(flow_open), secret)
    stall_timeout_s = max(stall_timeout_s, accept_timeout_s or timeout_s)
    connection = await asyncio.wait_for(_connect(endpoint, secret, tls, tls_name, link, stall_timeout_s), timeout_s)
    started = time.monotonic()
    try:
        await connection.send_control(signed, timeout_s)
        reply, _ = await connection.read_message(None, timeout_s=accept_timeout_s or timeout_s)
    except BaseException:
        connection.close()
        raise
    if isinstance(reply, FlowAccepted):
        handshake_s = max(0.0, time.monotonic() - started - reply.queued_s)
        return BulkFlow(flow_open.request_id, path, connection, reply.first_token_index, handshake_s=handshake_s)
    connection.close()
    if isinstance(reply, FlowRejected):
        raise FlowRefused(f"{endpoint} refused flow: {reply.code}: {reply.message}")
    raise FlowRefused(f"{endpoint} closed the flow without answering")


async def _connect(
    endpoint: str, secret: str, tls: ssl.SSLContext | None, tls_name: str, link: str, stall_timeout_s: float
) -> BulkConnection:
    host, _, port = (link or endpoint).rpartition(":")
    connection = await dial(host, int(port), stall_timeout_s)
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
