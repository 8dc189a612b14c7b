"""One KV flow striped over several connections, on real sockets: frames imported in the flow's
order whatever connection brought them, a bounded reorder buffer (a sender that skips a frame
is cut off), connections reused across flows, a stream killed mid-flow, and the stream count's
setting and default."""

import asyncio
import socket
import time

import msgspec
import pytest
import torch

from shared import kv_wire
from shared.bulk.auth import new_nonce, sign, verify_key
from shared.bulk.connection import BulkConnection, dial
from shared.bulk.flow_stats import FlowStats
from shared.bulk.framing import control_bytes, read_message
from shared.bulk.path_sizing import default_streams, plan_path, socket_buffer_bytes
from shared.bulk.pool import BulkPool
from shared.bulk.receiver import BulkReceiver
from shared.bulk.sender import FlowRefused, open_flow
from shared.bulk.striped_flow import StripedFlow
from shared.config import PrefillConfig, build_config
from shared.engine.hf_engine import HfEngine
from shared.errors import ConfigError
from shared.messages import FlowAccepted, FlowEnd, FlowJoin, StreamEnd
from tests.helpers import SAMPLING, SECRET, RecordingHandler, flow_open_for, prompt_of_length, until


@pytest.fixture
async def channel(tiny):
    """(sender engine, handler, receiver, endpoint): a plaintext receiver importing into a real engine."""
    sender, receiver_engine = HfEngine(tiny, num_blocks=64), HfEngine(tiny, num_blocks=64)
    handler = RecordingHandler(receiver_engine)
    receiver = BulkReceiver(
        handler, receiver_engine.frame_expectation, verify_key(SECRET), path="wan", frame_timeout_s=5
    )
    host, port = await receiver.start()
    yield sender, handler, receiver, f"{host}:{port}"
    await receiver.stop()


def prefilled(sender: HfEngine, request_id: str, prompt: list[int]) -> int:
    """Prefill ``prompt`` on the sending engine; its first token."""
    sender.add_request(request_id, prompt, SAMPLING)
    return sender.step()[0].token_id


def imported_kv(engine: HfEngine, request_id: str, num_tokens: int) -> torch.Tensor:
    frames = engine.export_frames(request_id, 0, num_tokens, max_tokens_per_frame=num_tokens)
    return torch.cat([kv_wire.decode_frame(kv_wire.frame_bytes(p), engine.frame_expectation).kv for p in frames], 2)


async def test_a_flow_striped_over_three_connections_imports_exactly_what_was_sent(channel, tiny):
    sender, handler, receiver, endpoint = channel
    prompt = prompt_of_length(tiny, 150)
    first = prefilled(sender, "r", prompt)
    flow = await open_flow(endpoint, flow_open_for("r", prompt), SECRET, path="wan", timeout_s=5, streams=3)
    assert flow.streams == 3 and receiver.num_connections == 3
    for parts in sender.export_frames("r", 0, len(prompt), max_tokens_per_frame=16):  # 10 frames
        await flow.send_frame(parts)
    await flow.end([first])
    await asyncio.wait_for(handler.ended.wait(), 5)
    assert handler.events == [("open", "r"), *[("frame", "r")] * 10, ("end", "r")]
    assert torch.equal(imported_kv(handler.engine, "r", 150), imported_kv(sender, "r", 150))


async def raw_flow(endpoint: str, prompt: list[int], streams: int):
    """A hand-driven striped flow: the lead's (reader, writer), its FlowOpen's nonce, and one
    joined (reader, writer) per further stream, each past its answer."""
    host, port = endpoint.rsplit(":", 1)
    lead = await asyncio.open_connection(host, int(port))
    opening = msgspec.structs.replace(
        flow_open_for("r", prompt), unix_s=time.time(), nonce=new_nonce(), streams=streams
    )
    lead[1].write(control_bytes(sign(opening, SECRET)))
    assert isinstance((await asyncio.wait_for(read_message(lead[0], None), 5))[0], FlowAccepted)
    joined = []
    for stream in range(1, streams):
        reader, writer = await asyncio.open_connection(host, int(port))
        join = FlowJoin(
            request_id="r",
            flow_nonce=opening.nonce,
            stream=stream,
            sender_id="test",
            unix_s=time.time(),
            nonce=new_nonce(),
        )
        writer.write(control_bytes(sign(join, SECRET)))
        assert isinstance((await asyncio.wait_for(read_message(reader, None), 5))[0], FlowAccepted)
        joined.append((reader, writer))
    return lead, opening.nonce, joined


async def test_frames_that_arrive_out_of_order_across_streams_are_imported_in_order(channel, tiny):
    sender, handler, receiver, endpoint = channel
    prompt = prompt_of_length(tiny, 32)
    first = prefilled(sender, "r", prompt)
    frames = [kv_wire.frame_bytes(p) for p in sender.export_frames("r", 0, 32, max_tokens_per_frame=16)]
    lead, nonce, [(_, join)] = await raw_flow(endpoint, prompt, streams=2)
    join.write(frames[1] + control_bytes(StreamEnd(request_id="r")))  # the second frame comes first
    await until(lambda: len(receiver._flows[nonce]._waiting) == 1, 5, "the second frame to wait for the first")
    assert handler.events == [("open", "r")]
    lead[1].write(frames[0] + control_bytes(FlowEnd(request_id="r", output_token_ids=[first])))
    await asyncio.wait_for(handler.ended.wait(), 5)  # the engine refuses a frame out of order: none was
    assert handler.events == [("open", "r"), ("frame", "r"), ("frame", "r"), ("end", "r")]
    assert torch.equal(imported_kv(handler.engine, "r", 32), imported_kv(sender, "r", 32))


async def test_a_frame_given_its_turn_as_every_other_stream_brings_a_later_one_is_not_taken_for_missing(channel, tiny):
    """Frames 1 and 2 wait on streams 1 and 2; frame 0 is imported, and stream 0's next frame
    (3) arrives before frame 1's reader has run again: every stream now holds a waiting frame,
    but frame 1 has its turn, so the flow goes on (it was failed as out of order)."""
    sender, *_ = channel
    prompt = prompt_of_length(tiny, 64)
    prefilled(sender, "r", prompt)
    exported = sender.export_frames("r", 0, 64, max_tokens_per_frame=16)
    headers = [kv_wire.decode_frame(kv_wire.frame_bytes(p), sender.frame_expectation).header for p in exported]
    ends = socket.socketpair()
    lead = BulkConnection(ends[0], 5)
    flow = StripedFlow(msgspec.structs.replace(flow_open_for("r", prompt), streams=3), lead, 0, FlowStats())

    async def stream(header):
        await flow.turn(header, 5)
        flow.imported(header, 1)

    others = [asyncio.create_task(stream(headers[i])) for i in (1, 2)]
    await until(lambda: len(flow._waiting) == 2, 5, "frames 1 and 2 to wait for frame 0")
    flow.imported(headers[0], 1)
    await stream(headers[3])  # runs in this task at once: frame 1's reader has not run yet
    await asyncio.gather(*others)
    assert flow.failure is None and flow.stats.frames == 4
    lead.close()
    ends[1].close()


async def test_a_sender_that_skips_a_frame_is_cut_off_at_once_and_nothing_piles_up(channel, tiny):
    """Every stream holds a frame that must wait for the missing one: the reorder buffer would
    only grow, so the flow ends now (not at a timeout) and its KV is freed."""
    sender, handler, _receiver, endpoint = channel
    prompt = prompt_of_length(tiny, 48)
    prefilled(sender, "r", prompt)
    frames = [kv_wire.frame_bytes(p) for p in sender.export_frames("r", 0, 48, max_tokens_per_frame=16)]
    lead, _, [(join_reader, join)] = await raw_flow(endpoint, prompt, streams=2)
    lead[1].write(frames[1])
    join.write(frames[2])  # frames[0] never comes
    await asyncio.wait_for(handler.aborted.wait(), 3)
    assert handler.events[-1][1].startswith("frames out of order") and handler.engine.num_sequences == 0
    assert await asyncio.wait_for(join_reader.read(), 5) == b""  # the stream is closed too


async def test_a_flow_asking_for_too_many_streams_is_refused(channel, tiny):
    _, handler, _, endpoint = channel
    with pytest.raises(ValueError, match="streams"):
        await open_flow(endpoint, flow_open_for("r", [1, 2, 3]), SECRET, path="wan", timeout_s=5, streams=9)
    host, port = endpoint.rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    opening = msgspec.structs.replace(flow_open_for("r", [1, 2, 3]), unix_s=time.time(), nonce=new_nonce(), streams=9)
    writer.write(control_bytes(sign(opening, SECRET)))
    reply, _ = await asyncio.wait_for(read_message(reader, None), 5)
    assert reply.code == "bad_streams" and handler.events == []
    writer.close()


async def test_connections_are_reused_by_the_next_flow_and_each_flow_authenticates_again(channel, tiny):
    sender, handler, receiver, endpoint = channel
    pool = BulkPool()
    try:
        for request_id in ("a", "b"):
            prompt = prompt_of_length(tiny, 64, seed=len(request_id) + ord(request_id))
            first = prefilled(sender, request_id, prompt)
            handler.ended.clear()
            flow = await open_flow(
                endpoint, flow_open_for(request_id, prompt), SECRET, path="wan", timeout_s=5, streams=2, pool=pool
            )
            for parts in sender.export_frames(request_id, flow.first_token_index, 64, max_tokens_per_frame=16):
                await flow.send_frame(parts)
            await flow.end([first])
            await asyncio.wait_for(handler.ended.wait(), 5)
        assert pool.reused == 2 and pool.num_idle == 2 and receiver.num_connections == 2
        assert [e for e in handler.events if e[0] != "frame"] == [
            ("open", "a"),
            ("end", "a"),
            ("open", "b"),
            ("end", "b"),
        ]
        with pytest.raises(FlowRefused, match="flow signing key"):  # a reused connection is no credential
            await open_flow(endpoint, flow_open_for("c", [1, 2]), "not-the-secret", path="wan", timeout_s=5, pool=pool)
    finally:
        pool.close()


async def test_a_burst_of_flows_finds_the_last_bursts_connections_open(channel, tiny):
    """A round of requests arriving together opens many flows at once; the next such round
    reuses every connection the last one left, instead of a TCP and TLS handshake per flow on
    both ends in the middle of the burst."""
    sender, handler, receiver, endpoint = channel
    pool, burst = BulkPool(), 24  # more than a few: every flow of a burst needs its own connection

    async def one_flow(request_id: str, prompt: list[int], first: int):
        flow = await open_flow(endpoint, flow_open_for(request_id, prompt), SECRET, path="wan", timeout_s=5, pool=pool)
        for parts in sender.export_frames(request_id, flow.first_token_index, len(prompt), max_tokens_per_frame=16):
            await flow.send_frame(parts)
        await flow.end([first])
        sender.free(request_id)

    try:
        for round_index in range(2):
            ids = [f"r{round_index}-{i}" for i in range(burst)]
            prompts = [[100 + round_index, 200 + i, *range(300, 314)] for i in range(burst)]  # distinct blocks
            for request_id, prompt in zip(ids, prompts):
                sender.add_request(request_id, prompt, SAMPLING)
            first_of = {output.request_id: output.token_id for output in sender.step()}
            firsts = [first_of[request_id] for request_id in ids]
            await asyncio.gather(*(one_flow(*args) for args in zip(ids, prompts, firsts)))
            ends = burst * (round_index + 1)
            await until(lambda ends=ends: sum(e[0] == "end" for e in handler.events) == ends, 5, "every flow's end")
        assert pool.reused == burst and pool.num_idle == burst and receiver.num_connections == burst
    finally:
        pool.close()


async def test_a_pooled_connection_still_sending_an_earlier_flow_is_not_handed_out():
    """A flow's end is written long before a slow path carries its last bytes: a flow opened on
    that connection would reach the receiver only after them. It dials anew meanwhile, and the
    connection serves again once its bytes have left."""
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a receiver far slower than the sender
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    pool, peer = BulkPool(), "far-receiver"
    connection = await dial("127.0.0.1", listener.getsockname()[1], 5, buffer_bytes=1 << 20)
    far_end, _ = listener.accept()
    try:
        await connection.send([b"k" * (512 << 10)])  # the kernel holds it all: the flow has "ended"
        pool.give(peer, connection)
        assert connection.unsent_bytes() > 0
        assert pool.take(peer) is None and pool.num_idle == 1
        received = 0
        while received < 512 << 10:
            received += len(await asyncio.to_thread(far_end.recv, 1 << 20))
        await until(lambda: connection.unsent_bytes() == 0, 5, "the last bytes to be acknowledged")
        assert pool.take(peer) is connection and connection.reused
    finally:
        pool.close()
        connection.close()
        far_end.close()
        listener.close()


async def test_a_stream_killed_mid_flow_fails_the_flow_on_both_sides_and_leaks_nothing(channel, tiny):
    sender, handler, receiver, endpoint = channel
    pool = BulkPool()
    prompt = prompt_of_length(tiny, 96)
    prefilled(sender, "r", prompt)
    frames = sender.export_frames("r", 0, 96, max_tokens_per_frame=16)
    flow = await open_flow(endpoint, flow_open_for("r", prompt), SECRET, path="wan", timeout_s=5, streams=2, pool=pool)
    await flow.send_frame(frames[0])
    await flow.send_frame(frames[1])
    flow._streams[1].close()  # the second connection dies mid-flow
    with pytest.raises((ConnectionError, OSError)):
        for parts in frames[2:]:
            await flow.send_frame(parts)
        await flow.end([1])
    await asyncio.wait_for(handler.aborted.wait(), 5)
    assert handler.engine.num_sequences == 0 and handler.engine.blocks.num_used_blocks == 0
    await until(lambda: receiver.num_connections == 0, 5, "the flow's connections to close")
    assert pool.num_idle == 0 and not receiver._flows


def test_the_stream_count_defaults_to_the_paths_bandwidth_delay_product():
    four_mib = 4 << 20
    assert default_streams(1e9, 40, four_mib) == 2  # 5 MB in flight over 4 MiB windows
    assert default_streams(100e6, 40, four_mib) == 1
    assert default_streams(100e9, 40, four_mib) == 8  # capped
    assert socket_buffer_bytes(1e9, 40, 2, four_mib) == 2_500_000  # each stream's share of the BDP
    assert socket_buffer_bytes(100e9, 40, 8, four_mib) == four_mib  # never above the kernel's limit
    assert plan_path(0, 0).streams == 1 and plan_path(0, 0).buffer_bytes == 0  # one site: autotuned


@pytest.mark.parametrize("value", ["9", "-1", "two"])
def test_a_bad_stream_count_is_refused_naming_the_setting(value):
    with pytest.raises(ConfigError, match="PDD_BULK_STREAMS"):
        build_config(PrefillConfig, {}, {"PDD_BULK_STREAMS": value})
