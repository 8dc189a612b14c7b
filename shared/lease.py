"""Leases on engine-side state: whatever a request holds lives only while its router wants it.

Every request id names the router that minted it. A router's heartbeat renews the lease of
all its requests at once and lists the (attempt) ids it still runs. An engine service frees
a request it holds when

- its router has been silent for longer than the lease (since its last heartbeat, or since
  the request arrived, whichever is later) while other instances of its site were heard (the
  router died), or its whole site has been silent for longer than the
  cut-off lease (heartbeats crossing a congested or cut WAN arrive late or not at all: the
  link is judged apart from the router), or the router came back as a new incarnation
  (restarted under its name) since the request arrived: nobody will read the request's
  tokens, so everything is dropped now (``kill``);
- or a heartbeat that its router sent well after the request arrived here no longer lists
  it: the request ended and its cancel was lost. It is freed as ``finished``: sequences go,
  a KV import still completes for the cache, exactly as a delivered cancel would do it.
"""

import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from shared import subjects
from shared.messages import LoadReported


@dataclass(frozen=True)
class Expired:
    """A held request whose lease ran out.

    Attributes:
        request_id: The request (attempt) id held here.
        kind: ``kill`` (router gone) or ``finished`` (router no longer runs it).
        reason: Why, for the log.
    """

    request_id: str
    kind: str
    reason: str


@dataclass
class _RouterSeen:
    at: float
    incarnation: str = ""
    since: float = 0.0
    request_ids: frozenset[str] = field(default_factory=frozenset)
    site: str = ""


class RequestLeases:
    """Which held requests still belong to a live router (pure; the caller passes the clock)."""

    def __init__(self, lease_s: float, grace_s: float, now: float | None = None, cut_off_lease_s: float | None = None):
        self.lease_s, self.grace_s = lease_s, grace_s
        self.cut_off_lease_s = max(lease_s, cut_off_lease_s or lease_s)
        self._started = time.monotonic() if now is None else now
        self._routers: dict[str, _RouterSeen] = {}
        self._sites: dict[str, float] = {}
        self._first_seen: dict[str, float] = {}
        self._reported: dict[str, str] = {}

    def observe(self, report: LoadReported, now: float):
        """Record a heartbeat: any instance's tells its site is heard; a router's renews leases."""
        self._sites[report.instance.site] = now
        if report.service != "router":
            return
        router_id, incarnation = report.instance.instance_id, report.instance.incarnation
        seen = self._routers.get(router_id)
        if seen is None:
            # First heard: it may have been running (and sending us requests) before we
            # listened. Only a change of incarnation is a restart.
            since = self._started
        elif seen.incarnation == incarnation:
            since = seen.since
        else:
            since = now
        self._routers[router_id] = _RouterSeen(
            now, incarnation, since, frozenset(report.live_request_ids), report.instance.site
        )

    def expired(self, held: Iterable[str], now: float) -> list[Expired]:
        """The held requests to free now (each reported once per kind)."""
        held = set(held)
        self._first_seen = {rid: self._first_seen.get(rid, now) for rid in held}
        self._reported = {rid: kind for rid, kind in self._reported.items() if rid in held}
        out = []
        for request_id, first_seen in self._first_seen.items():
            origin = subjects.origin_of(request_id)
            seen = self._routers.get(origin)
            # A router never heard from counts from when this instance started listening, and a
            # request of its arriving here is word from it too (a site back from an outage gets
            # requests before the router's next heartbeat).
            silent_s = now - max(seen.at if seen else self._started, first_seen)
            site_silent_s = now - self._sites.get(seen.site, self._started) if seen else silent_s
            lease_s = self.lease_s if site_silent_s <= self.lease_s else self.cut_off_lease_s
            if silent_s > lease_s:
                out.append(Expired(request_id, "kill", f"router {origin} silent for {silent_s:.1f} s"))
            elif seen and first_seen < seen.since and request_id not in seen.request_ids:
                out.append(Expired(request_id, "kill", f"router {origin} restarted"))
            elif seen and seen.at > first_seen + self.grace_s and request_id not in seen.request_ids:
                out.append(Expired(request_id, "finished", f"router {origin} no longer runs it"))
        out = [e for e in out if self._reported.get(e.request_id) != e.kind]
        self._reported.update((e.request_id, e.kind) for e in out)
        return out
