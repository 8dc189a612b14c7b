"""The cache-index's sync with one publisher, driven by plain messages: gaps, epochs, dumps,
duplicates and reordering."""

from services.cache_index.sync_state import EventVerdict, PublisherSync
from shared.messages import KvBlocksEvicted, KvBlocksStored


def stored(seq: int, hashes: list[int], epoch: str = "e1") -> KvBlocksStored:
    return KvBlocksStored(publisher_id="main-decode-0", epoch=epoch, seq=seq, block_hashes=hashes)


def evicted(seq: int, hashes: list[int], epoch: str = "e1") -> KvBlocksEvicted:
    return KvBlocksEvicted(publisher_id="main-decode-0", epoch=epoch, seq=seq, block_hashes=hashes)


def synced(epoch: str = "e1") -> PublisherSync:
    """A publisher whose heartbeat was seen and whose (empty) dump arrived."""
    state = PublisherSync("site-b", last_seen=0.0)
    assert state.heartbeat("main_decode", epoch, now=0.0)  # no base yet: a dump is needed
    state.dump_received(stored(0, [], epoch), now=0.0)
    return state


def test_events_in_order_are_applied_and_duplicates_dropped():
    state = synced()
    assert state.event(stored(1, [1, 2]), 1.0) == (EventVerdict.APPLIED, False)
    assert state.event(evicted(2, [2]), 1.0) == (EventVerdict.APPLIED, False)
    assert state.event(stored(1, [1, 2]), 1.0) == (EventVerdict.DUPLICATE, False)
    assert state.block_hashes == {1} and state.routable and state.leading_hits([1, 2]) == 1


def test_a_gap_asks_for_one_dump_and_the_held_events_after_it_are_applied():
    state = synced()
    state.event(stored(1, [1]), 1.0)
    assert state.event(stored(3, [3]), 1.0) == (EventVerdict.GAP, True)
    assert state.event(stored(4, [4]), 1.0) == (EventVerdict.HELD, False)  # one dump in flight
    assert state.event(stored(5, [5]), 1.0) == (EventVerdict.HELD, False)
    applied = state.dump_received(stored(3, [1, 2, 3]), now=2.0)  # the dump covers up to seq 3
    assert applied == 2 and state.seq == 5 and state.block_hashes == {1, 2, 3, 4, 5}
    assert not state.syncing and not state.pending


def test_reordered_events_after_a_dump_apply_only_without_a_gap():
    state = synced()
    state.event(stored(2, [2]), 1.0)  # out of order: a gap
    state.event(stored(4, [4]), 1.0)
    state.event(stored(3, [3]), 1.0)
    state.dump_received(stored(1, [1]), now=2.0)
    assert state.seq == 4 and state.block_hashes == {1, 2, 3, 4}


def test_a_restart_drops_the_old_epoch_and_ignores_its_late_events():
    state = synced("e1")
    state.event(stored(1, [1, 2]), 1.0)
    assert state.heartbeat("main_decode", "e2", now=2.0)  # the new incarnation needs a dump
    assert state.block_hashes == set() and state.leading_hits([1, 2]) == 0  # its blocks died with it
    assert state.event(stored(2, [9], epoch="e1"), 2.0) == (EventVerdict.OTHER_INCARNATION, False)
    state.dump_received(stored(0, [7], epoch="e2"), now=3.0)
    assert state.routable and state.block_hashes == {7}


def test_a_replayed_history_that_does_not_start_at_one_waits_for_a_dump():
    state = PublisherSync("site-b", last_seen=0.0)
    # Events replayed from the stream before any heartbeat: no service known, no dump yet.
    assert state.event(stored(5, [5]), 0.0) == (EventVerdict.HELD, False)
    assert state.heartbeat("main_decode", "e1", now=1.0)
    assert state.dump_received(stored(5, [1, 5]), now=1.0) == 0  # seq 5 is already in the dump
    assert state.block_hashes == {1, 5} and state.seq == 5


def test_a_failed_dump_is_asked_again_at_the_next_heartbeat():
    state = PublisherSync("site-b", last_seen=0.0)
    assert state.heartbeat("main_decode", "e1", now=0.0)
    assert not state.heartbeat("main_decode", "e1", now=1.0)  # still in flight
    state.dump_failed()
    assert state.heartbeat("main_decode", "e1", now=2.0)
