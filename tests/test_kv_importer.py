"""The receiving side of a KV flow against a real engine: frames that arrive while the engine
is busy are queued behind its step, not imported one step at a time."""

import asyncio
import json
import threading

import pytest
import structlog

from shared.block_hash import hash_blocks
from shared.bulk.kv_importer import KvImporter
from shared.bulk.receiver import FlowStats
from shared.engine.hf_engine import HfEngine
from shared.engine.sampling import SamplingParams
from shared.engine_worker import EngineWorker
from shared.errors import FrameOwnershipError, RequestCancelled
from shared.kv_wire import decode_frame
from shared.messages import FlowEnd, FlowOpen
from tests.helpers import prompt_of_length, reference_greedy


def opening(request_id: str, prompt: list[int]) -> FlowOpen:
    """A prefill's opening of a flow of ``prompt``'s KV to main-decode-0."""
    return FlowOpen(
        request_id=request_id,
        role="main_decode",
        token_ids=prompt,
        sampling=SamplingParams(max_tokens=8),
        seed=0,
        sender_id="prefill-0",
        receiver_id="main-decode-0",
        unix_s=0.0,
        nonce="",
    )


def exported_frames(tiny, prompt: list[int], frame_tokens: int, request_id: str = "r") -> tuple[int, list]:
    """A prefill's first token and its prompt KV as wire frames, decoded as a receiver sees them."""
    prefill = HfEngine(tiny, num_blocks=64)
    prefill.add_request(request_id, prompt, SamplingParams(max_tokens=1))
    first = prefill.step()[0].token_id
    receiver = HfEngine(tiny, num_blocks=4)
    frames = [
        decode_frame(b"".join(bytes(p) for p in parts), receiver.frame_expectation)
        for parts in prefill.export_frames(request_id, 0, len(prompt), max_tokens_per_frame=frame_tokens)
    ]
    return first, frames


async def test_frames_queue_behind_a_busy_engine_and_the_flow_finishes_right_after(tiny, tmp_path):
    prompt = prompt_of_length(tiny, 96)
    first, frames = exported_frames(tiny, prompt, frame_tokens=32)
    assert len(frames) == 3
    engine = HfEngine(tiny, num_blocks=64)
    log = tmp_path / "calls.jsonl"
    worker = EngineWorker(engine, "main-decode-0", call_log=str(log))
    done = asyncio.get_running_loop().create_future()

    async def on_complete(state, seq, stats):
        done.set_result(seq)

    importer = KvImporter(worker, on_complete)
    sampling = SamplingParams(max_tokens=8, ignore_eos=True)
    flow_open = FlowOpen(
        request_id="r",
        role="main_decode",
        token_ids=prompt,
        sampling=sampling,
        seed=0,
        sender_id="prefill-0",
        receiver_id="main-decode-0",
        unix_s=0.0,
        nonce="",
    )
    assert await importer.open_flow(flow_open, FlowStats()) == 0

    step_running = threading.Event()

    def a_long_step():  # stands for a decode step in progress when the frames arrive
        step_running.wait(timeout=30)

    busy = worker.submit(a_long_step)
    for frame in frames:  # each returns at once: the receiver reads the next frame meanwhile
        await asyncio.wait_for(importer.import_frame("r", frame), timeout=5)
    ending = asyncio.create_task(
        importer.end_flow("r", FlowEnd(request_id="r", output_token_ids=[first]), FlowStats(frames=3))
    )
    await asyncio.sleep(0)  # end_flow queues the finish before it awaits anything
    assert not busy.done()
    step_running.set()
    await asyncio.wait_for(ending, timeout=10)
    seq = await done
    calls = [json.loads(line)["call"] for line in log.read_text().splitlines()]
    assert calls[-5:] == ["a_long_step", *["import_frame_intact"] * 3, "finish_import_intact"]
    assert seq.num_imported_tokens == len(prompt)
    while await worker.call(engine.has_work):
        await worker.call(engine.step)
    assert list(engine.request("r").output_token_ids) == reference_greedy(tiny, prompt, 8)
    worker.shutdown()


async def test_a_frame_that_fails_to_import_aborts_the_flow_and_frees_its_blocks(tiny):
    prompt = prompt_of_length(tiny, 96)
    first, frames = exported_frames(tiny, prompt, frame_tokens=32)
    engine = HfEngine(tiny, num_blocks=64)
    worker = EngineWorker(engine, "main-decode-0")
    aborted = []

    async def on_abort(request_id, reason):
        aborted.append(request_id)

    importer = KvImporter(worker, on_complete=None, on_abort=on_abort)
    sampling = SamplingParams(max_tokens=8)
    flow_open = FlowOpen(
        request_id="r",
        role="main_decode",
        token_ids=prompt,
        sampling=sampling,
        seed=0,
        sender_id="prefill-0",
        receiver_id="main-decode-0",
        unix_s=0.0,
        nonce="",
    )
    await importer.open_flow(flow_open, FlowStats())
    await importer.import_frame("r", frames[0])
    await importer.import_frame("r", frames[2])  # a gap: the engine refuses it
    with pytest.raises(FrameOwnershipError):  # the receiver drops the connection on it
        await importer.end_flow("r", FlowEnd(request_id="r", output_token_ids=[first]), FlowStats())
    assert aborted == ["r"] and not importer.holds("r")
    assert engine.blocks.num_used_blocks == 0 and engine.request("r") is None
    worker.shutdown()


async def test_a_flow_arriving_after_its_request_ended_fills_the_cache_or_is_refused(tiny):
    """On a congested WAN a flow's opening can reach main decode after the request's cancel
    (it queued behind other KV): it must not import and park a sequence nobody will use."""
    prompt = prompt_of_length(tiny, 96)
    first, frames = exported_frames(tiny, prompt, frame_tokens=32)
    engine = HfEngine(tiny, num_blocks=64)
    worker = EngineWorker(engine, "main-decode-0")
    completed = []

    async def on_complete(state, seq, stats):
        completed.append(seq.request_id)

    importer = KvImporter(worker, on_complete)

    # Ended on the relay first: the KV still lands, for the cache, and nothing stays held.
    # (The frames carry their request's id, "r".)
    assert await importer.cancel("r", finished_elsewhere=True) is None
    await importer.open_flow(opening("r", prompt), FlowStats())
    assert importer.kept_for_cache() == {"r"}
    for frame in frames:
        await importer.import_frame("r", frame)
    await importer.end_flow("r", FlowEnd(request_id="r", output_token_ids=[first]), FlowStats())
    assert completed == [] and engine.request("r") is None and engine.num_sequences == 0
    cached = await worker.call(engine.cached_prefix_blocks, hash_blocks(prompt, engine.block_size))
    assert cached == len(prompt) // engine.block_size

    # The client went away first: the flow is refused before it takes a block.
    await importer.cancel("stopped", finished_elsewhere=False)
    with pytest.raises(RequestCancelled):
        await importer.open_flow(opening("stopped", prompt), FlowStats())
    assert not importer.holds("stopped") and engine.request("stopped") is None
    worker.shutdown()


async def test_a_follow_up_that_ended_elsewhere_keeps_its_place_behind_the_blocks_in_flight(tiny):
    """A relayed follow-up turn waits at main decode for the previous turn's KV still crossing;
    when the relay finishes it first (cancel ``finished``), it still waits, then asks only for
    the blocks the cache lacks: the previous turn's blocks do not cross the link twice."""
    first_turn = prompt_of_length(tiny, 96)
    follow_up = first_turn + prompt_of_length(tiny, 40)[::-1]
    first, frames = exported_frames(tiny, first_turn, frame_tokens=32, request_id="turn-1")
    engine = HfEngine(tiny, num_blocks=64)
    worker = EngineWorker(engine, "main-decode-0")

    async def on_complete(state, seq, stats):
        await worker.call(engine.free, seq.request_id)

    importer = KvImporter(worker, on_complete)

    assert await importer.open_flow(opening("turn-1", first_turn), FlowStats()) == 0
    with structlog.testing.capture_logs() as logs:
        waiting = asyncio.create_task(importer.open_flow(opening("turn-2", follow_up), FlowStats()))
        while not any(entry["event"] == "kv_import_waits_for_blocks_in_flight" for entry in logs):
            await asyncio.sleep(0)  # until it waits in line (it logs, then waits at once)
    await importer.cancel("turn-2", finished_elsewhere=True)  # the relay finished the follow-up
    await run_as_far_as_it_can(worker)
    assert "turn-2" not in importer.imports and not waiting.done()  # still in line
    for frame in frames:
        await importer.import_frame("turn-1", frame)
    await importer.end_flow("turn-1", FlowEnd(request_id="turn-1", output_token_ids=[first]), FlowStats())
    assert await asyncio.wait_for(waiting, 10) == len(first_turn) // engine.block_size * engine.block_size
    worker.shutdown()


async def run_as_far_as_it_can(worker: EngineWorker):
    """Let every task run until it waits on something other than the event loop or the engine
    thread (the engine thread runs its calls in order: one more call waits for those before it)."""
    for _ in range(3):
        for _ in range(20):
            await asyncio.sleep(0)
        await worker.call(int)


async def test_a_prompt_sharing_only_a_system_prompt_waits_for_those_blocks_not_the_whole_flow(tiny):
    """Two cold prompts behind one system prompt: the second flow asks for the rest as soon as
    the first flow's frame with the shared blocks is imported, not after its whole prompt."""
    first_prompt = prompt_of_length(tiny, 96)
    second_prompt = first_prompt[:32] + prompt_of_length(tiny, 64)[::-1]
    _, frames = exported_frames(tiny, first_prompt, frame_tokens=32, request_id="first")
    engine = HfEngine(tiny, num_blocks=64)
    worker = EngineWorker(engine, "main-decode-0")
    importer = KvImporter(worker, lambda *_: asyncio.sleep(0))

    assert await importer.open_flow(opening("first", first_prompt), FlowStats()) == 0
    second = asyncio.create_task(importer.open_flow(opening("second", second_prompt), FlowStats()))
    await run_as_far_as_it_can(worker)
    assert not second.done()  # the shared blocks are not here yet
    await importer.import_frame("first", frames[0])  # the system prompt's two blocks
    assert await asyncio.wait_for(second, 10) == 32  # asks from the shared blocks on
    assert importer.holds("first") and "first" in importer.imports  # still importing its own
    worker.shutdown()
