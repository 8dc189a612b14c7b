"""Messages on a bulk connection: control messages and KV frames, told apart by magic.

``PDCT | u32 length | msgpack BulkControl`` for control, a KV wire frame (``PDKV…``) for KV.
Sizes are checked before anything is read into memory. ``recv_message`` and ``send_buffers``
move them on a blocking socket (plaintext or TLS) without a Python copy of KV bytes: a frame
is read straight into one buffer of its exact size and validated there (the body's checks
piece by piece as it lands, while the pieces are still in the CPU's caches), and sent from the
buffers it was exported as. A receiver may reuse the buffers of one stream's frames once
nothing refers to them any more (``FrameBuffers``). ``read_message`` reads the same messages
from an asyncio stream (the WAN link reads a connection's ``LinkRoute`` with it).
"""

import asyncio
import socket
import ssl
import struct
import sys
from collections.abc import Callable

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


def control_bytes(message: BulkControl) -> bytes:
    """Encode a control message for the wire."""
    payload = encode(message)
    return CONTROL_MAGIC + _CONTROL_LEN.pack(len(payload)) + payload


BODY_ALIGNMENT = 64
"""Where a received frame's body starts: a multiple of this address (a cache line)."""


def frame_buffer(nbytes: int, body_offset: int = 0) -> memoryview:
    """An uninitialised writable buffer for one received frame whose byte ``body_offset`` (the
    body's start) lies at a multiple of ``BODY_ALIGNMENT`` (no zero-filling: the caller
    overwrites every byte before anything reads it). Its ``obj`` is the memory's owner, which
    everything viewing the memory refers to (``FrameBuffers`` relies on that).

    Why aligned: the header's length varies, so an unaligned body was the rule, and numpy's
    float32 sum (the finiteness check then) copied the body piece by piece: 2.4x slower.
    """
    return _aligned(np.empty(nbytes + BODY_ALIGNMENT, dtype=np.uint8), nbytes, body_offset)


def _aligned(block: np.ndarray, nbytes: int, body_offset: int) -> memoryview:
    start = -(block.ctypes.data + body_offset) % BODY_ALIGNMENT
    return memoryview(block)[start : start + nbytes]


FRAME_BUFFERS_KEPT = 4
"""Buffers a ``FrameBuffers`` keeps for reuse: the frame being read, the one read before it
(being imported), one waiting for its turn in a striped flow, one more."""


class FrameBuffers:
    """The receive buffers of one stream of one flow: a frame's buffer is reused for a later
    frame of the same stream once nothing refers to its memory any more (the frame's import
    copied it and dropped the frame), never while anything does.

    Why: a fresh 11.8 MB buffer per frame cost the kernel's zeroing of its pages on first touch
    (a pass over memory the raw socket pump never pays). Why one stream of one flow: a buffer
    never carries one flow's bytes into another's (a flow's streams and flows come and go with
    their own ``FrameBuffers``).

    How it knows: everything that views a buffer's memory (a slice of it, the frame's tensor,
    a queued import holding the frame) refers, through its chain of buffer exports, to the
    array that owns the memory; so when only this object refers to that array, nothing else can
    reach the memory (CPython's reference count, read under the GIL: a count only other
    threads could lower). ``take`` is called from one thread at a time (the stream's reader).
    """

    def __init__(self, keep: int = FRAME_BUFFERS_KEPT):
        self._owners: list[np.ndarray] = []
        self._keep = keep

    def take(self, nbytes: int, body_offset: int = 0) -> memoryview:
        """A buffer as ``frame_buffer`` makes one: a kept one nothing refers to if one is large
        enough, else a new one (kept if there is room)."""
        for index in range(len(self._owners)):
            if self._owners[index].nbytes >= nbytes + BODY_ALIGNMENT and self._only_here(index):
                return _aligned(self._owners[index], nbytes, body_offset)
        buffer = frame_buffer(nbytes, body_offset)
        if isinstance(buffer.obj, np.ndarray):
            for index in range(len(self._owners)):  # a free one too small: this one replaces it
                if self._only_here(index):
                    self._owners[index] = buffer.obj
                    return buffer
            if len(self._owners) < self._keep:
                self._owners.append(buffer.obj)
        return buffer

    def _only_here(self, index: int) -> bool:
        """Whether nothing but this list refers to owner ``index`` (the list and the call's
        argument are the count's two)."""
        return sys.getrefcount(self._owners[index]) == 2


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
    sock: socket.socket,
    expect: kv_wire.FrameExpectation | None,
    max_control_bytes: int = MAX_CONTROL_BYTES,
    *,
    verify_checksum: bool = True,
    buffers: FrameBuffers | None = None,
) -> tuple[Message, int]:
    """Read the next control message or validated KV frame from a blocking socket, with its size.

    A KV frame (only when ``expect`` is given) lands in one buffer of its declared size (from
    ``buffers`` if given), allocated once the prefix passed ``kv_wire.read_prefix``'s bounds;
    its header is decoded as soon as it is in, and the body's checks run piece by piece as the
    body lands (``kv_wire.BodyCheck``; its xxh3 only if ``verify_checksum``), then
    ``kv_wire.decode_frame`` validates the whole frame in place (its body is viewed, not
    copied). A control message declaring more than ``max_control_bytes`` is refused before
    any of it is read. Returns ``(None, 0)`` at a clean end of stream.

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
        return _recv_frame(sock, start, expect, verify_checksum, buffers)
    raise CorruptFrame(f"unexpected message magic {magic!r}")


def _recv_frame(
    sock: socket.socket,
    prefix: bytearray,
    expect: kv_wire.FrameExpectation,
    verify_checksum: bool,
    buffers: FrameBuffers | None,
) -> tuple[kv_wire.KvFrame, int]:
    """The rest of a KV frame whose ``prefix`` was read: header, then body checked as it lands."""
    header_len, body_len = kv_wire.read_prefix(prefix, expect)
    body_at = kv_wire.PREFIX_SIZE + header_len
    frame = (buffers.take if buffers is not None else frame_buffer)(body_at + body_len, body_at)
    frame[: kv_wire.PREFIX_SIZE] = prefix
    _check_whole(_recv_into(sock, frame[kv_wire.PREFIX_SIZE : body_at]), header_len)
    check = kv_wire.body_check(frame[kv_wire.PREFIX_SIZE : body_at], frame[body_at:], verify_checksum)
    _check_whole(_recv_into(sock, frame[body_at:], check.advance), body_len)
    checked = check.finish()
    return kv_wire.decode_frame(frame, expect, verify_checksum=verify_checksum, checked=checked), len(frame)


def _recv_into(sock: socket.socket, view: memoryview, progress: Callable[[int], None] | None = None) -> int:
    """Fill ``view`` from ``sock``; fewer bytes only at the end of the stream. ``progress``
    hears how many bytes are in after each receive."""
    got = 0
    while got < len(view):
        count = sock.recv_into(view[got:])
        if count == 0:
            break
        got += count
        if progress is not None:
            progress(got)
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
