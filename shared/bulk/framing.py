"""Messages on a bulk connection: control messages and KV frames, told apart by magic.

``PDCT | u32 length | msgpack BulkControl`` for control, a KV wire frame (``PDKV…``) for KV.
Sizes are checked before anything is read into memory. ``recv_message`` and ``send_buffers``
move them on a blocking socket (plaintext or TLS) without a Python copy of KV bytes: a frame
is read straight into one buffer of its exact size and validated there, and sent from the
buffers it was exported as. ``read_message`` reads the same messages from an asyncio stream
(the WAN link reads a connection's ``LinkRoute`` with it).
"""

import asyncio
import socket
import ssl
import struct

import msgspec
import numpy as np

from shared import kv_wire
from shared.errors import CorruptFrame, OversizedFrame, TruncatedFrame
from shared.messages import BulkControl, decoder, encode

CONTROL_MAGIC = b"PDCT"
MAX_CONTROL_BYTES = 16 << 20
_CONTROL_LEN = struct.Struct("<I")
_control_decoder = decoder(BulkControl)

Message = BulkControl | kv_wire.KvFrame | None
RawMessage = BulkControl | memoryview | None
"""What ``recv_raw`` returns: a KV frame as its buffer, not yet validated."""


def control_bytes(message: BulkControl) -> bytes:
    """Encode a control message for the wire."""
    payload = encode(message)
    return CONTROL_MAGIC + _CONTROL_LEN.pack(len(payload)) + payload


BODY_ALIGNMENT = 64
"""Where a received frame's body starts: a multiple of this address (a cache line)."""


def frame_buffer(nbytes: int, body_offset: int = 0) -> memoryview:
    """An uninitialised writable buffer for one received frame whose byte ``body_offset`` (the
    body's start) lies at a multiple of ``BODY_ALIGNMENT`` (no zero-filling: the caller
    overwrites every byte before anything reads it).

    Why aligned: the header's length varies, so an unaligned body was the rule, and numpy's
    float32 sum (the finiteness check) then copies the body piece by piece: 2.4x slower.
    """
    block = np.empty(nbytes + BODY_ALIGNMENT, dtype=np.uint8)
    start = -(block.ctypes.data + body_offset) % BODY_ALIGNMENT
    return memoryview(block[start : start + nbytes])


def send_buffers(sock: socket.socket, parts: list[bytes | memoryview]) -> int:
    """Send ``parts`` in order from the buffers themselves (plaintext: one ``sendmsg`` per
    system call, scatter-gather; TLS: OpenSSL encrypts from each buffer); return the bytes
    sent. Blocks until the kernel holds all of them: the socket's timeout bounds each wait
    without progress (``TimeoutError``)."""
    views = [memoryview(part).cast("B") for part in parts]
    total = sum(len(view) for view in views)
    if isinstance(sock, ssl.SSLSocket):
        for view in views:
            sock.sendall(view)
        return total
    views = [view for view in views if len(view)]
    while views:
        sent = sock.sendmsg(views)
        while views and sent >= len(views[0]):
            sent -= len(views.pop(0))
        if sent:
            views[0] = views[0][sent:]
    return total


def recv_message(
    sock: socket.socket, expect: kv_wire.FrameExpectation | None, max_control_bytes: int = MAX_CONTROL_BYTES
) -> tuple[Message, int]:
    """Read the next control message or validated KV frame from a blocking socket, with its size.

    ``recv_raw``, then a KV frame is validated in place (``kv_wire.decode_frame``: its body is
    viewed, not copied). Returns ``(None, 0)`` at a clean end of stream.

    Raises:
        KvFrameError: the bytes are not a valid message (the connection must be dropped).
        OSError: the socket failed or its timeout passed without progress (``TimeoutError``).
    """
    message, size = recv_raw(sock, expect, max_control_bytes)
    if isinstance(message, memoryview):
        return kv_wire.decode_frame(message, expect), size
    return message, size


def recv_raw(
    sock: socket.socket, expect: kv_wire.FrameExpectation | None, max_control_bytes: int = MAX_CONTROL_BYTES
) -> tuple[RawMessage, int]:
    """Read the next message from a blocking socket, with its size; a KV frame comes back as
    its buffer, not yet validated (``kv_wire.decode_frame`` does that, on any thread).

    A KV frame (only when ``expect`` is given) lands in one buffer of its declared size,
    allocated once the prefix passed ``kv_wire.read_prefix``'s bounds. A control message
    declaring more than ``max_control_bytes`` is refused before any of it is read. Returns
    ``(None, 0)`` at a clean end of stream.

    Raises:
        KvFrameError: the bytes are not a valid message (the connection must be dropped).
        OSError: the socket failed or its timeout passed without progress (``TimeoutError``).
    """
    start = bytearray(kv_wire.PREFIX_SIZE)
    view = memoryview(start)
    got = _recv_into(sock, view[:4])
    if got == 0:
        return None, 0
    _check_whole(got, 4)
    magic = bytes(view[:4])
    if magic == CONTROL_MAGIC:
        _check_whole(_recv_into(sock, view[4:8]), 4)
        (length,) = _CONTROL_LEN.unpack_from(start, 4)
        if length > max_control_bytes:
            raise OversizedFrame(f"control message of {length} bytes")
        payload = bytearray(length)
        _check_whole(_recv_into(sock, memoryview(payload)), length)
        return _decode_control(payload), 8 + length
    if magic == kv_wire.MAGIC and expect is not None:
        _check_whole(_recv_into(sock, view[4:]), kv_wire.PREFIX_SIZE - 4)
        header_len, body_len = kv_wire.read_prefix(start, expect)
        frame = frame_buffer(kv_wire.PREFIX_SIZE + header_len + body_len, kv_wire.PREFIX_SIZE + header_len)
        frame[: kv_wire.PREFIX_SIZE] = start
        _check_whole(_recv_into(sock, frame[kv_wire.PREFIX_SIZE :]), header_len + body_len)
        return frame, len(frame)
    raise CorruptFrame(f"unexpected message magic {magic!r}")


def _recv_into(sock: socket.socket, view: memoryview) -> int:
    """Fill ``view`` from ``sock``; fewer bytes only at the end of the stream."""
    got = 0
    while got < len(view):
        count = sock.recv_into(view[got:])
        if count == 0:
            break
        got += count
    return got


def _check_whole(got: int, wanted: int):
    if got < wanted:
        raise TruncatedFrame("connection closed inside a message")


def _decode_control(payload) -> BulkControl:
    try:
        return _control_decoder.decode(payload)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise CorruptFrame(f"bad control message: {exc}") from exc


async def read_message(
    reader: asyncio.StreamReader, expect: kv_wire.FrameExpectation | None, max_control_bytes: int = MAX_CONTROL_BYTES
) -> tuple[Message, int]:
    """Read the next control message or validated KV frame from a stream, with its size in bytes.

    A control message declaring more than ``max_control_bytes`` is refused before any of it
    is read.

    Returns ``(None, 0)`` at a clean end of stream.

    Raises:
        KvFrameError: the bytes are not a valid message (the connection must be dropped).
    """
    try:
        magic = await reader.readexactly(4)
    except asyncio.IncompleteReadError as exc:
        if exc.partial:
            raise TruncatedFrame("connection closed inside a message") from exc
        return None, 0
    try:
        if magic == CONTROL_MAGIC:
            (length,) = _CONTROL_LEN.unpack(await reader.readexactly(_CONTROL_LEN.size))
            if length > max_control_bytes:
                raise OversizedFrame(f"control message of {length} bytes")
            return _decode_control(await reader.readexactly(length)), 8 + length
        if magic == kv_wire.MAGIC and expect is not None:
            prefix = magic + await reader.readexactly(kv_wire.PREFIX_SIZE - 4)
            header_len, body_len = kv_wire.read_prefix(prefix, expect)
            buffer = bytearray(kv_wire.PREFIX_SIZE + header_len + body_len)
            buffer[: kv_wire.PREFIX_SIZE] = prefix
            buffer[kv_wire.PREFIX_SIZE :] = await reader.readexactly(header_len + body_len)
            return kv_wire.decode_frame(buffer, expect), len(buffer)
    except asyncio.IncompleteReadError as exc:
        raise TruncatedFrame("connection closed inside a message") from exc
    raise CorruptFrame(f"unexpected message magic {magic!r}")
