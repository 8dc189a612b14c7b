"""Routing a bulk connection through the WAN link to the receiver it names.

A routed link port forwards each connection to the ``host:port`` its first message, a
``LinkRoute``, names; so one link port serves any number of receivers at the far site
(``docker compose --scale main-decode=N``, a Deployment's replicas) with no per-instance
route. The route is signed with a key derived from the bulk secret: the link can refuse
connections from anyone who does not hold the secret (it is no open proxy into the far
site), yet it cannot sign FlowOpens, and it never sees the flow's bytes in clear once TLS
starts.
"""

import hashlib
import hmac
import time

import msgspec

from shared.bulk.auth import ReplayGuard, new_nonce
from shared.messages import LinkRoute, encode

ROUTE_KEY_CONTEXT = b"pdd wan-link route key v1"


def route_key(bulk_secret: str) -> str:
    """The link's route key: a one-way function of the bulk secret."""
    return hmac.new(bulk_secret.encode(), ROUTE_KEY_CONTEXT, hashlib.sha256).hexdigest()


def _mac(route: LinkRoute, key: str) -> str:
    unsigned = msgspec.structs.replace(route, mac="")
    return hmac.new(key.encode(), encode(unsigned), hashlib.sha256).hexdigest()


def sign_route(target: str, key: str, now: float | None = None) -> LinkRoute:
    """A signed ``LinkRoute`` to ``target`` (``host:port``), stamped ``now`` (default: now)."""
    route = LinkRoute(target=target, unix_s=time.time() if now is None else now, nonce=new_nonce())
    return msgspec.structs.replace(route, mac=_mac(route, key))


class RouteAuthenticator:
    """The link's check of a ``LinkRoute``: MAC, freshness, single use, allowed port."""

    def __init__(self, key: str):
        if not key:
            raise ValueError("a routed link port needs the route key (--route-key-file)")
        self._key = key
        self._replays = ReplayGuard()

    def verify(self, route: LinkRoute, allowed_port: int = 0, now: float | None = None) -> str | None:
        """None if ``route`` may be forwarded, else why not.

        Args:
            route: The connection's opening.
            allowed_port: The only target port allowed (0: any).
            now: The time to judge freshness at (default: now).
        """
        if not hmac.compare_digest(_mac(route, self._key), route.mac):
            return "bad MAC: the peer does not hold this deployment's bulk secret"
        host, _, port = route.target.rpartition(":")
        if not host or not port.isdigit():
            return f"target {route.target!r} is not host:port"
        if allowed_port and int(port) != allowed_port:
            return f"target port {port} is not the routed port {allowed_port}"
        return self._replays.check(route.unix_s, route.nonce, time.time() if now is None else now)
