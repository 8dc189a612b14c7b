"""Prefix cache: a radix tree over chained block hashes, LRU-evicted under the pool's capacity.

Each node is one full KV block. Because a block hash already names its whole prefix, a
child is keyed by its own hash and a lookup walks the chain from the root. Only leaves are
evicted, so the cached set is always closed under prefixes: a hit on block k implies hits
on blocks 0..k-1. Whether a block is in use is the block manager's business; the cache asks
it through ``is_block_free`` before evicting.
"""

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from shared.block_hash import ROOT_PARENT_HASH
from shared.engine.backend import KvEventListener


@dataclass(eq=False)
class CacheNode:
    """One cached block."""

    block_hash: int
    block_id: int
    parent: "CacheNode | None"
    children: dict[int, "CacheNode"] = field(default_factory=dict)
    last_access: int = 0


@dataclass
class PrefixCacheStats:
    """Counters a user reads to see whether the cache is paying off.

    Attributes:
        lookups: Prefix lookups made.
        lookup_blocks: Full blocks asked about across lookups.
        hit_blocks: Of those, blocks found in the cache.
        stored_blocks: Blocks inserted.
        evicted_blocks: Blocks evicted to make room.
    """

    lookups: int = 0
    lookup_blocks: int = 0
    hit_blocks: int = 0
    stored_blocks: int = 0
    evicted_blocks: int = 0

    @property
    def hit_rate(self) -> float:
        """Fraction of looked-up blocks that hit."""
        return self.hit_blocks / self.lookup_blocks if self.lookup_blocks else 0.0


class PrefixCache:
    """Radix tree of cached blocks keyed by chained block hash."""

    def __init__(self, listener: KvEventListener | None = None):
        self._root = CacheNode(ROOT_PARENT_HASH, -1, None)
        self._by_hash: dict[int, CacheNode] = {}
        self._clock = 0
        self.stats = PrefixCacheStats()
        self.listener = listener

    def __len__(self) -> int:
        return len(self._by_hash)

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._by_hash

    def block_hashes(self) -> list[int]:
        """Every cached block hash, parents before children (a dump for the cache-index)."""
        ordered, stack = [], list(self._root.children.values())
        while stack:
            node = stack.pop()
            ordered.append(node.block_hash)
            stack.extend(node.children.values())
        return ordered

    def peek(self, block_hashes: Sequence[int]) -> int:
        """How many leading blocks are cached, without touching LRU order or stats."""
        count, node = 0, self._root
        for block_hash in block_hashes:
            node = node.children.get(block_hash)
            if node is None:
                break
            count += 1
        return count

    def match(self, block_hashes: Sequence[int]) -> list[int]:
        """Block ids of the longest cached prefix of ``block_hashes``; marks them recently used."""
        self._clock += 1
        self.stats.lookups += 1
        self.stats.lookup_blocks += len(block_hashes)
        block_ids, node = [], self._root
        for block_hash in block_hashes:
            node = node.children.get(block_hash)
            if node is None:
                break
            node.last_access = self._clock
            block_ids.append(node.block_id)
        self.stats.hit_blocks += len(block_ids)
        return block_ids

    def insert(self, parent_hash: int, block_hash: int, block_id: int) -> bool:
        """Cache ``block_id`` as the block ``block_hash`` under ``parent_hash``.

        Returns:
            False when the hash is already cached (another sequence computed the same block)
            or the parent is not cached (its chain was evicted); the caller keeps the block
            private then.
        """
        if block_hash in self._by_hash:
            return False
        parent = self._root if parent_hash == ROOT_PARENT_HASH else self._by_hash.get(parent_hash)
        if parent is None:
            return False
        self._clock += 1
        node = CacheNode(block_hash, block_id, parent, last_access=self._clock)
        parent.children[block_hash] = node
        self._by_hash[block_hash] = node
        self.stats.stored_blocks += 1
        if self.listener:
            self.listener("stored", [block_hash])
        return True

    def is_cached_block(self, block_hash: int, block_id: int) -> bool:
        """Whether ``block_id`` is the cache's copy of ``block_hash``."""
        node = self._by_hash.get(block_hash)
        return node is not None and node.block_id == block_id

    def evict_one(self, is_block_free: Callable[[int], bool]) -> int | None:
        """Evict the least recently used leaf whose block nobody uses; return its block id."""
        victim = None
        for node in self._by_hash.values():
            if node.children or not is_block_free(node.block_id):
                continue
            if victim is None or node.last_access < victim.last_access:
                victim = node
        if victim is None:
            return None
        del victim.parent.children[victim.block_hash]
        del self._by_hash[victim.block_hash]
        self.stats.evicted_blocks += 1
        if self.listener:
            self.listener("evicted", [victim.block_hash])
        return victim.block_id
