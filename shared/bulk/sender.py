"""Bulk sender: opens an authenticated per-request flow and streams KV frames with back-pressure."""

import asyncio
import ssl
import time

import msgspec

from shared.bulk.auth import new_nonce, sign
from shared.bulk.framing import control_bytes, read_message, write_control
from shared.bulk.link_route import route_key, sign_route
from shared.errors import PddError
from shared.messages import FlowAccepted, FlowCancel, FlowEnd, FlowOpen, FlowRejected
from shared.metrics import KV_BYTES


class FlowRefused(PddError):
    """The receiver refused the flow (authentication, capacity, unknown request…)."""

    code = "bulk_flow_refused"


class BulkFlow:
    """One request's KV flow to one receiver."""

    def __init__(self, request_id: str, path: str, reader, writer, first_token_index: int, handshake_s: float = 0.0):
        self.request_id = request_id
        self.handshake_s = handshake_s
        self.path = path
        self.first_token_index = first_token_index
        self.bytes_sent = 0
        self._reader, self._writer = reader, writer
        self._opened = time.monotonic()

    @property
    def elapsed_s(self) -> float:
        """Seconds since the flow was accepted."""
        return time.monotonic() - self._opened

    async def send_frame(self, parts: list[bytes | memoryview]):
        """Write one frame; waits while the socket's buffer is full (back-pressure)."""
        self._writer.writelines(parts)
        size = sum(len(p) if isinstance(p, bytes) else p.nbytes for p in parts)
        self.bytes_sent += size
        KV_BYTES.labels(self.path, "sent").inc(size)
        await self._writer.drain()

    async def end(self, output_token_ids: list[int], output_logprobs: list | None = None):
        """Tell the receiver every frame is sent (and which output tokens it starts from), then close."""
        await write_control(
            self._writer,
            FlowEnd(
                request_id=self.request_id, output_token_ids=output_token_ids, output_logprobs=output_logprobs or []
            ),
        )
        await self.close()

    async def cancel(self, reason: str):
        """Abandon the flow; the receiver discards what arrived."""
        try:
            await asyncio.wait_for(
                write_control(self._writer, FlowCancel(request_id=self.request_id, reason=reason)), 1.0
            )
        except (TimeoutError, ConnectionError):
            pass
        await self.close()

    async def close(self):
        """Close the connection (idempotent)."""
        self._writer.close()
        try:
            await asyncio.wait_for(self._writer.wait_closed(), 1.0)
        except (TimeoutError, ConnectionError):
            pass


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
) -> BulkFlow:
    """Connect to ``endpoint`` (``host:port``), authenticate and wait for FlowAccepted.

    ``timeout_s`` bounds the connection; ``accept_timeout_s`` (default the same) bounds the
    wait for the answer, which a receiver may delay while blocks this prompt needs are still
    arriving on another flow. ``BulkFlow.handshake_s`` excludes that delay: one round trip.
    With ``tls`` the connection is mutual TLS: the receiver must present a certificate of the
    deployment's CA for ``tls_name`` (its service name, e.g. ``main-decode``; default the host
    dialled), and we present ours. With ``link`` (the WAN link's routed port) the
    connection goes there and opens with a signed ``LinkRoute`` naming ``endpoint``; it costs
    no round trip, and TLS then runs end to end through the link.

    Raises:
        FlowRefused: the receiver said no.
        ConnectionError, OSError, asyncio.TimeoutError: it could not be reached in time (a
            link that refuses the route closes the connection: the TLS handshake or the
            FlowOpen then fails).
    """
    signed = sign(_stamp_fresh(flow_open), secret)
    reader, writer = await asyncio.wait_for(_connect(endpoint, secret, tls, tls_name, link), timeout_s)
    started = time.monotonic()
    try:
        await write_control(writer, signed)
        reply, _ = await asyncio.wait_for(read_message(reader, None), accept_timeout_s or timeout_s)
    except BaseException:
        writer.close()
        raise
    if isinstance(reply, FlowAccepted):
        handshake_s = max(0.0, time.monotonic() - started - reply.queued_s)
        return BulkFlow(flow_open.request_id, path, reader, writer, reply.first_token_index, handshake_s=handshake_s)
    writer.close()
    if isinstance(reply, FlowRejected):
        raise FlowRefused(f"{endpoint} refused flow: {reply.code}: {reply.message}")
    raise FlowRefused(f"{endpoint} closed the flow without answering")


async def _connect(endpoint: str, secret: str, tls: ssl.SSLContext | None, tls_name: str, link: str):
    if not link:
        host, _, port = endpoint.rpartition(":")
        return await asyncio.open_connection(
            host, int(port), limit=1 << 20, ssl=tls, server_hostname=(tls_name or host) if tls else None
        )
    link_host, _, link_port = link.rpartition(":")
    reader, writer = await asyncio.open_connection(link_host, int(link_port), limit=1 << 20)
    try:
        writer.write(control_bytes(sign_route(endpoint, route_key(secret))))
        await writer.drain()
        if tls is not None:
            await writer.start_tls(tls, server_hostname=tls_name or link_host)
    except BaseException:
        writer.close()
        raise
    return reader, writer


def _stamp_fresh(flow_open: FlowOpen) -> FlowOpen:
    """Stamp a fresh clock reading and nonce (the MAC covers both)."""
    return msgspec.structs.replace(flow_open, unix_s=time.time(), nonce=new_nonce())
