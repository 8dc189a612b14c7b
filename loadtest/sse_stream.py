"""A lean HTTP/1.1 client for streamed completions that timestamps each server-sent event when
its bytes reach the process.

A load generator sharing the cores with the deployment it measures must cost little and must
not add its own delay to what it measures. An ``aiohttp`` client timestamps an event when the
task reading it next runs: with 128 streams' events arriving together, the last stream's task
runs milliseconds after its bytes came, and in a different place in the order each time.
Here each event carries the time ``data_received`` was called with its last byte: the event
loop's first sight of it.

One ``SseConnection`` per client, kept alive across its requests (one request at a time).
"""

import asyncio
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit

MAX_HEADER_BYTES = 64 << 10


class HttpStreamError(Exception):
    """The server broke the HTTP framing, or closed the connection mid-response."""


@dataclass
class SseResponse:
    """One response: its status, its events' ``data`` payloads and the times (``perf_counter``)
    each event's last byte arrived; ``body`` for a response that is not an event stream."""

    status: int = 0
    events: list[bytes] = field(default_factory=list)
    times_s: list[float] = field(default_factory=list)
    body: bytes = b""


class _HttpResponseParser:
    """HTTP/1.1 response framing (``Content-Length`` or chunked) fed as bytes arrive; the body
    is split into server-sent events."""

    def __init__(self):
        self.response = SseResponse()
        self.done = False
        self._buffer = bytearray()
        self._events = bytearray()
        self._state = "headers"
        self._remaining = 0  # body bytes left: of a Content-Length body, or of the current chunk

    def feed(self, data: bytes, now_s: float):
        self._buffer += data
        while not self.done and self._step(now_s):
            pass

    def _step(self, now_s: float) -> bool:
        """Parse what the buffer allows of the current state; False when it needs more bytes."""
        buf = self._buffer
        if self._state == "headers":
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                if len(buf) > MAX_HEADER_BYTES:
                    raise HttpStreamError("response headers too long")
                return False
            self._headers(bytes(buf[:end]))
            del buf[: end + 4]
            return True
        if self._state == "length":
            take = min(self._remaining, len(buf))
            self.response.body += bytes(buf[:take])
            del buf[:take]
            self._remaining -= take
            self.done = self._remaining == 0
            return False
        if self._state == "chunk-size":
            end = buf.find(b"\r\n")
            if end < 0:
                return False
            self._remaining = int(bytes(buf[:end]).split(b";", 1)[0], 16)
            del buf[: end + 2]
            self._state = "chunk" if self._remaining else "trailer"
            return True
        if self._state == "chunk":
            if len(buf) < self._remaining + 2:
                return False
            self._body(bytes(buf[: self._remaining]), now_s)
            del buf[: self._remaining + 2]
            self._state = "chunk-size"
            return True
        # trailer: none is sent; the response ends at the blank line
        end = buf.find(b"\r\n")
        if end < 0:
            return False
        del buf[: end + 2]
        self.done = end == 0
        return True

    def _headers(self, head: bytes):
        status_line, *lines = head.split(b"\r\n")
        parts = status_line.split(b" ", 2)
        if len(parts) < 2 or not parts[0].startswith(b"HTTP/1."):
            raise HttpStreamError(f"not an HTTP/1.x status line: {status_line[:80]!r}")
        self.response.status = int(parts[1])
        headers = {}
        for line in lines:
            name, _, value = line.partition(b":")
            headers[name.strip().lower()] = value.strip().lower()
        if headers.get(b"transfer-encoding") == b"chunked":
            self._state = "chunk-size"
        elif b"content-length" in headers:
            self._remaining = int(headers[b"content-length"])
            self._state = "length"
            self.done = self._remaining == 0
        else:
            raise HttpStreamError("a response with neither Content-Length nor chunked encoding")

    def _body(self, data: bytes, now_s: float):
        if self.response.status != 200:
            self.response.body += data
            return
        self._events += data
        while (end := self._events.find(b"\n\n")) >= 0:
            event = bytes(self._events[:end])
            del self._events[: end + 2]
            for line in event.split(b"\n"):
                if line.startswith(b"data: "):
                    self.response.events.append(line[6:])
                    self.response.times_s.append(now_s)


class _Protocol(asyncio.Protocol):
    def __init__(self):
        self.transport: asyncio.Transport | None = None
        self.parser: _HttpResponseParser | None = None
        self.waiter: asyncio.Future | None = None
        self.closed = False

    def connection_made(self, transport):
        self.transport = transport

    def data_received(self, data: bytes):
        now_s = time.perf_counter()
        if self.parser is None or self.waiter is None or self.waiter.done():
            return  # bytes nobody asked for: the next request's check catches a broken framing
        try:
            self.parser.feed(data, now_s)
        except (HttpStreamError, ValueError) as exc:
            self.waiter.set_exception(HttpStreamError(str(exc)))
            return
        if self.parser.done:
            self.waiter.set_result(self.parser.response)

    def connection_lost(self, exc):
        self.closed = True
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(HttpStreamError(f"connection closed mid-response: {exc}"))


class SseConnection:
    """A kept-alive HTTP/1.1 connection to one server; ``post`` one request at a time."""

    def __init__(self, url: str, headers: dict[str, str] | None = None):
        """``url``: ``http://host:port/path`` (plain HTTP: what a router on loopback serves)."""
        parts = urlsplit(url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"SseConnection speaks plain http://host:port only, not {url!r}")
        self.host, self.port = parts.hostname, parts.port or 80
        self.path = parts.path or "/"
        self.headers = {"Host": f"{self.host}:{self.port}", "Content-Type": "application/json", **(headers or {})}
        self._protocol: _Protocol | None = None

    async def post(self, body: bytes, timeout_s: float) -> SseResponse:
        """POST ``body``; the whole response once it ends.

        Raises:
            HttpStreamError: broken framing, or the connection closed before the response ended.
            TimeoutError: no end within ``timeout_s``.
        """
        if self._protocol is None or self._protocol.closed:
            _, self._protocol = await asyncio.get_running_loop().create_connection(_Protocol, self.host, self.port)
        protocol = self._protocol
        protocol.parser = _HttpResponseParser()
        protocol.waiter = asyncio.get_running_loop().create_future()
        head = "".join(f"{name}: {value}\r\n" for name, value in self.headers.items())
        protocol.transport.write(
            f"POST {self.path} HTTP/1.1\r\n{head}Content-Length: {len(body)}\r\n\r\n".encode() + body
        )
        try:
            async with asyncio.timeout(timeout_s):
                return await protocol.waiter
        except BaseException:
            self.close()
            raise

    def close(self):
        if self._protocol is not None and self._protocol.transport is not None:
            self._protocol.transport.close()
        self._protocol = None
