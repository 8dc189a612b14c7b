"""Degraded mode: the router's view of each remote site, as an explicit state machine.

``healthy`` → ``unreachable`` when nothing from the site has been heard for the instance TTL
(its heartbeats cross the WAN: the link is cut or stalled, or the whole site is down);
``unreachable`` → ``recovering`` at the first heartbeat again; ``recovering`` → ``healthy``
once the site has been heard steadily for another TTL. While a site is unreachable its
instances are not placed on (with no main decoder left, new requests are served at site A as
``P-RLD``, under the relays' admission bound), and in-flight requests wait for it up to the
partition tolerance before they are resumed at site A. Transitions are logged, traced as
events on the current span, and exported as ``pdd_site_state{site,state}``.
"""

import enum
import time

import structlog
from opentelemetry import trace
from prometheus_client import Gauge

from services.router.registry import InstanceRegistry

log = structlog.get_logger(__name__)
SITE_STATE = Gauge("pdd_site_state", "1 for the state each remote site is in", ["site", "state"])


class SiteState(enum.Enum):
    """Where a remote site stands."""

    HEALTHY = "healthy"
    UNREACHABLE = "unreachable"
    RECOVERING = "recovering"


class SiteHealth:
    """Per-site states, advanced by :meth:`update` from what the registry has heard."""

    def __init__(self, registry: InstanceRegistry, own_site: str, ttl_s: float):
        self._registry, self._own_site, self._ttl_s = registry, own_site, ttl_s
        self.states: dict[str, SiteState] = {}
        self._heard_again: dict[str, float] = {}

    def update(self) -> dict[str, SiteState]:
        """Advance every remote site's state; return them."""
        now = time.monotonic()
        for site in self._registry.sites():
            if site == self._own_site:
                continue
            silent_s = self._registry.site_silent_s(site)
            state = self.states.get(site, SiteState.HEALTHY)
            if silent_s > self._ttl_s:
                state = self._move(site, state, SiteState.UNREACHABLE, f"silent for {silent_s:.1f} s")
            elif state is SiteState.UNREACHABLE:
                self._heard_again[site] = now
                state = self._move(site, state, SiteState.RECOVERING, "heard again")
            elif state is SiteState.RECOVERING and now - self._heard_again[site] > self._ttl_s:
                state = self._move(site, state, SiteState.HEALTHY, "heard steadily")
            self.states[site] = state
        return self.states

    def unreachable(self) -> list[str]:
        """Remote sites cut off now."""
        return [site for site, state in self.states.items() if state is SiteState.UNREACHABLE]

    def _move(self, site: str, old: SiteState, new: SiteState, why: str) -> SiteState:
        if old is not new:
            log.warning("site_state", site=site, previous=old.value, state=new.value, why=why)
            trace.get_current_span().add_event("site_state", {"site": site, "state": new.value, "why": why})
        for state in SiteState:
            SITE_STATE.labels(site, state.value).set(1 if state is new else 0)
        return new
