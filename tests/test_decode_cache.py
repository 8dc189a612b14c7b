"""The decode-side cache's policy: which flows wait for blocks already in flight, and for whom."""

from shared.block_hash import common_prefix
from shared.decode_cache import InFlightBlocks, keeps_importing


def test_a_follow_up_waits_for_the_earlier_flow_that_brings_its_prefix():
    line = InFlightBlocks()
    first = line.claim("turn-1", [1, 2, 3])
    follow_up = line.claim("turn-2", [1, 2, 3, 4, 5])
    assert line.blocker(follow_up, cached_blocks=0) == ("turn-1", first)
    assert line.blocker(follow_up, cached_blocks=3) is None  # already cached: ask only for 4, 5
    assert line.blocker(first, cached_blocks=0) is None  # earlier flows never wait on later ones


def test_the_blocker_is_the_earlier_flow_sharing_the_longest_prefix():
    line = InFlightBlocks()
    line.claim("system-prompt-only", [1, 9])
    deeper = line.claim("same-conversation", [1, 2, 3])
    follow_up = line.claim("next-turn", [1, 2, 3, 4])
    assert line.blocker(follow_up, cached_blocks=1) == ("same-conversation", deeper)


def test_releasing_a_flow_wakes_the_flows_behind_it():
    line = InFlightBlocks()
    first = line.claim("a", [1, 2])
    follow_up = line.claim("b", [1, 2, 3])
    line.release("a")
    assert first.done.is_set() and line.blocker(follow_up, cached_blocks=0) is None


def test_a_cancel_while_in_line_drops_the_flow_unless_the_request_ended_elsewhere():
    line = InFlightBlocks()
    dropped, kept = line.claim("stopped", [1]), line.claim("finished-on-relay", [2])
    assert line.cancel_waiting("stopped", finished_elsewhere=False) and dropped.dropped
    assert line.cancel_waiting("finished-on-relay", finished_elsewhere=True) and not kept.dropped
    assert not line.cancel_waiting("unknown", finished_elsewhere=False)
    assert keeps_importing(finished_elsewhere=True) and not keeps_importing(finished_elsewhere=False)


def test_common_prefix_counts_leading_equal_hashes():
    assert common_prefix([1, 2, 3], [1, 2, 4, 5]) == 2
    assert common_prefix([], [1]) == 0
