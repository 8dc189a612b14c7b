"""Degraded mode: the router's view of each remote site, as an explicit state machine.

``healthy`` → ``unreachable`` when nothing from the site has been heard for the instance TTL
(its heartbeats cross the WAN: the link is cut or stalled, or the whole site is down);
``unreachable`` → ``recovering`` at the first heartbeat again; ``recovering`` → ``healthy``
once the site has been heard steadily for another TTL. While a site is unreachable its
instances are not placed on (with no main decoder left, new requests are served at site A as
``P-RLD``, under the relays' admission bound), and in-flight requests wait for it up to the
partition tolerance before they are resumed at site A. ``update`` returns the transitions it
made; the router logs them, traces them and exports the states as ``pdd_site_state``.
"""

import enum
import time
from dataclasses import dataclass

from services.router.registry import InstanceRegistry


class SiteState(enum.Enum):
    """Where a remote site stands."""

    HEALTHY = "healthy"
    UNREACHABLE = "unreachable"
    RECOVERING = "recovering"


@dataclass(frozen=True)
class SiteTransition:
    """A remote site moved from ``previous`` to ``state``, and why."""

    site: str
    previous: SiteState
    state: SiteState
    why: str


class SiteHealth:
    """Per-site states, advanced by :meth:`update` from what the registry has heard."""

    def __init__(self, registry: InstanceRegistry, own_site: str, ttl_s: float):
        self._registry, self._own_site, self._ttl_s = registry, own_site, ttl_s
        self.states: dict[str, SiteState] = {}
        self._heard_again: dict[str, float] = {}

    def update(self) -> list[SiteTransition]:
        """Advance every remote site's state (``states``); return the transitions made."""
        moves = []
        for site in self._registry.sites():
            if site != self._own_site:
                move = self._next(site, self.states.get(site, SiteState.HEALTHY), time.monotonic())
                if move is not None:
                    self.states[site] = move.state
                    moves.append(move)
                self.states.setdefault(site, SiteState.HEALTHY)
        return moves

    def _next(self, site: str, state: SiteState, now: float) -> SiteTransition | None:
        silent_s = self._registry.site_silent_s(site)
        if silent_s > self._ttl_s:
            if state is SiteState.UNREACHABLE:
                return None
            return SiteTransition(site, state, SiteState.UNREACHABLE, f"silent for {silent_s:.1f} s")
        if state is SiteState.UNREACHABLE:
            self._heard_again[site] = now
            return SiteTransition(site, state, SiteState.RECOVERING, "heard again")
        if state is SiteState.RECOVERING and now - self._heard_again[site] > self._ttl_s:
            return SiteTransition(site, state, SiteState.HEALTHY, "heard steadily")
        return None

    def unreachable(self) -> list[str]:
        """Remote sites cut off now."""
        return [site for site, state in self.states.items() if state is SiteState.UNREACHABLE]
