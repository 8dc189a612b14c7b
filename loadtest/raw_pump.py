"""The machine's own limits, for ``pdd bench bulk`` to compare the bulk channel with: a raw
socket pump on loopback (plaintext or TLS) and memcpy on one core.

The pump is the plainest fast Python transfer: one side ``sendall``s a large memoryview after
another, the other ``recv_into``s one preallocated buffer until it is full, then again from its
start (``pdd bench bulk`` runs the two in separate processes, as it runs our channel's). Both
buffers are larger than the CPU's caches, as KV is: it comes from memory and must land in
memory. (A pump that receives every time at the buffer's start keeps rewriting the same cached
bytes: 10–25 % faster here, and no receiver that keeps what it receives can do that.)
"""

import socket
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

PUMP_BUFFER_BYTES = 64 << 20
"""Size of the pump's send and receive buffers (beyond a last-level cache of 32 MiB)."""
PUMP_TIMEOUT_S = 60.0
"""Longest any socket call or handshake of the pump may wait."""


@dataclass(frozen=True)
class Pumped:
    """One pump run: bytes moved, seconds from the first byte sent to the last received, and
    the TLS cipher suite (None: plaintext)."""

    nbytes: int
    seconds: float
    cipher: str | None


def now_s() -> float:
    """Seconds on the machine-wide monotonic clock (comparable across processes)."""
    return time.clock_gettime(time.CLOCK_MONOTONIC)


def send_pump(
    port: int,
    nbytes: int,
    received_s: Callable[[], float],
    client_tls: ssl.SSLContext | None = None,
    tls_name: str = "",
) -> Pumped:
    """Connect to 127.0.0.1:``port`` (TLS with ``client_tls``; the handshake is not timed),
    send ``nbytes`` (a whole number of buffers), one ``sendall`` of the buffer after another,
    and time them to ``received_s()``: when the receiving side took the last byte (``now_s``).
    The socket closes only after that (closed earlier with a TLS session ticket unread, it
    would reset the connection and drop the bytes still in flight)."""
    source = memoryview(np.ones(PUMP_BUFFER_BYTES, dtype=np.uint8))  # written now: no first touch while timed
    with socket.create_connection(("127.0.0.1", port), timeout=PUMP_TIMEOUT_S) as plain:
        sock = client_tls.wrap_socket(plain, server_hostname=tls_name or "127.0.0.1") if client_tls else plain
        with sock:
            started = now_s()
            for _ in range(nbytes // PUMP_BUFFER_BYTES):
                sock.sendall(source)
            seconds = received_s() - started
            cipher = sock.cipher()[0] if isinstance(sock, ssl.SSLSocket) else None
    return Pumped(nbytes, seconds, cipher)


def pump_sink() -> memoryview:
    """The pump's receive buffer, every page already written (none is first touched while timed)."""
    return memoryview(np.ones(PUMP_BUFFER_BYTES, dtype=np.uint8))


def receive_pump(sock: socket.socket, nbytes: int, sink: memoryview) -> float:
    """Take ``nbytes`` from ``sock`` into ``sink`` (``pump_sink``), round and round (every byte
    lands in memory); returns when the last one landed (``now_s``).

    Raises:
        ConnectionError: the sender stopped early.
    """
    received = 0
    while received < nbytes:
        count = sock.recv_into(sink[received % len(sink) :])
        if count == 0:
            raise ConnectionError(f"the pump's sender stopped after {received} of {nbytes} bytes")
        received += count
    return now_s()


def memcpy_seconds(nbytes: int = PUMP_BUFFER_BYTES, repeats: int = 3) -> float:
    """Best of ``repeats`` copies of ``nbytes`` between two buffers on one core (numpy's copy:
    one thread)."""
    source = np.ones(nbytes, dtype=np.uint8)
    target = np.ones(nbytes, dtype=np.uint8)
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        np.copyto(target, source)
        best = min(best, time.perf_counter() - started)
    return best
