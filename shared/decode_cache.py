"""The decode-side cache's policy: what a decoder keeps, and what blocks in flight mean.

A decoder's prefix cache is what makes the WAN cheap: a follow-up turn sends only the blocks
main decode lacks. The rules that keep it so:

- **What is kept.** Every complete block a decoder imported or computed stays cached after
  its request is freed, until the pool needs the room (LRU, leaves first).
- **A request that ended elsewhere** (the relay finished it while its KV still crossed)
  still imports to the end, so the decoder's cache stays aligned with the prefill's; then it
  is freed. Any other cancel drops the request's KV at once; complete blocks already cached
  stay valid.
- **Blocks in flight.** A flow whose prompt shares leading blocks with an earlier flow that
  is still importing (or still waiting itself) waits until the cache holds those shared
  blocks (the earlier flow imports them frame by frame), then asks only for what the cache
  lacks: the same blocks never cross the same link twice, and two prompts that share only a
  system prompt do not queue whole behind each other. Flows wait only on earlier arrivals, so
  no two wait on each other; every wait is bounded by the caller.
"""

import asyncio
import itertools
from dataclasses import dataclass, field

from shared.block_hash import common_prefix


@dataclass
class Claim:
    """A flow's place in line: the blocks it brings, and when it is done bringing them.

    Attributes:
        ticket: Arrival order.
        block_hashes: The prompt's block hashes.
        done: Set when the flow's import ended (its blocks are cached or dropped).
        progressed: Pulsed (set, then cleared) when one of its frames was imported.
        cancelled: Set when the request was cancelled while the flow still waited in line.
        finished_elsewhere: The cancel said the request ended elsewhere (import, then free).
    """

    ticket: int
    block_hashes: list[int]
    done: asyncio.Event = field(default_factory=asyncio.Event)
    progressed: asyncio.Event = field(default_factory=asyncio.Event)
    cancelled: asyncio.Event = field(default_factory=asyncio.Event)
    finished_elsewhere: bool = False

    @property
    def dropped(self) -> bool:
        """Whether a cancel means this flow must not import at all."""
        return self.cancelled.is_set() and not self.finished_elsewhere


class InFlightBlocks:
    """The flows of one decoder that are waiting or importing, in arrival order."""

    def __init__(self):
        self.claims: dict[str, Claim] = {}
        self._tickets = itertools.count()

    def claim(self, request_id: str, block_hashes: list[int]) -> Claim:
        """Put a new flow in line."""
        claim = self.claims[request_id] = Claim(next(self._tickets), block_hashes)
        return claim

    def release(self, request_id: str):
        """The flow's import ended: flows waiting on it go on."""
        claim = self.claims.pop(request_id, None)
        if claim is not None:
            claim.done.set()

    def progressed(self, request_id: str):
        """One of the flow's frames was imported: flows waiting on it look at the cache again."""
        claim = self.claims.get(request_id)
        if claim is not None:
            claim.progressed.set()  # wakes every waiter now
            claim.progressed.clear()

    def blocker(self, claim: Claim, cached_blocks: int) -> tuple[str, Claim] | None:
        """The earlier flow bringing more of this prompt's leading blocks than the cache
        holds (the one sharing the longest prefix), or None: the flow may ask for the rest."""
        shared, request_id, blocker = max(
            (
                (common_prefix(other.block_hashes, claim.block_hashes), rid, other)
                for rid, other in self.claims.items()
                if other.ticket < claim.ticket
            ),
            key=lambda overlap: overlap[0],
            default=(0, None, None),
        )
        return (request_id, blocker) if shared > cached_blocks else None

    def cancel_waiting(self, request_id: str, finished_elsewhere: bool) -> bool:
        """Mark a flow still in line as cancelled; True if there was one."""
        claim = self.claims.get(request_id)
        if claim is None:
            return False
        claim.finished_elsewhere = finished_elsewhere
        claim.cancelled.set()
        return True


def keeps_importing(finished_elsewhere: bool) -> bool:
    """Whether a cancelled request's import goes on (for the cache) or stops now."""
    return finished_elsewhere
