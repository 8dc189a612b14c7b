"""How several routers share one engine's sequences without talking to each other.

Every router hears every router's heartbeat, so the live routers agree on who they are (the
sorted ids). Instance ``e``'s ``max_sequences`` slots are split among them by rank: each gets
``slots // routers``, and ``slots % routers`` of them one more, starting at an offset that
depends on the instance (so the spare slots of many instances do not all go to ``router-0``).
The shares of one instance sum to its slots exactly, so routers that agree on the membership
never hold more requests on it together than it can run.

While the membership changes they may not agree (a router joined and has not been heard yet,
or one died and the survivors take its share before the engines have freed its requests).
The engines' own reports cover that: each heartbeat says how many of the requests the engine
holds each router minted (``LoadReported.sequences_by_router``), and a router never places
beyond the slots the *other* routers' requests leave there. Its room on an instance is

    min(share - mine, slots - others_reported - mine)

where ``mine`` is its own exact count (placements not yet finished). ``others_reported`` is a
heartbeat old: what the other routers placed since then is bounded by their own shares.
"""

import zlib
from collections.abc import Sequence


def share_of_slots(slots: int, routers: Sequence[str], router_id: str, instance_id: str) -> int:
    """Slots of an instance with ``slots`` sequences that ``router_id`` may fill, among the live
    ``routers`` (sorted ids, ``router_id`` among them). 0 slots (no limit reported) stays 0."""
    if not routers:
        return slots
    count = len(routers)
    base, spare = divmod(slots, count)
    offset = zlib.crc32(instance_id.encode()) % count
    return base + (1 if (routers.index(router_id) - offset) % count < spare else 0)


def room_in_slots(share: int, slots: int, mine: int, others_reported: int) -> int:
    """Requests this router may still place on an instance: what is left of its share, and
    never more than the slots the other routers' requests (as the instance reported them)
    leave free."""
    return max(0, min(share - mine, slots - others_reported - mine))


def capacity_in_slots(share: int, slots: int, others_reported: int) -> int:
    """Requests this router may run on an instance at once (its admission capacity there)."""
    return max(0, min(share, slots - others_reported))
