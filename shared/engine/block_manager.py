"""Block manager: which KV blocks are free, which are in use, which are cached.

A block is in exactly one of three states: free (on the free list), in use (ref count
> 0, held by one or more sequences), or cached-idle (ref count 0 but kept in the prefix
cache until the pool needs room). Sequences that share a cached prefix share its blocks.
"""

from collections import deque

from shared.engine.prefix_cache import PrefixCache
from shared.errors import OutOfKvBlocks


class BlockManager:
    """Allocates blocks, counts references, evicts cached-idle blocks under pressure."""

    def __init__(self, num_blocks: int, prefix_cache: PrefixCache):
        self.num_blocks = num_blocks
        self.prefix_cache = prefix_cache
        self._ref_counts = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._cached: set[int] = set()

    @property
    def num_free_blocks(self) -> int:
        """Blocks on the free list (not counting evictable cached ones)."""
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        """Blocks referenced by at least one sequence."""
        return sum(1 for count in self._ref_counts if count)

    @property
    def num_available_blocks(self) -> int:
        """Blocks an allocation could get now: free plus cached-idle."""
        idle_cached = sum(1 for b in self._cached if self._ref_counts[b] == 0)
        return len(self._free) + idle_cached

    def ref_count(self, block_id: int) -> int:
        """How many sequences hold ``block_id``."""
        return self._ref_counts[block_id]

    def allocate(self, count: int) -> list[int]:
        """Take ``count`` blocks, evicting cached-idle ones LRU-first if the free list runs dry.

        Raises:
            OutOfKvBlocks: fewer than ``count`` blocks can be had; nothing is taken then.
        """
        if count > self.num_available_blocks:
            raise OutOfKvBlocks(f"need {count} KV blocks, {self.num_available_blocks} available")
        blocks = []
        for _ in range(count):
            if not self._free:
                evicted = self.prefix_cache.evict_one(self._is_idle)
                if evicted is None:
                    # An idle cached block whose children another sequence still uses (it
                    # computed the same prefix on its own) counts as available but cannot go.
                    self.release(blocks)
                    raise OutOfKvBlocks(f"need {count} KV blocks, {len(blocks)} could be freed")
                self._cached.discard(evicted)
                self._free.append(evicted)
            block_id = self._free.popleft()
            self._ref_counts[block_id] = 1
            blocks.append(block_id)
        return blocks

    def acquire(self, block_ids: list[int]):
        """Add a reference to blocks found in the prefix cache."""
        for block_id in block_ids:
            self._ref_counts[block_id] += 1

    def release(self, block_ids: list[int]):
        """Drop one reference from each block; unreferenced uncached blocks become free."""
        for block_id in block_ids:
            count = self._ref_counts[block_id] - 1
            if count < 0:
                raise AssertionError(f"block {block_id} released more often than acquired")
            self._ref_counts[block_id] = count
            if count == 0 and block_id not in self._cached:
                self._free.append(block_id)

    def cache_block(self, parent_hash: int, block_hash: int, block_id: int) -> bool:
        """Publish a full, computed block to the prefix cache; False if it was already there."""
        if not self.prefix_cache.insert(parent_hash, block_hash, block_id):
            return False
        self._cached.add(block_id)
        return True

    def _is_idle(self, block_id: int) -> bool:
        return self._ref_counts[block_id] == 0
