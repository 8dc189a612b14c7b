"""Live instances, learnt from their heartbeats (``LoadReported`` on ``pdd.evt.*.load.*``)."""

import time
from dataclasses import dataclass

from shared.messages import LoadReported, decoder

_load_decoder = decoder(LoadReported)


@dataclass
class InstanceState:
    """Last heartbeat of an instance and when it came.

    Attributes:
        report: The heartbeat.
        seen_monotonic: Router clock when it arrived.
        assigned: Requests the router placed there and has not seen finish.
    """

    report: LoadReported
    seen_monotonic: float
    assigned: int = 0


class InstanceRegistry:
    """Which instances are alive, per service; an instance silent for ``ttl_s`` is gone."""

    def __init__(self, ttl_s: float):
        self._ttl_s = ttl_s
        self._instances: dict[str, InstanceState] = {}

    async def on_message(self, msg):
        """NATS callback for heartbeats."""
        report = _load_decoder.decode(msg.data)
        state = self._instances.get(report.instance.instance_id)
        if state is None:
            self._instances[report.instance.instance_id] = InstanceState(report, time.monotonic())
        else:
            state.report, state.seen_monotonic = report, time.monotonic()

    def live(self, service: str) -> list[InstanceState]:
        """Live instances of ``service``, sorted by id (stable placement ties)."""
        cutoff = time.monotonic() - self._ttl_s
        return sorted((s for s in self._instances.values()
                       if s.report.service == service and s.seen_monotonic >= cutoff),
                      key=lambda s: s.report.instance.instance_id)

    def is_alive(self, instance_id: str) -> bool:
        """Whether ``instance_id`` has sent a heartbeat within the TTL."""
        state = self._instances.get(instance_id)
        return state is not None and state.seen_monotonic >= time.monotonic() - self._ttl_s

    def get(self, instance_id: str) -> InstanceState | None:
        """The instance's state, alive or not."""
        return self._instances.get(instance_id)

    def summary(self) -> dict[str, list[str]]:
        """Live instance ids per service (for /health)."""
        services = {"prefill", "relay_decode", "main_decode", "cache_index"}
        return {service: [s.report.instance.instance_id for s in self.live(service)]
                for service in sorted(services)}
