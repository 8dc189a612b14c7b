"""Routers share an engine's sequences: the shares of one instance sum to its slots, whatever
the routers and instances, and a router never fills slots the engine reports others hold."""

import pytest

from services.router.capacity_share import capacity_in_slots, room_in_slots, share_of_slots


@pytest.mark.parametrize("slots", [0, 1, 3, 4, 7, 64])
@pytest.mark.parametrize("count", [1, 2, 3, 5])
def test_the_routers_shares_of_an_instance_sum_to_its_slots(slots, count):
    routers = [f"router-{i}" for i in range(count)]
    for instance in ("main-decode-0", "main-decode-1", "relay-decode-0"):
        shares = [share_of_slots(slots, routers, r, instance) for r in routers]
        assert sum(shares) == slots and max(shares) - min(shares) <= 1


def test_spare_slots_of_different_instances_go_to_different_routers():
    routers = ["router-0", "router-1"]
    instances = [f"main-decode-{i}" for i in range(16)]
    totals = [sum(share_of_slots(3, routers, r, i) for i in instances) for r in routers]
    assert min(totals) >= 16 + 3  # each gets one slot of every instance and some of the spare ones


def test_a_router_never_fills_what_other_routers_requests_hold():
    # The other router died holding 2 of 3 slots; the survivor now owns all 3 but the engine
    # still reports the dead one's 2 until their leases free them.
    assert capacity_in_slots(share=3, slots=3, others_reported=2) == 1
    assert room_in_slots(share=3, slots=3, mine=1, others_reported=2) == 0
    assert room_in_slots(share=3, slots=3, mine=0, others_reported=0) == 3
    assert room_in_slots(share=2, slots=3, mine=2, others_reported=0) == 0
