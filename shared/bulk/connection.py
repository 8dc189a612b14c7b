"""One bulk connection: a socket, plaintext or TLS, whose blocking calls run in order on a
thread of its own, awaited from asyncio.

Why a thread: KV then moves without a Python copy (``sendmsg`` from the exported buffers,
``recv_into`` one buffer per frame, see ``framing``), and the kernel's copies, OpenSSL's
encryption and the receiver's checks run while the GIL is released, beside the event loop
rather than on it. One call runs at a time, in submission order, so a frame whose sender was
cancelled still goes out whole before anything queued after it.

Timeouts: every call awaits with its own limit (``timeout_s``; ``None``: only the stall limit
below). The socket's timeout, ``stall_timeout_s``, bounds each blocking wait without progress
inside the thread, so no call can hang. A call that times out or is cancelled on the asyncio
side may still be running in the thread: the owner then closes the connection, which shuts the
socket down and so ends that call at once.

Receiving in a pipeline: ``start_read`` queues the read of the next message and returns at
once, and ``check_frame`` validates a frame read that way on a shared pool of check threads
(``kv_wire.decode_frame``: checksum and finiteness, both with the GIL released). A
receiver can so have the socket drain frame N+1 while frame N is checked and imported: on
loopback the transfer keeps one core busy and the checks take the other, instead of the two
taking turns.
"""

import asyncio
import concurrent.futures
import fcntl
import functools
import os
import queue
import select
import socket
import ssl
import struct
import threading
import weakref
from collections.abc import Callable
from typing import TypeVar

from shared.bulk.framing import (
    MAX_CONTROL_BYTES,
    Message,
    RawMessage,
    control_bytes,
    recv_message,
    recv_raw,
    send_buffers,
)
from shared.kv_wire import FrameExpectation, KvFrame, decode_frame
from shared.messages import BulkControl

T = TypeVar("T")
SIOCOUTQNSD = 0x894B
"""Linux's ioctl for a TCP socket's bytes queued and not yet sent (``linux/sockios.h``)."""

_checks: concurrent.futures.ThreadPoolExecutor | None = None


def _check_pool() -> concurrent.futures.ThreadPoolExecutor:
    """The process's threads that validate received frames (one per core: the checks are CPU work)."""
    global _checks
    if _checks is None:
        _checks = concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 1, thread_name_prefix="kv-check")
    return _checks


class _CallThread:
    """A daemon thread that runs submitted calls one at a time, in submission order."""

    def __init__(self, name: str):
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._run, name=name, daemon=True).start()

    def submit(self, call: Callable[[], T]) -> "concurrent.futures.Future[T]":
        """Queue ``call``; a call cancelled before it starts never runs."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._calls.put((future, call))
        return future

    def stop(self):
        """Let the thread end once the calls queued so far are done."""
        self._calls.put(None)

    def _run(self):
        while (item := self._calls.get()) is not None:
            _run_one(*item)
            del item  # hold nothing (a socket, say) while waiting for the next call


def _run_one(future: concurrent.futures.Future, call: Callable):
    if not future.set_running_or_notify_cancel():
        return
    try:
        result = call()
    except BaseException as exc:  # noqa: BLE001 - whatever it is, the awaiting side gets it
        future.set_exception(exc)
    else:
        future.set_result(result)


class BulkConnection:
    """A connected TCP socket (later wrapped in TLS) driven from asyncio through its own thread."""

    def __init__(self, sock: socket.socket, stall_timeout_s: float, name: str = "bulk-io"):
        """Take ownership of connected ``sock``; ``stall_timeout_s`` bounds each blocking wait."""
        if sock.family in (socket.AF_INET, socket.AF_INET6):  # control messages leave at once
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.settimeout(stall_timeout_s)
        self._sock = sock
        self._thread = _CallThread(name)
        self._closed = False
        self.reused = False
        """Whether a pool handed it out again (an earlier flow used it)."""
        weakref.finalize(self, self._thread.stop)  # one dropped unclosed: its socket closes as it is collected

    @property
    def cipher(self) -> str | None:
        """The TLS cipher suite in use (None: plaintext or no handshake yet)."""
        if isinstance(self._sock, ssl.SSLSocket):
            negotiated = self._sock.cipher()
            return negotiated[0] if negotiated else None
        return None

    @property
    def authenticates_bytes(self) -> bool:
        """Whether every byte read is authenticated end to end by the transport: TLS after its
        handshake (every suite our contexts allow carries an AEAD tag or a MAC per record, and a
        record that fails it ends the connection). The receiver then skips a frame's xxh3
        (``kv_wire.decode_frame(verify_checksum=False)``); plaintext keeps it."""
        return self.cipher is not None

    async def call(self, work: Callable[[socket.socket], T], timeout_s: float | None) -> T:
        """Run ``work(sock)`` on the connection's thread after the calls queued before it.

        Raises:
            ConnectionError: the connection is closed.
            TimeoutError: ``timeout_s`` passed (the call may still be running: close).
        """
        if self._closed:
            raise ConnectionError("bulk connection closed")
        sock = self._sock
        return await asyncio.wait_for(asyncio.wrap_future(self._thread.submit(lambda: work(sock))), timeout_s)

    async def start_tls(self, context: ssl.SSLContext, *, server_side: bool, server_hostname: str | None = None):
        """Wrap the socket in TLS and complete the handshake (certificates checked by ``context``)."""
        if self._closed:
            raise ConnectionError("bulk connection closed")
        # Wrapped here and handshaken on the thread, so close() can shut the socket down meanwhile.
        self._sock = context.wrap_socket(
            self._sock, server_side=server_side, server_hostname=server_hostname, do_handshake_on_connect=False
        )
        await self.call(lambda sock: sock.do_handshake(), None)

    async def send(self, parts: list[bytes | memoryview], timeout_s: float | None = None) -> int:
        """Send the buffers in order without copying them; return the bytes sent once the
        kernel holds them all (a peer that stops reading stalls this: back-pressure)."""
        return await self.call(lambda sock: send_buffers(sock, parts), timeout_s)

    async def send_control(self, message: BulkControl, timeout_s: float | None = None) -> int:
        """Send one control message."""
        return await self.send([control_bytes(message)], timeout_s)

    async def read_message(
        self,
        expect: FrameExpectation | None,
        max_control_bytes: int = MAX_CONTROL_BYTES,
        timeout_s: float | None = None,
    ) -> tuple[Message, int]:
        """The next message, read and validated on the connection's thread (``framing.recv_message``)."""
        return await self.call(lambda sock: recv_message(sock, expect, max_control_bytes), timeout_s)

    def start_read(
        self, expect: FrameExpectation | None, max_control_bytes: int = MAX_CONTROL_BYTES
    ) -> "asyncio.Future[tuple[RawMessage, int]]":
        """Queue the read of the next message now (``framing.recv_raw``: a KV frame comes back
        as its buffer, unchecked: pass it to ``check_frame``) and return its future.

        The read runs whatever the caller does meanwhile, bounded only by the stall timeout:
        await the future with a timeout of your own (through ``asyncio.shield`` if it should
        survive that timeout), and cancel it (then close the connection, which ends the read
        and drops its buffer) when giving up.

        Raises:
            ConnectionError: the connection is closed.
        """
        if self._closed:
            raise ConnectionError("bulk connection closed")
        sock = self._sock
        return asyncio.wrap_future(self._thread.submit(lambda: recv_raw(sock, expect, max_control_bytes)))

    async def check_frame(
        self, buffer: memoryview, expect: FrameExpectation, timeout_s: float | None = None
    ) -> KvFrame:
        """Validate a frame ``start_read`` returned, in place, on a check thread
        (``kv_wire.decode_frame``; its xxh3 only where the transport does not authenticate
        every byte: ``authenticates_bytes``).

        Raises:
            KvFrameError: the frame is not valid.
            TimeoutError: ``timeout_s`` passed (the check runs on to its end, then its result is dropped).
        """
        loop = asyncio.get_running_loop()
        check = functools.partial(decode_frame, buffer, expect, verify_checksum=not self.authenticates_bytes)
        return await asyncio.wait_for(loop.run_in_executor(_check_pool(), check), timeout_s)

    @property
    def closed(self) -> bool:
        """Whether ``close`` was called."""
        return self._closed

    def looks_idle(self) -> bool:
        """Whether nothing has arrived on the connection (an idle pooled connection whose peer
        closed it, or sent anything unasked, is readable: it must not be reused). Only call
        while no call runs on the connection."""
        if self._closed:
            return False
        try:  # poll, not select: a process with many connections has descriptors past 1024
            poller = select.poll()
            poller.register(self._sock, select.POLLIN)
            readable = poller.poll(0)
        except (OSError, ValueError):
            return False
        pending = self._sock.pending() if isinstance(self._sock, ssl.SSLSocket) else 0
        return not readable and not pending

    def unsent_bytes(self) -> int:
        """Bytes the kernel holds for the peer and has not sent yet (Linux's ``SIOCOUTQNSD``;
        bytes sent and awaiting their acknowledgement do not count); 0 once closed or where the
        kernel cannot say. A flow's end is written long before a slow path has carried it: a
        connection with bytes left carries the next message only after them."""
        if self._closed:
            return 0
        try:
            queued = fcntl.ioctl(self._sock.fileno(), SIOCOUTQNSD, struct.pack("i", 0))
        except (OSError, ValueError):
            return 0
        return struct.unpack("i", queued)[0]

    def close(self):
        """Shut the socket down (ending any call in progress), then close it once the calls
        already queued have ended; idempotent. Bytes already sent are still delivered."""
        if self._closed:
            return
        self._closed = True
        try:
            socket.socket.shutdown(self._sock, socket.SHUT_RDWR)  # the TCP socket, whatever wraps it
        except OSError:
            pass  # never connected, or the peer is gone already
        sock = self._sock
        self._thread.submit(sock.close)
        self._thread.stop()


async def dial(host: str, port: int, stall_timeout_s: float, buffer_bytes: int = 0) -> BulkConnection:
    """Connect to ``host:port`` (each address it resolves to, in order, until one answers).

    ``buffer_bytes`` > 0 sets the socket's send and receive buffers before it connects (so the
    window scale covers them; ``path_sizing.socket_buffer_bytes``); 0 leaves the kernel's
    autotuning alone."""
    loop = asyncio.get_running_loop()
    addresses = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    error: OSError = OSError(f"{host}:{port} resolves to no address")
    for family, kind, proto, _, address in addresses:
        sock = socket.socket(family, kind, proto)
        try:
            if buffer_bytes > 0:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, buffer_bytes)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, buffer_bytes)
            sock.setblocking(False)
            await loop.sock_connect(sock, address)
        except OSError as exc:
            sock.close()
            error = exc
            continue
        except BaseException:
            sock.close()
            raise
        return BulkConnection(sock, stall_timeout_s, name=f"bulk-io-{host}:{port}")
    raise error
