"""The relay's handoff state machine, event by event."""

import pytest
from structlog.testing import capture_logs

from services.relay_decode.handoff import (
    ChunkPlanned,
    HandoffChunk,
    HandoffMachine,
    HandoffPolicy,
    HandoffState,
    IllegalTransition,
    StateChanged,
)

POLICY = HandoffPolicy(
    catch_up_threshold_tokens=64, final_gap_tokens=8, load_watermark=0.5, max_chunks=16, max_chunk_tokens=1000
)


def machine() -> HandoffMachine:
    return HandoffMachine("r", POLICY)


def test_small_backlog_goes_one_shot():
    m = machine()
    assert m.kv_ready(emitted=30, load=0.1) == HandoffChunk(0, 30, True, "one-shot", 1)
    assert m.state is HandoffState.ONE_SHOT
    assert m.accepted(next_index=30, emitted=31, load=0.1) is None
    assert m.state is HandoffState.RELEASED and m.done
    assert m.history == ["decoding", "one_shot", "released"]


def test_busy_relay_goes_one_shot_even_with_a_big_backlog():
    m = machine()
    chunk = m.kv_ready(emitted=200, load=0.5)
    assert chunk.final and chunk.mode == "one-shot" and chunk.end_index == 200


def test_big_backlog_with_room_catches_up_in_chunks():
    m = machine()
    assert m.kv_ready(emitted=100, load=0.2) == HandoffChunk(0, 100, False, "catch-up", 1)
    assert m.state is HandoffState.CATCH_UP
    # Main decode absorbed 100 while the relay reached 130: gap 30 > 8, another held chunk.
    assert m.accepted(next_index=100, emitted=130, load=0.2) == HandoffChunk(100, 130, False, "catch-up", 2)
    # Absorbed; the relay is at 134: gap 4 <= 8, final chunk.
    assert m.accepted(next_index=130, emitted=134, load=0.2) == HandoffChunk(130, 134, True, "catch-up", 3)
    assert m.accepted(next_index=134, emitted=134, load=0.2) is None
    assert m.state is HandoffState.RELEASED and m.chunks == 3


def test_catch_up_waits_for_a_token_before_the_final_chunk():
    m = machine()
    m.kv_ready(emitted=100, load=0.2)
    assert m.accepted(next_index=100, emitted=100, load=0.2) is None
    assert m.tokens_emitted(emitted=101, load=0.2) == HandoffChunk(100, 101, True, "catch-up", 2)
    assert m.tokens_emitted(emitted=102, load=0.2) is None  # one chunk in flight at a time


def test_relay_getting_busy_during_catch_up_hands_over_for_good():
    m = machine()
    m.kv_ready(emitted=100, load=0.2)
    chunk = m.accepted(next_index=100, emitted=150, load=0.9)
    assert chunk.final and chunk.mode == "catch-up" and (chunk.start_index, chunk.end_index) == (100, 150)


def test_failure_and_local_finish():
    m = machine()
    m.kv_ready(emitted=10, load=0.0)
    m.failed("main decode did not answer")
    assert m.state is HandoffState.FINISHED_LOCALLY and m.done
    other = machine()
    other.finished_locally()
    assert other.history == ["decoding", "finished_locally"]


def test_illegal_events_are_refused():
    m = machine()
    with pytest.raises(IllegalTransition):
        m.accepted(next_index=5, emitted=5, load=0)
    m.kv_ready(emitted=100, load=0.2)
    with pytest.raises(IllegalTransition):
        m.kv_ready(emitted=100, load=0.2)
    with pytest.raises(IllegalTransition):
        m.accepted(next_index=42, emitted=120, load=0.2)


def test_catch_up_that_cannot_close_the_gap_ends_after_max_chunks():
    m = HandoffMachine("r", HandoffPolicy(64, 8, 0.5, max_chunks=3, max_chunk_tokens=1000))
    chunk = m.kv_ready(emitted=100, load=0.1)
    chunk = m.accepted(chunk.end_index, emitted=150, load=0.1)
    assert not chunk.final and chunk.chunk == 2
    chunk = m.accepted(chunk.end_index, emitted=200, load=0.1)
    assert chunk.final and chunk.chunk == 3


def test_catch_up_chunks_are_bounded_so_each_stall_is_small():
    m = HandoffMachine("r", HandoffPolicy(64, 8, 0.5, max_chunks=16, max_chunk_tokens=32))
    assert m.kv_ready(emitted=100, load=0.1) == HandoffChunk(0, 32, False, "catch-up", 1)
    assert m.accepted(32, emitted=102, load=0.1) == HandoffChunk(32, 64, False, "catch-up", 2)
    assert m.accepted(64, emitted=104, load=0.1) == HandoffChunk(64, 96, False, "catch-up", 3)
    final = m.accepted(96, emitted=104, load=0.1)
    assert final == HandoffChunk(96, 104, True, "catch-up", 4)


def test_the_machine_returns_what_it_did_as_events_and_logs_nothing():
    m = machine()
    with capture_logs() as logs:
        first = m.kv_ready(emitted=100, load=0.2)
        final = m.accepted(next_index=100, emitted=104, load=0.2)
        m.accepted(next_index=104, emitted=104, load=0.2)
    assert logs == []  # its owner logs them (the relay service), or not (the simulator)
    assert m.take_events() == [
        StateChanged("r", HandoffState.DECODING, HandoffState.CATCH_UP, {"backlog": 100, "load": 0.2}),
        ChunkPlanned("r", first),
        ChunkPlanned("r", final),
        StateChanged("r", HandoffState.CATCH_UP, HandoffState.RELEASED, {"chunks": 2}),
    ]
    assert m.take_events() == []  # taken once
    m2 = machine()
    m2.finished_locally()
    assert m2.take_events() == [
        StateChanged("r", HandoffState.DECODING, HandoffState.FINISHED_LOCALLY, {"reason": "relay finished first"})
    ]
