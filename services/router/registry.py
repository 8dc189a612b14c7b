"""Live instances, learnt from their heartbeats (``LoadReported`` on ``pdd.evt.*.load.*``).

Load has two sources: the instance's own heartbeat (every router's requests, up to a
heartbeat old) and this router's placements (exact, immediate). An instance's load is the
larger of the two, so a burst of requests spreads out before the next heartbeat comes; once
this router has seen one of its requests there finish, the heartbeat before it is known to
overstate the load (by the request's whole KV, output included), so until the next one only
this router's count is used.

Death is told apart from a slow or cut link by the instance's own site: an instance silent
for the TTL while its site still speaks (other instances' heartbeats, or the site's NATS
server answering the router's probe) has died. When its whole site is silent the
link is to blame (heartbeats of a remote site cross the WAN), and the instance counts as
dead only after ``partition_tolerance_s``: a stall shorter than that is neither a death nor
an error. Placement still uses only instances heard within the TTL.

Several routers share each engine's ``max_sequences``: the registry knows the live routers
(their heartbeats) and gives every instance this router's share of its slots and the count of
other routers' requests it reported (``capacity_share``).
"""

import itertools
import time
from dataclasses import dataclass

from services.router.capacity_share import capacity_in_slots, room_in_slots, share_of_slots
from shared.messages import InstanceRef, LoadReported


@dataclass
class InstanceState:
    """Last heartbeat of an instance and when it came.

    Attributes:
        report: The heartbeat.
        seen_monotonic: Router clock when it arrived.
        assigned: Requests this router placed there and has not seen finish.
        assigned_blocks: Prompt blocks of those requests.
        assigned_compute_blocks: Of those, the blocks it has still to compute (a prefill's
            work, counted until ``PrefillCompleted``).
        last_placed: Serial number of this router's latest placement there (0: never).
        placed_blocks_since_report: Prompt blocks this router placed there since the heartbeat.
        released_since_report: A request of this router's finished there after the heartbeat.
        share_sequences: This router's share of its ``max_sequences`` among the live routers
            (set by ``InstanceRegistry.live``).
        others_sequences: Requests of other routers it held at its heartbeat.
    """

    report: LoadReported
    seen_monotonic: float
    assigned: int = 0
    assigned_blocks: int = 0
    assigned_compute_blocks: int = 0
    last_placed: int = 0
    placed_blocks_since_report: int = 0
    released_since_report: bool = False
    share_sequences: int = 0
    others_sequences: int = 0

    @property
    def room_sequences(self) -> int | None:
        """Requests this router may still place here (None: it reports no limit)."""
        if not self.report.max_sequences:
            return None
        return room_in_slots(self.share_sequences, self.report.max_sequences, self.assigned, self.others_sequences)

    @property
    def capacity_sequences(self) -> int:
        """Requests of this router it may run at once (its share, less what others overfill)."""
        return capacity_in_slots(self.share_sequences, self.report.max_sequences, self.others_sequences)

    @property
    def spare_blocks(self) -> int:
        """Blocks free at its heartbeat less those this router has placed there since."""
        return max(0, self.report.free_blocks - self.placed_blocks_since_report)

    @property
    def load_sequences(self) -> int:
        """Requests it runs: its heartbeat's count or this router's, whichever is larger."""
        if self.released_since_report:
            return self.assigned
        return max(self.report.active_sequences, self.assigned)

    @property
    def load_blocks(self) -> int:
        """KV blocks its requests hold: heartbeat or this router's count, whichever is larger."""
        if self.released_since_report:
            return self.assigned_blocks
        return max(self.report.used_blocks, self.assigned_blocks)

    def pending_compute_blocks(self, block_size: int) -> int:
        """Blocks of prompt it has still to compute: heartbeat or this router's count, whichever
        is larger."""
        if self.released_since_report:
            return self.assigned_compute_blocks
        return max(-(-self.report.pending_tokens // block_size), self.assigned_compute_blocks)


class InstanceRegistry:
    """Which instances are alive, per service; an instance silent for ``ttl_s`` is gone."""

    def __init__(self, ttl_s: float, partition_tolerance_s: float | None = None, router_id: str = ""):
        self._ttl_s = ttl_s
        self._router_id = router_id
        self._partition_tolerance_s = max(ttl_s, partition_tolerance_s or ttl_s)
        self._instances: dict[str, InstanceState] = {}
        self._site_seen: dict[str, float] = {}
        self._placements = itertools.count(1)

    def observe(self, report: LoadReported):
        """Record a heartbeat."""
        self._site_seen[report.instance.site] = time.monotonic()
        state = self._instances.get(report.instance.instance_id)
        if state is None:
            state = self._instances[report.instance.instance_id] = InstanceState(report, time.monotonic())
        else:
            state.report, state.seen_monotonic = report, time.monotonic()
            state.released_since_report = False
            state.placed_blocks_since_report = 0
        others = report.sequences_by_router
        state.others_sequences = sum(n for router, n in others.items() if router != self._router_id)

    def live(self, service: str) -> list[InstanceState]:
        """Live instances of ``service``, sorted by id (stable placement ties), each with this
        router's share of its sequences among the live routers."""
        live = self._live(service)
        if service != "router":
            routers = self.routers() if self._router_id else []  # no router id (the simulator): all slots
            for state in live:
                slots, instance_id = state.report.max_sequences, state.report.instance.instance_id
                state.share_sequences = share_of_slots(slots, routers, self._router_id, instance_id)
        return live

    def routers(self) -> list[str]:
        """The live routers' ids, sorted, this one always among them."""
        ids = {s.report.instance.instance_id for s in self._live("router")}
        return sorted(ids | {self._router_id} if self._router_id else ids)

    def _live(self, service: str) -> list[InstanceState]:
        cutoff = time.monotonic() - self._ttl_s
        return sorted(
            (s for s in self._instances.values() if s.report.service == service and s.seen_monotonic >= cutoff),
            key=lambda s: s.report.instance.instance_id,
        )

    def forget(self, instance_id: str):
        """Stop placing on an instance that failed a request as if gone (its next heartbeat, or a
        restarted incarnation's first, brings it back)."""
        self._instances.pop(instance_id, None)

    def site_heard(self, site: str):
        """Something at ``site`` answered (e.g. its NATS server, probed through the link)."""
        self._site_seen[site] = time.monotonic()

    def is_dead(self, ref: InstanceRef) -> bool:
        """Whether the instance is gone: restarted (a new incarnation under its name), silent
        while its site speaks, or silent past the partition tolerance."""
        state = self._instances.get(ref.instance_id)
        if state is None or (ref.incarnation and state.report.instance.incarnation != ref.incarnation):
            return True
        now = time.monotonic()
        silent_s = now - state.seen_monotonic
        if silent_s <= self._ttl_s:
            return False
        # Its site must have been heard well after its last word: a neighbour's heartbeat sent
        # just before the whole site went silent proves nothing.
        heard_after_s = self._site_seen.get(state.report.instance.site, 0.0) - state.seen_monotonic
        return heard_after_s > self._ttl_s / 2 or silent_s > self._partition_tolerance_s

    def site_silent_s(self, site: str) -> float:
        """Seconds since any instance at ``site`` was heard (inf: never)."""
        seen = self._site_seen.get(site)
        return float("inf") if seen is None else time.monotonic() - seen

    def sites(self) -> list[str]:
        """Sites heard from."""
        return sorted(self._site_seen)

    def assign(self, instance_ids: list[str], num_blocks: int, compute_blocks: dict[str, int] | None = None):
        """Count a request of ``num_blocks`` prompt blocks placed on these instances, of which
        ``compute_blocks[instance]`` are computed there."""
        serial = next(self._placements)
        for state in filter(None, map(self._instances.get, instance_ids)):
            state.assigned += 1
            state.assigned_blocks += num_blocks
            state.placed_blocks_since_report += num_blocks
            state.assigned_compute_blocks += (compute_blocks or {}).get(state.report.instance.instance_id, 0)
            state.last_placed = serial

    def release(self, instance_ids: list[str], num_blocks: int, compute_blocks: dict[str, int] | None = None):
        """Stop counting a request :meth:`assign` counted (it finished or failed)."""
        for state in filter(None, map(self._instances.get, instance_ids)):
            state.assigned -= 1
            state.assigned_blocks -= num_blocks
            state.assigned_compute_blocks -= (compute_blocks or {}).get(state.report.instance.instance_id, 0)
            state.released_since_report = True

    def summary(self) -> dict[str, list[str]]:
        """Live instance ids per service (for /health), the live routers (this one included) under ``router``."""
        services = {"prefill", "relay_decode", "main_decode", "cache_index"}
        live = {service: [s.report.instance.instance_id for s in self.live(service)] for service in sorted(services)}
        return {**live, "router": self.routers()}
