"""A simulated instance's KV pool: blocks held by running requests, and a prefix cache of
idle chains evicted least recently used first, tail blocks first.

Every chain here is one session's (the workload names blocks per session), so a radix tree
over them is a set of paths; trimming the least recently used path from its tail is what the
engine's leaf-first LRU eviction does to it. ``tier_blocks`` adds cache room beyond the
device pool (a host-memory tier) for idle chains only.

The exception are blocks every session starts with (the chat template and system prompt),
which the workload names with negative ids: once cached they hit for any session. There are a
handful of them and every request reads them, so they are never the least recently used and
are not counted against the pool.
"""

from collections import OrderedDict

from shared.block_hash import common_prefix


class SimKvPool:
    """Capacity accounting and prefix hits of one instance."""

    def __init__(self, capacity_blocks: int, *, caching: bool = True, tier_blocks: int = 0):
        self.capacity_blocks = capacity_blocks
        self.tier_blocks = tier_blocks
        self.caching = caching
        self.pinned_blocks = 0
        self._chains: OrderedDict[int, tuple[int, ...]] = OrderedDict()
        self._busy: dict[int, int] = {}
        self._idle_blocks = 0
        self._shared_chains: set[tuple[int, ...]] = set()

    def hit_blocks(self, session: int, block_ids: tuple[int, ...]) -> int:
        """Leading blocks of ``block_ids`` this pool holds (no LRU touch)."""
        own = common_prefix(self._chains.get(session) or [], block_ids)
        if not block_ids or block_ids[0] >= 0:
            return own
        return max([own] + [common_prefix(chain, block_ids) for chain in self._shared_chains])

    def _cache_shared(self, chain: tuple[int, ...]):
        """Remember ``chain``'s leading shared blocks (negative ids) for every session."""
        lead = 0
        while lead < len(chain) and chain[lead] < 0:
            lead += 1
        if lead:
            self._shared_chains.add(chain[:lead])

    def fits(self, num_blocks: int) -> bool:
        """Whether ``num_blocks`` more can be held by running requests now."""
        return self.pinned_blocks + num_blocks <= self.capacity_blocks

    def pin(self, session: int, num_blocks: int):
        """A request of ``session`` holds ``num_blocks`` (its cached prefix included)."""
        if session in self._chains:
            if session not in self._busy:
                self._idle_blocks -= len(self._chains[session])
            self._chains.move_to_end(session)
        self._busy[session] = self._busy.get(session, 0) + 1
        self.pinned_blocks += num_blocks
        self._evict()

    def unpin(self, session: int, num_blocks: int, chain: tuple[int, ...] | None):
        """The request ended; ``chain`` (its computed full blocks) stays cached when caching."""
        self.pinned_blocks -= num_blocks
        self._busy[session] -= 1
        still_busy = self._busy[session] > 0
        if not still_busy:
            del self._busy[session]
        old = self._chains.pop(session, None)
        keep = chain if self.caching and chain else old
        if keep:
            self._chains[session] = keep
            self._cache_shared(keep)
            if not still_busy:
                self._idle_blocks += len(keep)
        self._evict()

    def set_chain(self, session: int, chain: tuple[int, ...]):
        """A running request of ``session`` now has ``chain`` computed (its import or prefill
        landed): those blocks are cached, shared with whoever asks next."""
        if self.caching and session in self._busy:
            self._chains[session] = chain
            self._chains.move_to_end(session)
            self._cache_shared(chain)

    def insert_idle(self, session: int, chain: tuple[int, ...]):
        """History that lands without a running request (a warm cluster's earlier turn)."""
        if not self.caching or session in self._busy:
            return
        old = self._chains.pop(session, None)
        self._idle_blocks += len(chain) - (len(old) if old else 0)
        self._chains[session] = chain
        self._cache_shared(chain)
        self._evict()

    @property
    def used_blocks(self) -> int:
        """Blocks held: running requests' plus idle cached ones within the device pool."""
        return self.pinned_blocks + min(self._idle_blocks, max(0, self.capacity_blocks - self.pinned_blocks))

    def _evict(self):
        room = max(0, self.capacity_blocks + self.tier_blocks - self.pinned_blocks)
        while self._idle_blocks > room:
            victim = next((s for s in self._chains if s not in self._busy), None)
            if victim is None:
                return
            chain = self._chains[victim]
            drop = min(len(chain), self._idle_blocks - room)
            self._idle_blocks -= drop
            if drop == len(chain):
                del self._chains[victim]
            else:
                self._chains[victim] = chain[: len(chain) - drop]
