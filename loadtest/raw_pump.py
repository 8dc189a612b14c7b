"""The machine's own limits, for ``pdd bench bulk`` to compare the bulk channel with: a raw
socket pump on loopback (plaintext or TLS) and memcpy on one core.

The pump is the plainest fast Python transfer: two threads, one ``sendall`` of a large
memoryview after another, the other ``recv_into`` one preallocated buffer until it is full,
then again from its start. Both buffers are larger than the CPU's caches, as KV is: it comes
from memory and must land in memory. (A pump that receives every time at the buffer's start
keeps rewriting the same cached bytes: 10–25 % faster here, and no receiver that keeps what
it receives can do that.) The GIL is released in the kernel's copies and in OpenSSL, so both
ends run at once, as the channel's do.
"""

import socket
import ssl
import threading
import time
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


def pump(
    nbytes: int, server_tls: ssl.SSLContext | None = None, client_tls: ssl.SSLContext | None = None, tls_name: str = ""
) -> Pumped:
    """Move ``nbytes`` (rounded up to whole buffers) over a fresh loopback connection, TLS when
    both contexts are given (the handshake is not timed)."""
    sender, receiver = _connected_pair(server_tls, client_tls, tls_name)
    # Both written now, so no page is first touched while timed (np.zeros' are, and made the
    # first run here 40 % slower than the next ones).
    source = memoryview(np.ones(PUMP_BUFFER_BYTES, dtype=np.uint8))
    sink = memoryview(np.ones(PUMP_BUFFER_BYTES, dtype=np.uint8))
    chunks = -(-nbytes // PUMP_BUFFER_BYTES)
    failure: list[BaseException] = []

    def send():
        try:
            for _ in range(chunks):
                sender.sendall(source)
        except BaseException as exc:  # noqa: BLE001 - reported by the receiving side, which this wakes
            failure.append(exc)
            socket.socket.shutdown(sender, socket.SHUT_RDWR)

    try:
        started = time.perf_counter()
        thread = threading.Thread(target=send, name="raw-pump-send", daemon=True)
        thread.start()
        received, total = 0, chunks * PUMP_BUFFER_BYTES
        while received < total:  # fills the buffer, then again: every byte lands in memory
            count = receiver.recv_into(sink[received % PUMP_BUFFER_BYTES :])
            if count == 0:
                raise ConnectionError(f"pump sender stopped: {failure[:1]}")
            received += count
        seconds = time.perf_counter() - started
        thread.join(PUMP_TIMEOUT_S)
        cipher = receiver.cipher()[0] if isinstance(receiver, ssl.SSLSocket) else None
        return Pumped(total, seconds, cipher)
    finally:
        sender.close()
        receiver.close()


def _connected_pair(server_tls, client_tls, tls_name: str) -> tuple[socket.socket, socket.socket]:
    """(sending, receiving) ends of one loopback TCP connection, TLS-wrapped when asked."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        sender = socket.create_connection(listener.getsockname()[:2], timeout=PUMP_TIMEOUT_S)
        receiver, _ = listener.accept()
    receiver.settimeout(PUMP_TIMEOUT_S)
    if server_tls is None or client_tls is None:
        return sender, receiver
    accepted: list = []
    thread = threading.Thread(
        target=lambda: accepted.append(server_tls.wrap_socket(receiver, server_side=True)), daemon=True
    )
    thread.start()
    try:
        sender = client_tls.wrap_socket(sender, server_hostname=tls_name or "127.0.0.1")
    finally:
        thread.join(PUMP_TIMEOUT_S)
    if not accepted:
        sender.close()
        raise ConnectionError("the pump's TLS handshake failed")
    return sender, accepted[0]


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
