"""Peer authentication of bulk flows: an Ed25519 signature over the FlowOpen.

Only the sender (prefill) can open a flow: it signs with a private key derived from the
deployment's bulk secret, which only prefill holds; receivers (relay and main decode) hold
just the public key (``bulk-verify.pub``), which checks a signature but cannot make one, so no
decoder can open a flow into another. Costs no extra round trip: the sender signs its FlowOpen
(with its clock and a fresh nonce); the receiver checks the signature, that the flow names it
(instance and incarnation, so a FlowOpen cannot be replayed to another receiver or to this one
after a restart), the clock skew and that the nonce was not seen before. A striped flow's
further connections each open with a ``FlowJoin`` signed and checked the same way, so every
connection authenticates on its own (the union tag in the signed bytes keeps a FlowOpen's
signature from passing for a FlowJoin's).
"""

import functools
import hashlib
import hmac
import secrets
import time
from typing import TypeVar

import msgspec
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from shared.messages import FlowJoin, FlowOpen, encode

MAX_CLOCK_SKEW_S = 300.0
_SIGNING_KEY_CONTEXT = b"pdd bulk flow signing key v1"
Signed = FlowOpen | FlowJoin
"""The signed openings of a bulk connection."""
S = TypeVar("S", FlowOpen, FlowJoin)


@functools.lru_cache(maxsize=8)
def _signing_key(secret: str) -> Ed25519PrivateKey:
    seed = hmac.new(secret.encode(), _SIGNING_KEY_CONTEXT, hashlib.sha256).digest()
    return Ed25519PrivateKey.from_private_bytes(seed)


def verify_key(secret: str) -> str:
    """The public key (hex) that checks FlowOpens signed with ``secret``: what receivers hold."""
    return _signing_key(secret).public_key().public_bytes(Encoding.Raw, PublicFormat.Raw).hex()


def sign(flow_open: S, secret: str) -> S:
    """Return ``flow_open`` (a FlowOpen or FlowJoin) with its signature (``mac``, hex) made with
    ``secret``'s private key."""
    unsigned = msgspec.structs.replace(flow_open, mac="")
    return msgspec.structs.replace(flow_open, mac=_signing_key(secret).sign(encode(unsigned)).hex())


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

    def __init__(self, public_key: str, receiver_id: str = "", incarnation: str = ""):
        """``public_key``: the deployment's flow verify key (hex, ``verify_key``)."""
        if not public_key:
            raise ValueError("a bulk verify key is required (--bulk-verify-key-file / PDD_BULK_VERIFY_KEY_FILE)")
        try:
            self._public_key = Ed25519PublicKey.from_public_bytes(bytes.fromhex(public_key))
        except ValueError:
            raise ValueError("the bulk verify key must be 32 bytes of hex (bulk-verify.pub)") from None
        self._receiver_id, self._incarnation = receiver_id, incarnation
        self._replays = ReplayGuard()

    def verify(self, flow_open: Signed, now: float | None = None) -> str | None:
        """None if ``flow_open`` (a FlowOpen or FlowJoin) is authentic, fresh and for this
        receiver, else why not."""
        now = time.time() if now is None else now
        try:
            self._public_key.verify(bytes.fromhex(flow_open.mac), encode(msgspec.structs.replace(flow_open, mac="")))
        except (InvalidSignature, ValueError):
            return "bad signature: the peer does not hold this deployment's flow signing key"
        if self._receiver_id and flow_open.receiver_id != self._receiver_id:
            return f"FlowOpen for {flow_open.receiver_id!r}, not this receiver"
        if self._incarnation and flow_open.receiver_incarnation != self._incarnation:
            return "FlowOpen for an earlier incarnation of this receiver"
        return self._replays.check(flow_open.unix_s, flow_open.nonce, now)
