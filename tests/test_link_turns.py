"""A sender's flows across one link go shortest-remaining-first: on real sockets through the
WAN link emulator, the flow with less left lands in about its own transfer time instead of
sharing the link with the others; a flow whose next KV is not ready holds nothing up."""

import asyncio

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from infra.wan_link import LinkProfile, Route, WanLink
from shared import kv_wire
from shared.bulk.auth import verify_key
from shared.bulk.link_route import route_key
from shared.bulk.link_turns import LinkTurns, pieces
from shared.bulk.receiver import BulkReceiver
from shared.bulk.sender import open_flow
from shared.engine.hf_engine import HfEngine
from tests.helpers import SAMPLING, SECRET, RecordingHandler, flow_open_for, prompt_of_length


@settings(max_examples=100, deadline=None, derandomize=True)
@given(sizes=st.lists(st.integers(0, 50), max_size=6), piece_bytes=st.integers(1, 40))
def test_pieces_cut_the_buffers_in_order_without_copying_and_within_the_size(sizes, piece_bytes):
    parts = [bytes(range(i, i + size)) for i, size in enumerate(sizes)]
    cut = pieces(parts, piece_bytes)
    assert b"".join(bytes(view) for piece in cut for view in piece) == b"".join(parts)
    assert all(sum(len(view) for view in piece) <= piece_bytes for piece in cut)
    assert sum(1 for piece in cut if piece) == -(-sum(sizes) // piece_bytes)  # as few as fit
    assert all(view.obj in parts for piece in cut for view in piece)  # views of the buffers


async def test_the_flow_with_less_left_goes_first_and_one_with_nothing_ready_holds_nothing_up():
    turns = LinkTurns()
    cold, warm = turns.open(), turns.open()
    entered: list[str] = []
    cold_piece_sent, warm_piece_sent = asyncio.Event(), asyncio.Event()

    async def send(flow, name: str, tokens_left: int, hold: asyncio.Event | None = None):
        turns.hold(flow, tokens_left)
        async with turns.turn(flow):
            entered.append(name)
            if hold is not None:
                await hold.wait()
        turns.let_go(flow)  # its next KV is not ready yet

    cold_piece = asyncio.create_task(send(cold, "cold", 800, cold_piece_sent))
    await asyncio.sleep(0)
    # the warm flow has less left: it does not wait for the cold piece on its way
    warm_piece = asyncio.create_task(send(warm, "warm", 100, warm_piece_sent))
    await asyncio.sleep(0)
    assert entered == ["cold", "warm"]
    cold_piece_sent.set()
    await cold_piece
    cold_next = asyncio.create_task(send(cold, "cold", 700))
    for _ in range(3):
        await asyncio.sleep(0)
    assert entered == ["cold", "warm"]  # the cold flow's next piece waits for the warm one's
    warm_piece_sent.set()
    await asyncio.wait_for(asyncio.gather(warm_piece, cold_next), 5)
    assert entered == ["cold", "warm", "cold"]

    # the warm flow waits for its next KV (no piece pending): the cold one sends meanwhile
    await asyncio.wait_for(send(cold, "cold", 600), 5)
    turns.close(warm)
    turns.close(cold)
    turns.close(cold)  # idempotent
    assert entered[-1] == "cold" and turns.num_flows == 0


async def test_closing_a_flow_that_holds_its_turn_lets_the_flows_behind_it_go():
    turns = LinkTurns()
    first, second = turns.open(), turns.open()
    hold = asyncio.Event()
    holder = asyncio.create_task(_enter(turns, first, 10, hold))
    await asyncio.sleep(0)
    waiter = asyncio.create_task(_enter(turns, second, 20))
    await asyncio.sleep(0)
    assert not waiter.done()
    turns.close(first)  # still holding: its piece is on its way, but the flow is done
    await asyncio.wait_for(waiter, 5)
    hold.set()
    await holder


async def test_a_piece_cancelled_while_waiting_gives_up_its_place():
    turns = LinkTurns()
    holder_flow, cancelled_flow, last_flow = turns.open(), turns.open(), turns.open()
    hold = asyncio.Event()
    holder = asyncio.create_task(_enter(turns, holder_flow, 10, hold))
    await asyncio.sleep(0)
    cancelled = asyncio.create_task(_enter(turns, cancelled_flow, 20))
    last = asyncio.create_task(_enter(turns, last_flow, 30))
    await asyncio.sleep(0)
    cancelled.cancel()  # waiting, ahead of the last flow
    hold.set()
    await holder
    await asyncio.wait_for(last, 5)
    assert cancelled.cancelled() and cancelled_flow.pieces_pending == 0


async def test_a_piece_waits_for_its_turn_at_most_the_limit_and_its_flow_then_stops_taking_turns():
    """A flow whose receiver stopped reading holds its turn: the flows behind it go on after
    the limit instead of waiting for the stalled send's own timeout."""
    turns = LinkTurns(max_wait_s=0.05)
    stalled, behind = turns.open(), turns.open()
    never = asyncio.Event()
    holder = asyncio.create_task(_enter(turns, stalled, 10, never))
    await asyncio.sleep(0)
    await asyncio.wait_for(_enter(turns, behind, 20), 5)
    assert not behind.takes_turns and stalled.takes_turns
    await asyncio.wait_for(_enter(turns, behind, 20), 1)  # no longer waits at all
    holder.cancel()
    await asyncio.gather(holder, return_exceptions=True)


def test_a_negative_tokens_left_is_refused():
    turns = LinkTurns()
    with pytest.raises(ValueError, match="tokens_left"):
        asyncio.run(_enter(turns, turns.open(), -1))


async def _enter(turns: LinkTurns, flow, tokens_left: int, hold: asyncio.Event | None = None):
    """One piece of ``flow``'s, then nothing in hand (``hold``: the piece is on its way until set)."""
    turns.hold(flow, tokens_left)
    try:
        async with turns.turn(flow):
            if hold is not None:
                await hold.wait()
    finally:
        turns.let_go(flow)


@pytest.fixture
async def slow_link(tiny):
    """(sender engine, handler, link endpoint, receiver endpoint): a receiver behind a 2 Mbit/s
    link emulator, importing into a real engine."""
    sender, receiver_engine = HfEngine(tiny, num_blocks=128), HfEngine(tiny, num_blocks=128)
    handler = RecordingHandler(receiver_engine)
    receiver = BulkReceiver(
        handler, receiver_engine.frame_expectation, verify_key(SECRET), path="wan", frame_timeout_s=30
    )
    host, port = await receiver.start()
    link = WanLink(LinkProfile(bandwidth_bps=2e6, rtt_ms=4, jitter_ms=0), route_key=route_key(SECRET))
    link_port = await link.add_route(Route("bulk-main-decode", "127.0.0.1", 0, "*", 0, from_site="site-a"))
    yield sender, handler, f"127.0.0.1:{link_port}", f"{host}:{port}"
    await link.close()
    await receiver.stop()


async def test_two_flows_across_a_slow_link_land_one_after_the_other_not_both_late(slow_link, tiny, monkeypatch):
    """Two 500-token prompts' KV (266 KB each, 1.1 s alone at 2 Mbit/s) sent at once: the first
    lands before the second has sent half its frames; shared evenly, both would land at 2.2 s.
    Frames are cut into pieces (3,000 bytes here) and arrive whole."""
    monkeypatch.setattr("shared.bulk.sender.PIECE_BYTES", 3000)
    sender, handler, link, endpoint = slow_link
    turns = LinkTurns()
    prompts = {rid: prompt_of_length(tiny, 500, seed=seed) for seed, rid in enumerate(("a", "b"))}
    frames, flows = {}, {}
    for rid, prompt in prompts.items():
        sender.add_request(rid, prompt, SAMPLING)
        first = sender.step()[0].token_id
        frames[rid] = (first, sender.export_frames(rid, 0, len(prompt), max_tokens_per_frame=16))
        flow_open = flow_open_for(rid, prompt)
        flows[rid] = await open_flow(
            endpoint, flow_open, SECRET, path="wan", timeout_s=5, link=link, buffer_bytes=4096, turns=turns
        )

    async def ship(rid: str):
        first, parts_list = frames[rid]
        for index, parts in enumerate(parts_list):
            await flows[rid].send_frame(parts, tokens_left=len(prompts[rid]) - 16 * index)
        await flows[rid].end([first])

    await asyncio.wait_for(asyncio.gather(ship("a"), ship("b")), 30)
    await asyncio.wait_for(_ended(handler, "b"), 30)
    first_end = handler.events.index(("end", "a"))
    b_frames_before = handler.events[:first_end].count(("frame", "b"))
    assert b_frames_before < len(frames["b"][1]) / 2, handler.events
    for rid, prompt in prompts.items():  # and every byte arrived as sent
        got = handler.engine.export_frames(rid, 0, len(prompt), max_tokens_per_frame=len(prompt))
        want = sender.export_frames(rid, 0, len(prompt), max_tokens_per_frame=len(prompt))
        assert torch.equal(_kv(handler.engine, got), _kv(sender, want))


async def test_a_cancel_finishes_the_frame_on_its_way_before_telling_the_receiver(slow_link, tiny, monkeypatch):
    """A flow cancelled between two pieces of a frame, its next piece waiting behind a flow with
    less left: the frame goes out whole, then the FlowCancel, so the receiver learns why."""
    import shared.bulk.sender as sender_module

    sender, handler, link, endpoint = slow_link
    turns = LinkTurns()
    rival = turns.open()  # a flow with less left that takes the link mid-frame
    never, rival_in = asyncio.Event(), asyncio.Event()

    async def rival_piece():
        turns.hold(rival, 0)
        async with turns.turn(rival):
            rival_in.set()
            await never.wait()

    def cut_then_rival_comes(parts, piece_bytes):
        cut = iter(pieces(parts, piece_bytes))
        yield next(cut)
        rivals.append(asyncio.ensure_future(rival_piece()))
        yield from cut

    rivals: list[asyncio.Future] = []
    monkeypatch.setattr(sender_module, "pieces", cut_then_rival_comes)
    monkeypatch.setattr(sender_module, "PIECE_BYTES", 3000)
    monkeypatch.setattr(sender_module, "CANCEL_TIMEOUT_S", 10.0)  # a loaded machine may be slow
    prompt = prompt_of_length(tiny, 64)
    sender.add_request("c", prompt, SAMPLING)
    sender.step()
    (parts,) = sender.export_frames("c", 0, len(prompt), max_tokens_per_frame=len(prompt))  # 34 KB: 12 pieces
    flow = await open_flow(
        endpoint, flow_open_for("c", prompt), SECRET, path="wan", timeout_s=5, link=link, buffer_bytes=4096, turns=turns
    )
    sending = asyncio.create_task(flow.send_frame(parts, tokens_left=len(prompt)))
    await asyncio.wait_for(rival_in.wait(), 5)
    sending.cancel()
    await flow.cancel("the client left")
    await asyncio.wait_for(handler.aborted.wait(), 10)
    assert handler.events[-2:] == [("frame", "c"), ("abort", "cancelled by sender: the client left")]
    for task in rivals:
        task.cancel()
    await asyncio.gather(*rivals, return_exceptions=True)


async def test_a_flow_whose_send_failed_holds_no_place_on_the_link(slow_link, tiny):
    sender, handler, link, endpoint = slow_link
    turns = LinkTurns(max_wait_s=60.0)
    prompt = prompt_of_length(tiny, 32)
    sender.add_request("ok", prompt, SAMPLING)
    first = sender.step()[0].token_id
    flows = [
        await open_flow(endpoint, flow_open_for(rid, prompt), SECRET, path="wan", timeout_s=5, link=link, turns=turns)
        for rid in ("broken", "ok")
    ]
    with pytest.raises(TypeError):  # not a buffer: the send fails
        await flows[0].send_frame([object()], tokens_left=1)
    for parts in sender.export_frames("ok", 0, len(prompt), max_tokens_per_frame=16):
        await asyncio.wait_for(flows[1].send_frame(parts, tokens_left=len(prompt)), 5)
    await asyncio.wait_for(flows[1].end([first]), 5)
    await asyncio.wait_for(_ended(handler, "ok"), 10)
    assert handler.events.count(("frame", "ok")) == 2
    await flows[0].close()


async def _ended(handler: RecordingHandler, request_id: str):
    while ("end", request_id) not in handler.events:
        handler.ended.clear()
        await handler.ended.wait()


def _kv(engine: HfEngine, frames) -> torch.Tensor:
    return torch.cat([kv_wire.decode_frame(kv_wire.frame_bytes(p), engine.frame_expectation).kv for p in frames], 2)
