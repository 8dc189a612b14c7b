"""The bulk channel's zero-copy path: frames read straight into one buffer however TCP splits
them, sizes bounded before any allocation, no Python copy of KV bytes, back-pressure, a
cancelled send, timeouts and stopping mid-frame."""

import asyncio
import itertools
import random
import socket
import threading
import time
import tracemalloc
from pathlib import Path

import msgspec
import pytest
import torch

from shared import kv_wire
from shared.bulk import framing
from shared.bulk import sender as sender_module
from shared.bulk.auth import new_nonce, sign, verify_key
from shared.bulk.framing import control_bytes, read_message, recv_message, send_buffers
from shared.bulk.receiver import BulkReceiver
from shared.bulk.sender import open_flow
from shared.errors import OversizedFrame
from shared.kv_layout import KvLayout
from shared.messages import FlowAccepted, FlowEnd
from tests.helpers import SECRET, flow_open_for, until

FINGERPRINT = "zero-copy-test"


def expectation(num_layers=2, num_kv_heads=2, head_dim=16) -> kv_wire.FrameExpectation:
    return kv_wire.FrameExpectation(FINGERPRINT, KvLayout(num_layers, num_kv_heads, head_dim, 16, torch.float32))


def frames_of(expect: kv_wire.FrameExpectation, num_tokens: int, frame_tokens: int, request_id: str = "r"):
    """(prompt, kv, frames) of random KV in ``expect``'s layout."""
    layout = expect.layout
    kv = torch.randn(layout.num_layers, 2, num_tokens, layout.num_kv_heads, layout.head_dim)
    prompt = [10 + i for i in range(num_tokens)]
    frames = kv_wire.encode_frames(
        lambda start, end: kv[:, :, start:end],
        prompt,
        0,
        num_tokens,
        block_size=16,
        model_fingerprint=FINGERPRINT,
        request_id=request_id,
        max_tokens_per_frame=frame_tokens,
    )
    return prompt, kv, frames


class SegmentedSocket:
    """Hands out ``data`` cut at ``cuts``: one recv_into never crosses a cut, as a receiver sees
    TCP segments arrive one by one."""

    def __init__(self, data: bytes, cuts: list[int]):
        bounds = [0, *sorted(set(cuts)), len(data)]
        self.pieces = [memoryview(data)[a:b] for a, b in itertools.pairwise(bounds) if b > a]

    def recv_into(self, view) -> int:
        if not self.pieces:
            return 0
        piece = self.pieces[0]
        count = min(len(view), len(piece))
        view[:count] = piece[:count]
        self.pieces[0] = piece[count:]
        if not len(self.pieces[0]):
            self.pieces.pop(0)
        return count


def test_a_frame_split_at_every_byte_boundary_arrives_whole():
    expect = expectation()
    _, kv, frames = frames_of(expect, 3, 16)
    end = FlowEnd(request_id="r", output_token_ids=[7])
    stream = control_bytes(end) + kv_wire.frame_bytes(frames[0]) + control_bytes(end)
    splits = [[cut] for cut in range(1, len(stream))]
    rng = random.Random(0)
    splits += [rng.sample(range(1, len(stream)), 12) for _ in range(100)]
    for cuts in splits:
        sock = SegmentedSocket(stream, cuts)
        assert recv_message(sock, expect)[0] == end
        frame, size = recv_message(sock, expect)
        assert size == len(kv_wire.frame_bytes(frames[0])) and torch.equal(frame.kv, kv)
        assert recv_message(sock, expect)[0] == end
        assert recv_message(sock, expect) == (None, 0)


@pytest.mark.parametrize("request_id", ["r", "rr", "rrr", "rrrr"])
def test_a_received_frame_body_starts_on_a_cache_line_whatever_the_header_length(request_id):
    expect = expectation()
    _, kv, frames = frames_of(expect, 3, 16, request_id=request_id)
    frame, _ = recv_message(SegmentedSocket(kv_wire.frame_bytes(frames[0]), []), expect)
    assert frame.kv.data_ptr() % framing.BODY_ALIGNMENT == 0 and torch.equal(frame.kv, kv)


@pytest.mark.parametrize("field", ["header", "body"])
def test_a_huge_frame_is_refused_before_its_buffer_is_allocated(field, monkeypatch):
    expect = expectation()
    header_len, body_len = (kv_wire.MAX_HEADER_BYTES + 1, 64) if field == "header" else (64, expect.max_body_bytes + 1)
    prefix = kv_wire.PREFIX.pack(kv_wire.MAGIC, kv_wire.WIRE_FORMAT_VERSION, 0, header_len, body_len)
    allocated = []
    monkeypatch.setattr(framing, "frame_buffer", lambda n, *_: allocated.append(n) or memoryview(bytearray(n)))
    with pytest.raises(OversizedFrame):
        recv_message(SegmentedSocket(prefix, []), expect)
    assert allocated == []


class FakeSender:
    """Takes at most ``limit`` random bytes per ``sendmsg`` call (a socket whose buffer fills)."""

    def __init__(self, seed: int):
        self.rng, self.received = random.Random(seed), bytearray()

    def sendmsg(self, views) -> int:
        budget = self.rng.randint(1, 700)
        taken = 0
        for view in views:
            part = bytes(view[: budget - taken])
            self.received += part
            taken += len(part)
            if taken == budget:
                break
        return taken


@pytest.mark.parametrize("seed", range(20))
def test_partial_scatter_gather_sends_resume_where_they_stopped(seed):
    parts = [b"head", memoryview(bytes(range(256)) * 9), b"", memoryview(b"tail")]
    sink = FakeSender(seed)
    assert send_buffers(sink, parts) == 4 + 256 * 9 + 4
    assert bytes(sink.received) == b"".join(bytes(p) for p in parts)


def test_a_frame_is_sent_and_received_without_a_python_copy():
    """Sending allocates nothing the size of the body; receiving allocates the frame's one
    buffer (the old stream path held two or three copies)."""
    expect = expectation(8, 8, 64)  # 32 KiB per token
    _, kv, frames = frames_of(expect, 256, 256)
    parts = frames[0]
    size = sum(memoryview(p).nbytes for p in parts)
    sending, receiving = socket.socketpair()
    for end in (sending, receiving):
        end.settimeout(30)
    try:
        sink = memoryview(bytearray(size))
        drain = threading.Thread(target=lambda: framing._recv_into(receiving, sink))
        tracemalloc.start()
        try:
            drain.start()
            send_buffers(sending, parts)
            drain.join(30)
            send_peak = tracemalloc.get_traced_memory()[1]
            tracemalloc.reset_peak()
            feed = threading.Thread(target=lambda: send_buffers(sending, parts))
            feed.start()
            frame, _ = recv_message(receiving, expect)
            feed.join(30)
            receive_peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert bytes(sink) == kv_wire.frame_bytes(parts) and torch.equal(frame.kv, kv)
        assert send_peak < size // 10, (send_peak, size)
        assert receive_peak < size * 1.1, (receive_peak, size)
    finally:
        sending.close()
        receiving.close()


class Gated:
    """A FlowHandler that keeps validated frames and, while ``gate`` is clear, holds the first
    import (the receiver then stops reading)."""

    def __init__(self):
        self.frames, self.aborts = [], []
        self.gate, self.holding = asyncio.Event(), asyncio.Event()
        self.gate.set()
        self.ended, self.aborted = asyncio.Event(), asyncio.Event()

    async def open_flow(self, flow_open, stats):
        return 0

    async def import_frame(self, request_id, frame):
        self.frames.append(frame)
        self.holding.set()
        await self.gate.wait()

    async def end_flow(self, request_id, end, stats):
        self.ended.set()

    async def abort_flow(self, request_id, reason):
        self.aborts.append(reason)
        self.aborted.set()


@pytest.fixture
async def gated():
    """A plaintext receiver for the small test layout: (handler, receiver, endpoint)."""
    handler, receivers = Gated(), []

    async def start(frame_timeout_s=10.0, expect=None):
        receiver = BulkReceiver(
            handler, expect or expectation(), verify_key(SECRET), path="local", frame_timeout_s=frame_timeout_s
        )
        receivers.append(receiver)
        host, port = await receiver.start()
        return receiver, f"{host}:{port}"

    yield handler, start
    for receiver in receivers:
        await receiver.stop()


async def authenticated(endpoint: str, prompt: list[int]):
    """A raw stream past FlowAccepted: (reader, writer)."""
    host, port = endpoint.rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    fresh = msgspec.structs.replace(flow_open_for("r", prompt), unix_s=time.time(), nonce=new_nonce())
    writer.write(control_bytes(sign(fresh, SECRET)))
    reply, _ = await asyncio.wait_for(read_message(reader, None), 5)
    assert isinstance(reply, FlowAccepted)
    return reader, writer


async def test_a_frame_sent_one_byte_per_segment_arrives_whole(gated):
    handler, start = gated
    _, endpoint = await start()
    prompt, kv, frames = frames_of(expectation(), 3, 16)
    _, writer = await authenticated(endpoint, prompt)
    for byte in kv_wire.frame_bytes(frames[0]) + control_bytes(FlowEnd(request_id="r", output_token_ids=[1])):
        writer.write(bytes([byte]))  # TCP_NODELAY (asyncio's default): one segment each
        await writer.drain()
    await asyncio.wait_for(handler.ended.wait(), 10)
    assert len(handler.frames) == 1 and torch.equal(handler.frames[0].kv, kv)
    writer.close()


async def test_a_peer_announcing_a_huge_frame_is_dropped_before_the_memory_is_allocated(gated, monkeypatch):
    handler, start = gated
    expect = expectation()
    _, endpoint = await start(expect=expect)
    allocated = []
    monkeypatch.setattr(framing, "frame_buffer", lambda n, *_: allocated.append(n) or memoryview(bytearray(n)))
    reader, writer = await authenticated(endpoint, [1, 2, 3])
    writer.write(kv_wire.PREFIX.pack(kv_wire.MAGIC, kv_wire.WIRE_FORMAT_VERSION, 0, 64, expect.max_body_bytes + 1))
    await writer.drain()
    await asyncio.wait_for(handler.aborted.wait(), 10)
    assert handler.aborts[0].startswith("kv_frame_oversized") and allocated == []
    assert await asyncio.wait_for(reader.read(), 10) == b""  # dropped
    writer.close()


def socket_buffer_bound() -> int:
    """Most bytes the kernel may buffer for one loopback connection (send + receive side)."""
    try:
        wmem = int(Path("/proc/sys/net/ipv4/tcp_wmem").read_text().split()[2])
        rmem = int(Path("/proc/sys/net/ipv4/tcp_rmem").read_text().split()[2])
    except (OSError, IndexError, ValueError):
        return 64 << 20
    return wmem + rmem


async def test_a_receiver_that_stops_reading_stalls_the_sender_within_the_socket_buffers(gated):
    handler, start = gated
    _, endpoint = await start()
    prompt, _, frames = frames_of(expectation(), 1024, 256)  # 128 KiB frames
    frame_size = len(kv_wire.frame_bytes(frames[0]))
    bound = socket_buffer_bound() + 2 * frame_size  # the frame held in import, one read ahead
    count = 2 * bound // frame_size + 1
    handler.gate.clear()
    flow = await open_flow(endpoint, flow_open_for("r", prompt), SECRET, path="local", timeout_s=5)

    async def send_all():
        for i in range(count):
            await flow.send_frame(frames[i % len(frames)])
        await flow.end([1])

    sending = asyncio.create_task(send_all())
    await asyncio.wait_for(handler.holding.wait(), 10)
    done, _ = await asyncio.wait({sending}, timeout=2)
    assert not done and flow.bytes_sent <= bound, (flow.bytes_sent, bound)
    handler.gate.set()
    await asyncio.wait_for(sending, 60)
    await asyncio.wait_for(handler.ended.wait(), 60)
    assert len(handler.frames) == count


def recording_buffers(monkeypatch) -> list[int]:
    """The sizes of the frame buffers the receiver allocates (one per frame it starts reading)."""
    allocated, allocate = [], framing.frame_buffer
    monkeypatch.setattr(framing, "frame_buffer", lambda n, *rest: allocated.append(n) or allocate(n, *rest))
    return allocated


async def test_the_receiver_reads_one_frame_ahead_while_a_frame_is_imported(gated, monkeypatch):
    handler, start = gated
    _, endpoint = await start()
    allocated = recording_buffers(monkeypatch)
    prompt, kv, frames = frames_of(expectation(), 64, 16)  # four frames
    handler.gate.clear()
    flow = await open_flow(endpoint, flow_open_for("r", prompt), SECRET, path="local", timeout_s=5)
    for parts in frames:
        await flow.send_frame(parts)
    await flow.end([1])
    await asyncio.wait_for(handler.holding.wait(), 10)  # frame 0 is being imported
    await until(lambda: len(allocated) == 2, 10, "frame 1 to be read while frame 0 is imported")
    await asyncio.sleep(0.2)
    assert len(allocated) == 2 and not handler.ended.is_set()  # one ahead, no more; the end waits
    handler.gate.set()
    await asyncio.wait_for(handler.ended.wait(), 10)
    assert torch.equal(torch.cat([frame.kv for frame in handler.frames], dim=2), kv)


async def test_a_corrupt_frame_read_ahead_is_refused_and_nothing_after_it_imported(gated):
    handler, start = gated
    _, endpoint = await start()
    prompt, _, frames = frames_of(expectation(), 48, 16)
    corrupt = bytearray(kv_wire.frame_bytes(frames[1]))
    corrupt[-5] ^= 0x01  # a finite value still: only the checksum finds it
    handler.gate.clear()
    _, writer = await authenticated(endpoint, prompt)
    end = control_bytes(FlowEnd(request_id="r", output_token_ids=[1]))
    writer.write(kv_wire.frame_bytes(frames[0]) + corrupt + kv_wire.frame_bytes(frames[2]) + end)
    await writer.drain()
    await asyncio.wait_for(handler.holding.wait(), 10)
    handler.gate.set()
    await asyncio.wait_for(handler.aborted.wait(), 10)
    assert len(handler.frames) == 1 and handler.aborts[0].startswith("kv_frame_corrupt")
    assert not handler.ended.is_set()
    writer.close()


async def test_a_frame_whose_send_is_cancelled_still_arrives_whole_before_the_cancel(gated, monkeypatch):
    monkeypatch.setattr(sender_module, "CANCEL_TIMEOUT_S", 30.0)
    handler, start = gated
    expect = expectation(8, 8, 64)
    _, endpoint = await start(expect=expect)
    prompt, _, frames = frames_of(expect, 1024, 256)  # 8 MiB frames: more than the socket takes at once
    handler.gate.clear()
    flow = await open_flow(endpoint, flow_open_for("r", prompt), SECRET, path="local", timeout_s=5)
    await flow.send_frame(frames[0])
    await asyncio.wait_for(handler.holding.wait(), 10)  # the receiver stopped reading
    taken = 0
    for parts in itertools.cycle(frames):  # until the sockets' buffers are full
        stalled = asyncio.create_task(flow.send_frame(parts))
        done, _ = await asyncio.wait({stalled}, timeout=1)
        if not done:
            break
        taken += 1
        assert taken * len(kv_wire.frame_bytes(parts)) < 2 * socket_buffer_bound()
    stalled.cancel()
    cancelling = asyncio.create_task(flow.cancel("request ended"))
    handler.gate.set()
    await asyncio.wait_for(cancelling, 60)
    await asyncio.wait_for(handler.aborted.wait(), 30)
    assert len(handler.frames) == 2 + taken and handler.aborts == ["cancelled by sender: request ended"]


async def test_a_peer_silent_mid_frame_is_dropped_after_the_frame_timeout(gated):
    handler, start = gated
    _, endpoint = await start(frame_timeout_s=1.0)
    prompt, _, frames = frames_of(expectation(), 16, 16)
    reader, writer = await authenticated(endpoint, prompt)
    whole = kv_wire.frame_bytes(frames[0])
    writer.write(whole[: len(whole) // 2])
    await writer.drain()
    await asyncio.wait_for(handler.aborted.wait(), 10)
    assert handler.aborts == ["no data for 1 s"] and handler.frames == []
    assert await asyncio.wait_for(reader.read(), 10) == b""
    writer.close()


def bulk_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("bulk-")}


async def test_stopping_mid_frame_aborts_the_flow_and_ends_its_thread(gated):
    handler, start = gated
    earlier = bulk_threads()
    receiver, endpoint = await start()
    prompt, _, frames = frames_of(expectation(), 16, 16)
    flow = await open_flow(endpoint, flow_open_for("r", prompt), SECRET, path="local", timeout_s=5)
    await flow._connection.send([kv_wire.frame_bytes(frames[0])[:100]])
    await until(lambda: any(t.name.startswith("bulk-recv") for t in bulk_threads() - earlier), 5, "its thread")
    await asyncio.wait_for(receiver.stop(), 10)
    assert handler.aborts == ["receiver stopping"]
    await flow.close()
    await until(lambda: not bulk_threads() - earlier, 10, "the connections' threads to end")
