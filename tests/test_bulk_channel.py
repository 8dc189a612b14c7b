"""The bulk KV channel on real sockets: authentication, replay protection, cancel, bad bytes."""

import asyncio
import time

import msgspec
import pytest

from shared.bulk.auth import new_nonce, sign, verify_key
from shared.bulk.framing import control_bytes, read_message
from shared.bulk.receiver import BulkReceiver
from shared.bulk.sender import FlowRefused, open_flow
from shared.engine.hf_engine import HfEngine
from shared.messages import FlowAccepted, FlowRejected
from tests.helpers import SAMPLING, SECRET, RecordingHandler, flow_open_for, prompt_of_length, until


@pytest.fixture
async def channel(tiny):
    sender, receiver_engine = HfEngine(tiny, num_blocks=32), HfEngine(tiny, num_blocks=32)
    handler = RecordingHandler(receiver_engine)
    receiver = BulkReceiver(
        handler, receiver_engine.frame_expectation, verify_key(SECRET), path="wan", frame_timeout_s=5
    )
    host, port = await receiver.start()
    yield sender, handler, f"{host}:{port}"
    await receiver.stop()


async def test_a_flow_delivers_kv_and_counts_bytes(channel, tiny):
    sender, handler, endpoint = channel
    prompt = prompt_of_length(tiny, 70)
    sender.add_request("r", prompt, SAMPLING)
    first = sender.step()[0].token_id
    flow = await open_flow(endpoint, flow_open_for("r", prompt), SECRET, path="wan", timeout_s=5)
    frames = sender.export_frames("r", flow.first_token_index, len(prompt), max_tokens_per_frame=32)
    for parts in frames:
        await flow.send_frame(parts)
    await flow.end([first])
    await asyncio.wait_for(handler.ended.wait(), 5)
    assert handler.events == [("open", "r"), ("frame", "r"), ("frame", "r"), ("frame", "r"), ("end", "r")]
    assert flow.bytes_sent > 70 * sender.layout.kv_bytes_per_token
    assert handler.engine.get("r").num_imported_tokens == 70


async def test_wrong_secret_is_refused_before_anything_is_imported(channel, tiny):
    _, handler, endpoint = channel
    with pytest.raises(FlowRefused, match="flow signing key"):
        await open_flow(endpoint, flow_open_for("r", [1, 2, 3]), "not-the-secret", path="wan", timeout_s=5)
    assert handler.events == []


async def test_replayed_flow_open_is_refused(channel):
    _, _handler, endpoint = channel
    fresh = msgspec.structs.replace(flow_open_for("r", [1, 2, 3]), unix_s=time.time(), nonce=new_nonce())
    signed = sign(fresh, SECRET)
    answers = []
    for _ in range(2):
        host, port = endpoint.rsplit(":", 1)
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(control_bytes(signed))
        answers.append((await read_message(reader, None))[0])
        writer.close()
    assert isinstance(answers[0], FlowAccepted)
    assert isinstance(answers[1], FlowRejected) and "replayed" in answers[1].message


async def test_receiver_refusal_reaches_the_sender(channel):
    _, _, endpoint = channel
    with pytest.raises(FlowRefused, match="refused on purpose"):
        await open_flow(endpoint, flow_open_for("refuse-me", [1, 2, 3]), SECRET, path="wan", timeout_s=5)


async def test_cancel_mid_flow_discards_partial_kv(channel, tiny):
    sender, handler, endpoint = channel
    prompt = prompt_of_length(tiny, 70)
    sender.add_request("r", prompt, SAMPLING)
    sender.step()
    flow = await open_flow(endpoint, flow_open_for("r", prompt), SECRET, path="wan", timeout_s=5)
    frames = sender.export_frames("r", 0, len(prompt), max_tokens_per_frame=32)
    await flow.send_frame(frames[0])
    await flow.cancel("odd traffic finished on the relay")
    await asyncio.wait_for(handler.aborted.wait(), 5)
    assert handler.events[-1] == ("abort", "cancelled by sender: odd traffic finished on the relay")
    assert handler.engine.num_sequences == 0 and handler.engine.blocks.num_used_blocks == 0


async def test_garbage_bytes_drop_the_connection(channel, tiny):
    _sender, handler, endpoint = channel
    prompt = prompt_of_length(tiny, 20)
    await open_flow(endpoint, flow_open_for("r", prompt), SECRET, path="wan", timeout_s=5)
    flow = await open_flow(endpoint, flow_open_for("g", prompt), SECRET, path="wan", timeout_s=5)
    await flow._connection.send([b"XXXX" + b"\0" * 64])
    await until(
        lambda: ("abort", "kv_frame_corrupt: unexpected message magic b'XXXX'") in handler.events,
        5,
        "the receiver to drop the flow",
    )
    assert not handler.engine.holds("g")


@pytest.mark.parametrize(("sender_site", "counted_as"), [("site-a", "local"), ("site-b", "wan")])
async def test_a_main_decoder_counts_bytes_by_the_network_they_came_over(tiny, sender_site, counted_as):
    """``pdd_kv_bytes_total{direction="received"}`` at a main decoder at site A (its listener is
    the WAN path's): a prefill beside it sends over the local network, one at site B over the WAN."""
    from prometheus_client import REGISTRY

    sender, receiver_engine = HfEngine(tiny, num_blocks=32), HfEngine(tiny, num_blocks=32)
    handler = RecordingHandler(receiver_engine)
    receiver = BulkReceiver(
        handler, receiver_engine.frame_expectation, verify_key(SECRET), path="wan", frame_timeout_s=5, site="site-a"
    )
    host, port = await receiver.start()

    def counted() -> dict[str, float]:
        return {
            p: REGISTRY.get_sample_value("pdd_kv_bytes_total", {"path": p, "direction": "received"}) or 0.0
            for p in ("wan", "local")
        }

    try:
        prompt = prompt_of_length(tiny, 40)
        sender.add_request("r", prompt, SAMPLING)
        first = sender.step()[0].token_id
        before = counted()
        flow_open = msgspec.structs.replace(flow_open_for("r", prompt), sender_site=sender_site)
        flow = await open_flow(f"{host}:{port}", flow_open, SECRET, path=counted_as, timeout_s=5)
        for parts in sender.export_frames("r", flow.first_token_index, len(prompt), max_tokens_per_frame=32):
            await flow.send_frame(parts)
        await flow.end([first])
        await asyncio.wait_for(handler.ended.wait(), 5)
        after = counted()
    finally:
        await receiver.stop()
    other = "wan" if counted_as == "local" else "local"
    assert after[counted_as] - before[counted_as] >= 40 * sender.layout.kv_bytes_per_token
    assert after[other] == before[other]
