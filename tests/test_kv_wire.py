"""The KV wire format: round trips, zero-copy receive, and rejection of every kind of bad frame.

A rejected frame must raise its typed error and leave the receiving pool untouched.
"""

import struct

import msgspec
import pytest
import torch
import xxhash

from shared.engine.hf_engine import HfEngine
from shared.engine.sampling import SamplingParams
from shared.errors import (
    CorruptFrame,
    FrameOwnershipError,
    IncompatibleFrame,
    KvFrameError,
    OversizedFrame,
    TruncatedFrame,
)
from shared.kv_wire import (
    PREFIX,
    PREFIX_SIZE,
    WIRE_DTYPES,
    FrameExpectation,
    KvFrameHeader,
    decode_frame,
    frame_bytes,
    values_are_finite,
)
from shared.model_loader import load_model
from tests.helpers import prompt_of_length

SAMPLING = SamplingParams(max_tokens=8, ignore_eos=True)


@pytest.fixture
def pair(tiny):
    """A sender that has prefilled request ``r`` and a receiver importing it."""
    prompt = prompt_of_length(tiny, 40)
    sender, receiver = HfEngine(tiny, num_blocks=16), HfEngine(tiny, num_blocks=16)
    sender.add_request("r", prompt, SAMPLING)
    sender.step()
    receiver.begin_import("r", prompt, SAMPLING)
    frame = bytearray(frame_bytes(sender.export_frames("r")[0]))
    return sender, receiver, frame


def split(frame: bytes):
    _, _, _, header_len, _ = PREFIX.unpack_from(frame)
    header = msgspec.msgpack.decode(frame[PREFIX_SIZE : PREFIX_SIZE + header_len], type=KvFrameHeader)
    return header, bytes(frame[PREFIX_SIZE + header_len :])


def rebuild(header: KvFrameHeader, body: bytes, **changes) -> bytearray:
    """Re-encode a frame with header fields changed (a well-formed but lying frame)."""
    header_bytes = msgspec.msgpack.encode(msgspec.structs.replace(header, **changes))
    return bytearray(PREFIX.pack(b"PDKV", 1, 0, len(header_bytes), len(body)) + header_bytes + body)


def assert_rejected(receiver: HfEngine, frame, error: type[KvFrameError]):
    before = receiver.pool.kv.clone()
    with pytest.raises(error):
        receiver.import_frame(decode_frame(frame, receiver.frame_expectation))
    assert torch.equal(receiver.pool.kv, before), "a rejected frame changed the pool"
    assert receiver.get("r").num_kv_tokens == 0


def test_round_trip_preserves_header_and_bytes(pair):
    sender, receiver, frame = pair
    decoded = decode_frame(frame, receiver.frame_expectation)
    assert decoded.header.request_id == "r"
    assert decoded.header.token_ids == sender.get("r").token_ids[:40]
    assert len(decoded.header.block_hashes) == 2  # 40 tokens: two full blocks and a tail
    assert torch.equal(decoded.kv, sender.pool.export_tokens(sender.get("r").block_ids, 40))


def test_body_is_received_zero_copy(pair):
    _, receiver, frame = pair
    decoded = decode_frame(frame, receiver.frame_expectation)
    before = decoded.kv.view(torch.uint8).flatten()[-1].item()
    frame[-1] ^= 0xFF  # a write to the receive buffer shows through the tensor: same memory
    assert decoded.kv.view(torch.uint8).flatten()[-1].item() == before ^ 0xFF


def test_wire_overhead_is_small(pair):
    sender, _, frame = pair
    kv_bytes = 40 * sender.layout.kv_bytes_per_token
    assert len(frame) - kv_bytes < 1024


def test_bfloat16_frames_round_trip(tiny):
    bf16 = load_model("tiny", dtype="bfloat16")
    prompt = prompt_of_length(tiny, 20)
    sender = HfEngine(bf16, num_blocks=8)
    sender.add_request("r", prompt, SAMPLING)
    sender.step()
    frame = frame_bytes(sender.export_frames("r")[0])
    decoded = decode_frame(bytearray(frame), sender.frame_expectation)
    assert decoded.header.dtype == "bfloat16"
    assert torch.equal(decoded.kv, sender.pool.export_tokens(sender.get("r").block_ids, 20))


def test_flipped_body_byte_fails_checksum(pair):
    _, receiver, frame = pair
    frame[-100] ^= 0x01
    assert_rejected(receiver, frame, CorruptFrame)


def test_only_an_authenticated_channel_may_skip_the_checksum_and_the_finiteness_check_stays(pair):
    """The bulk channel's TLS path skips xxh3 (TLS authenticates every byte); all else is checked."""
    _, receiver, frame = pair
    header, body = split(frame)
    values = torch.frombuffer(bytearray(body), dtype=torch.float32)
    values[0] = values[0] + 1.0  # another finite value: only the checksum tells
    changed = values.numpy().tobytes()
    assert_rejected(receiver, rebuild(header, changed), CorruptFrame)
    decoded = decode_frame(rebuild(header, changed), receiver.frame_expectation, verify_checksum=False)
    assert decoded.kv.flatten()[0].item() == values[0].item()
    values[1] = float("nan")
    with pytest.raises(CorruptFrame):
        decode_frame(rebuild(header, values.numpy().tobytes()), receiver.frame_expectation, verify_checksum=False)


def test_bad_magic(pair):
    _, receiver, frame = pair
    frame[0:4] = b"XXXX"
    assert_rejected(receiver, frame, CorruptFrame)


@pytest.mark.parametrize("cut", [5, PREFIX_SIZE + 3, 1000])
def test_truncated_frame(pair, cut):
    _, receiver, frame = pair
    assert_rejected(receiver, frame[:-cut] if cut == 1000 else frame[:cut], TruncatedFrame)


def test_trailing_bytes(pair):
    _, receiver, frame = pair
    assert_rejected(receiver, frame + b"\0", CorruptFrame)


def test_garbage_header(pair):
    _, receiver, frame = pair
    _, _, _, header_len, _ = PREFIX.unpack_from(frame)
    frame[PREFIX_SIZE : PREFIX_SIZE + header_len] = b"\xc1" * header_len
    assert_rejected(receiver, frame, CorruptFrame)


def test_oversized_body_rejected_from_prefix_alone(tiny):
    expect = FrameExpectation("f", HfEngine(tiny, num_blocks=1).layout, max_body_bytes=1024)
    prefix = PREFIX.pack(b"PDKV", 1, 0, 100, 1 << 40)
    with pytest.raises(OversizedFrame):
        decode_frame(bytearray(prefix), expect)


def test_oversized_header(pair):
    _, receiver, frame = pair
    struct.pack_into("<I", frame, 8, 1 << 24)
    assert_rejected(receiver, frame, OversizedFrame)


@pytest.mark.parametrize(
    "field,value",
    [
        ("model_fingerprint", "0123456789abcdef"),
        ("num_layers", 3),
        ("num_kv_heads", 4),
        ("head_dim", 8),
        ("block_size", 32),
        ("hash_scheme", 99),
        ("dtype", "int8"),
    ],
)
def test_incompatible_header_fields(pair, field, value):
    _, receiver, frame = pair
    header, body = split(frame)
    assert_rejected(receiver, rebuild(header, body, **{field: value}), IncompatibleFrame)


def test_wrong_model_with_same_shape_is_refused(pair):
    """Another model of identical geometry (different weights) has another fingerprint."""
    other = load_model("tiny")
    object.__setattr__(other, "fingerprint", "ffffffffffffffff")
    _, _, frame = pair
    receiver = HfEngine(other, num_blocks=16)
    with pytest.raises(IncompatibleFrame, match="model_fingerprint"):
        decode_frame(frame, receiver.frame_expectation)


def test_shape_that_disagrees_with_body_length(pair):
    _, receiver, frame = pair
    header, body = split(frame)
    forged = rebuild(header, body, token_ids=header.token_ids[:-1], block_hashes=header.block_hashes)
    assert_rejected(receiver, forged, CorruptFrame)


def test_tampered_token_breaks_hash_chain(pair):
    _, receiver, frame = pair
    header, body = split(frame)
    tokens = list(header.token_ids)
    tokens[3] += 1
    assert_rejected(receiver, rebuild(header, body, token_ids=tokens), CorruptFrame)


def test_frame_for_another_request(pair):
    _, receiver, frame = pair
    header, body = split(frame)
    assert_rejected(receiver, rebuild(header, body, request_id="someone-else"), FrameOwnershipError)


def test_frame_with_consistent_but_foreign_tokens(pair, tiny):
    """A self-consistent frame (hashes recomputed) for other tokens is refused by ownership."""
    sender, receiver, _ = pair
    other_prompt = prompt_of_length(tiny, 40, seed=3)
    sender.add_request("x", other_prompt, SAMPLING)
    sender.step()
    header, body = split(frame_bytes(sender.export_frames("x")[0]))
    assert_rejected(receiver, rebuild(header, body, request_id="r"), FrameOwnershipError)


def test_frame_out_of_order(pair):
    sender, receiver, _ = pair
    second = frame_bytes(sender.export_frames("r", 16, max_tokens_per_frame=16)[0])
    assert_rejected(receiver, bytearray(second), FrameOwnershipError)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_a_frame_with_a_non_finite_value_is_refused_even_with_a_valid_checksum(pair, value):
    """A peer that can authenticate must still not plant NaN or inf KV in a decoder's cache."""
    _, receiver, frame = pair
    header, body = split(frame)
    values = torch.frombuffer(bytearray(body), dtype=torch.float32)
    values[values.numel() // 2] = value
    poisoned = values.numpy().tobytes()
    assert_rejected(receiver, rebuild(header, poisoned, body_xxh3=xxhash.xxh3_64_intdigest(poisoned)), CorruptFrame)


@pytest.mark.parametrize("dtype", sorted(WIRE_DTYPES))
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf"), None])
def test_the_finiteness_check_finds_any_non_finite_value_in_every_wire_dtype(dtype, value):
    values = torch.randn(4099).to(getattr(torch, dtype))
    if value is not None:
        values[2049] = value
    body = memoryview(values.view(torch.uint8).numpy()).cast("B")
    assert values_are_finite(body, dtype) is (value is None)


@pytest.mark.parametrize("where", [0, 0.3, 0.5, -1])
@pytest.mark.parametrize("spoil", ["flip", "nan", "-inf"])
def test_a_large_body_checked_piece_by_piece_is_refused_whichever_piece_is_bad(where, spoil):
    """A 1.5 MiB body spans three of the checks' pieces (``BODY_PIECE_BYTES``): a changed
    byte or a non-finite value in the first, a middle or the last one is found."""
    from shared.kv_layout import KvLayout
    from shared.kv_wire import BODY_PIECE_BYTES, encode_frame

    tokens = 96
    kv = torch.randn(4, 2, tokens, 8, 64)
    expect = FrameExpectation("pieces", KvLayout(4, 8, 64, 16, torch.float32))
    parts = encode_frame(
        kv=kv,
        model_fingerprint="pieces",
        block_size=16,
        request_id="r",
        first_block_index=0,
        parent_hash=0,
        token_ids=list(range(10, 10 + tokens)),
    )
    header, body = split(frame_bytes(parts))
    assert len(body) >= 3 * BODY_PIECE_BYTES
    values = torch.frombuffer(bytearray(body), dtype=torch.float32)
    index = int(where * values.numel()) if where != -1 else values.numel() - 1
    if spoil == "flip":
        spoiled = bytearray(values.numpy().tobytes())
        spoiled[index * 4] ^= 0x01
        frame = rebuild(header, bytes(spoiled))
    else:
        values[index] = float(spoil)
        poisoned = values.numpy().tobytes()
        frame = rebuild(header, poisoned, body_xxh3=xxhash.xxh3_64_intdigest(poisoned))
    with pytest.raises(CorruptFrame):
        decode_frame(frame, expect)
    assert torch.equal(decode_frame(bytearray(frame_bytes(parts)), expect).kv, kv)
