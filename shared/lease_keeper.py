"""Frees what an engine service holds for requests whose router's lease ran out.

``RequestLeases`` decides (from the routers' heartbeats); ``LeaseKeeper`` runs it: it feeds the
heartbeats in, asks every ``interval_s`` which held requests expired, and cancels each one
through the service's own cancel path, counted and logged. From the same reading it counts
the held requests per router (``held_by_router``), which the instance's heartbeat reports so
that several routers can share its ``max_sequences`` (``services/router/capacity_share.py``).
"""

import asyncio
import collections
import time
from collections.abc import Awaitable, Callable

import structlog

from shared import subjects
from shared.lease import RequestLeases
from shared.messages import CancelRequest, LoadReported
from shared.metrics import LEASES_EXPIRED


class LeaseKeeper:
    """Runs one service's request leases."""

    def __init__(
        self,
        leases: RequestLeases,
        service_name: str,
        held_request_ids: Callable[[], Awaitable[list[str]]],
        cancel: Callable[[CancelRequest], Awaitable[None]],
        log: structlog.BoundLogger,
    ):
        self.leases, self.service_name, self.log = leases, service_name, log
        self._held_request_ids, self._cancel = held_request_ids, cancel
        self.held_by_router: dict[str, int] = {}
        """Router id → requests of its held here, as of the last round (at most ``interval_s`` old)."""

    async def on_heartbeat(self, report: LoadReported, msg=None):
        """A heartbeat of any service (the routers' carry the requests they still run)."""
        self.leases.observe(report, time.monotonic())

    async def run(self, interval_s: float):
        """Every ``interval_s``: cancel the held requests whose lease expired."""
        while True:
            await asyncio.sleep(interval_s)
            held = await self._held_request_ids()
            self.held_by_router = count_by_router(held)
            for expired in self.leases.expired(held, time.monotonic()):
                LEASES_EXPIRED.labels(self.service_name, expired.kind).inc()
                self.log.warning(
                    "request_lease_expired", request_id=expired.request_id, kind=expired.kind, reason=expired.reason
                )
                reason = f"lease expired: {expired.reason}"
                await self._cancel(CancelRequest(request_id=expired.request_id, kind=expired.kind, reason=reason))


def count_by_router(request_ids: list[str]) -> dict[str, int]:
    """How many of ``request_ids`` (attempt ids) each router minted."""
    return dict(collections.Counter(subjects.origin_of(request_id) for request_id in request_ids))
