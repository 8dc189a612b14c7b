"""Peer authentication of bulk flows: an HMAC over the FlowOpen with the deployment secret.

Costs no extra round trip: the sender signs its FlowOpen (with its clock and a fresh nonce);
the receiver checks the MAC, that the flow names it (instance and incarnation, so a FlowOpen
cannot be replayed to another receiver or to this one after a restart), the clock skew and
that the nonce was not seen before.
"""

import hashlib
import hmac
import secrets
import time

import msgspec

from shared.messages import FlowOpen, encode

MAX_CLOCK_SKEW_S = 300.0


def sign(flow_open: FlowOpen, secret: str) -> FlowOpen:
    """Return ``flow_open`` with its ``mac`` set."""
    unsigned = msgspec.structs.replace(flow_open, mac="")
    mac = hmac.new(secret.encode(), encode(unsigned), hashlib.sha256).hexdigest()
    return msgspec.structs.replace(flow_open, mac=mac)


def new_nonce() -> str:
    """A fresh random nonce."""
    return secrets.token_hex(16)


class ReplayGuard:
    """Freshness and single use of signed openings: a clock within ``MAX_CLOCK_SKEW_S`` of
    ours and a nonce not seen before (remembered for twice the skew, then forgotten)."""

    def __init__(self):
        self._seen: dict[str, float] = {}

    def check(self, unix_s: float, nonce: str, now: float) -> str | None:
        """None if fresh and unseen (the nonce is then remembered), else why not."""
        if abs(now - unix_s) > MAX_CLOCK_SKEW_S:
            return f"stale opening: clock skew above {MAX_CLOCK_SKEW_S:.0f} s"
        self._forget_older_than(now - 2 * MAX_CLOCK_SKEW_S)
        if nonce in self._seen:
            return "replayed nonce"
        self._seen[nonce] = now
        return None

    def _forget_older_than(self, cutoff: float):
        for nonce in [n for n, t in self._seen.items() if t < cutoff]:
            del self._seen[nonce]


class FlowAuthenticator:
    """Receiver-side check of signed FlowOpens, with replay protection."""

    def __init__(self, secret: str, receiver_id: str = "", incarnation: str = ""):
        if not secret:
            raise ValueError("a bulk secret is required (--bulk-secret / PDD_BULK_SECRET)")
        self._secret = secret
        self._receiver_id, self._incarnation = receiver_id, incarnation
        self._replays = ReplayGuard()

    def verify(self, flow_open: FlowOpen, now: float | None = None) -> str | None:
        """None if authentic and fresh, else why not."""
        now = time.time() if now is None else now
        expected = sign(flow_open, self._secret).mac
        if not hmac.compare_digest(expected, flow_open.mac):
            return "bad MAC: the peer does not hold this deployment's bulk secret"
        if self._receiver_id and flow_open.receiver_id != self._receiver_id:
            return f"FlowOpen for {flow_open.receiver_id!r}, not this receiver"
        if self._incarnation and flow_open.receiver_incarnation != self._incarnation:
            return "FlowOpen for an earlier incarnation of this receiver"
        return self._replays.check(flow_open.unix_s, flow_open.nonce, now)
