"""Messages on a bulk connection: control messages and KV frames, told apart by magic.

``PDCT | u32 length | msgpack BulkControl`` for control, a KV wire frame (``PDKV…``) for KV.
Sizes are checked before anything is read into memory.
"""

import asyncio
import struct

import msgspec

from shared import kv_wire
from shared.errors import CorruptFrame, OversizedFrame, TruncatedFrame
from shared.messages import BulkControl, decoder, encode

CONTROL_MAGIC = b"PDCT"
MAX_CONTROL_BYTES = 16 << 20
_CONTROL_LEN = struct.Struct("<I")
_control_decoder = decoder(BulkControl)


def control_bytes(message: BulkControl) -> bytes:
    """Encode a control message for the wire."""
    payload = encode(message)
    return CONTROL_MAGIC + _CONTROL_LEN.pack(len(payload)) + payload


async def write_control(writer: asyncio.StreamWriter, message: BulkControl):
    """Send a control message and wait for buffer room (back-pressure)."""
    writer.write(control_bytes(message))
    await writer.drain()


async def read_message(
    reader: asyncio.StreamReader, expect: kv_wire.FrameExpectation | None, max_control_bytes: int = MAX_CONTROL_BYTES
) -> tuple[BulkControl | kv_wire.KvFrame | None, int]:
    """Read the next control message or validated KV frame, with its size in bytes.

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
            try:
                return _control_decoder.decode(await reader.readexactly(length)), 8 + length
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                raise CorruptFrame(f"bad control message: {exc}") from exc
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
