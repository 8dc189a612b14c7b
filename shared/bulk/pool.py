"""Idle bulk connections kept per peer, so a flow reuses connections that earlier flows left
open (TCP's window and TLS's handshake are then already done) instead of dialling anew.

A connection enters the pool only after a flow ended on it cleanly (every byte sent, nothing
left unread); a flow takes it only once the kernel has sent every byte of the earlier flow
(what is still in flight then is at most a window: about what a new connection's handshake
costs). It leaves when a flow takes it, when it has been idle for ``idle_s``
or when something arrived on it (the receiver closed it: ``BulkConnection.looks_idle``). Each flow
still authenticates on every connection it uses (a signed FlowOpen or FlowJoin), so a pooled
connection carries no trust from one flow to the next.

New connections to one peer are dialled at most ``MAX_DIALS_PER_PEER`` at a time (``dial_slot``):
a receiver refuses connections beyond ``receiver.MAX_UNAUTHENTICATED`` still authenticating, and
a burst of flows (a round of requests arriving together) must wait its turn, not be refused.
"""

import asyncio
import time
from collections import deque
from collections.abc import Hashable
from dataclasses import dataclass, field

import structlog

from shared.bulk.connection import BulkConnection
from shared.bulk.receiver import MAX_FLOWS_PER_SENDER

log = structlog.get_logger(__name__)
POOL_IDLE_S = 30.0
"""Longest a connection waits in the pool (receivers drop idle ones later: ``receiver.IDLE_TIMEOUT_S``)."""
MAX_IDLE_PER_PEER = MAX_FLOWS_PER_SENDER
"""Idle connections kept per peer; more are closed as they come back. As many as a receiver lets
one sender use at once: a burst of flows like the last one then finds its connections open
instead of paying a TCP and TLS handshake per flow on both ends (receivers keep at most
``receiver.MAX_IDLE_CONNECTIONS`` idle, all senders together, and close the rest)."""
MAX_DIALS_PER_PEER = 8
"""New connections dialled to one peer at once (TCP, route and TLS handshakes). A quarter of a
receiver's ``MAX_UNAUTHENTICATED`` (32): room for a few senders bursting at once."""


@dataclass
class _Idle:
    connection: BulkConnection
    since_monotonic: float = field(default_factory=time.monotonic)


class BulkPool:
    """Idle connections by peer (any hashable key naming the endpoint, route and TLS identity)."""

    def __init__(self, idle_s: float = POOL_IDLE_S, max_idle_per_peer: int = MAX_IDLE_PER_PEER):
        self._idle: dict[Hashable, deque[_Idle]] = {}
        self._idle_s, self._max_idle = idle_s, max_idle_per_peer
        self._dial_slots: dict[Hashable, asyncio.Semaphore] = {}
        self.reused = 0
        """Connections handed out again (a count for tests and logs)."""

    def take(self, peer: Hashable) -> BulkConnection | None:
        """An idle connection to ``peer`` still fit for use whose earlier flow's bytes have all
        left (the most recently returned such one), or None; stale ones met on the way are
        closed. One still sending stays in the pool: a flow opened on it would wait behind
        those bytes, unseen by the receiver's scheduling (``BulkConnection.unsent_bytes``)."""
        waiting = self._idle.get(peer)
        now = time.monotonic()
        still_sending: list[_Idle] = []
        taken = None
        while waiting and taken is None:
            idle = waiting.pop()
            if now - idle.since_monotonic > self._idle_s or not idle.connection.looks_idle():
                idle.connection.close()
            elif idle.connection.unsent_bytes() > 0:
                still_sending.append(idle)
            else:
                taken = idle.connection
        if waiting is not None:
            waiting.extend(reversed(still_sending))
        if taken is not None:
            self.reused += 1
            taken.reused = True
        return taken

    def dial_slot(self, peer: Hashable) -> asyncio.Semaphore:
        """Held while dialling ``peer`` (``MAX_DIALS_PER_PEER`` holders at once)."""
        slot = self._dial_slots.get(peer)
        if slot is None:
            slot = self._dial_slots[peer] = asyncio.Semaphore(MAX_DIALS_PER_PEER)
        return slot

    def give(self, peer: Hashable, connection: BulkConnection):
        """Keep ``connection`` (every flow on it ended cleanly) for the next flow to ``peer``."""
        if connection.closed:
            return
        waiting = self._idle.setdefault(peer, deque())
        waiting.append(_Idle(connection))
        while len(waiting) > self._max_idle:
            waiting.popleft().connection.close()

    @property
    def num_idle(self) -> int:
        """Idle connections held, all peers together."""
        return sum(len(waiting) for waiting in self._idle.values())

    def close(self):
        """Close every idle connection."""
        for waiting in self._idle.values():
            while waiting:
                waiting.pop().connection.close()
        self._idle.clear()
