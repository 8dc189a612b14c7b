"""Block hashing, the prefix cache's radix tree and the block manager's bookkeeping."""

import pytest

from shared.block_hash import HASH_SCHEME_VERSION, ROOT_PARENT_HASH, hash_block, hash_blocks
from shared.engine.block_manager import BlockManager
from shared.engine.prefix_cache import PrefixCache
from shared.errors import OutOfKvBlocks


def test_block_hash_is_chained_and_stable():
    tokens = list(range(40))
    hashes = hash_blocks(tokens, 16)
    assert len(hashes) == 2  # the 8-token tail is not hashed
    assert hashes[0] == hash_block(ROOT_PARENT_HASH, tokens[:16])
    assert hashes[1] == hash_block(hashes[0], tokens[16:32])
    assert hash_blocks(tokens, 16) == hashes
    assert HASH_SCHEME_VERSION == 1


def test_block_hash_depends_on_whole_prefix():
    a = hash_blocks([1] * 16 + [2] * 16, 16)
    b = hash_blocks([3] * 16 + [2] * 16, 16)
    assert a[1] != b[1], "same second block under different first blocks must differ"
    assert hash_block(0, [5] * 16) != hash_block(0, [5] * 15 + [6])


def chain(n: int, start: int = 0) -> list[int]:
    return hash_blocks(list(range(start, start + 16 * n)), 16)


def test_match_returns_longest_cached_prefix():
    cache = PrefixCache()
    hashes = chain(3)
    parent = ROOT_PARENT_HASH
    for block_id, block_hash in enumerate(hashes[:2]):
        assert cache.insert(parent, block_hash, block_id)
        parent = block_hash
    assert cache.match(hashes) == [0, 1]
    assert cache.match(chain(3, start=1)) == []
    assert cache.stats.hit_blocks == 2 and cache.stats.lookup_blocks == 6


def test_insert_refuses_duplicates_and_orphans():
    cache = PrefixCache()
    hashes = chain(2)
    assert cache.insert(ROOT_PARENT_HASH, hashes[0], 7)
    assert not cache.insert(ROOT_PARENT_HASH, hashes[0], 8)
    assert not cache.insert(12345, hashes[1], 9)  # unknown parent
    assert cache.is_cached_block(hashes[0], 7) and not cache.is_cached_block(hashes[0], 8)


def test_events_report_stored_and_evicted_hashes():
    events = []
    cache = PrefixCache(listener=lambda kind, hashes: events.append((kind, hashes)))
    hashes = chain(1)
    cache.insert(ROOT_PARENT_HASH, hashes[0], 0)
    assert cache.evict_one(lambda block_id: True) == 0
    assert events == [("stored", hashes), ("evicted", hashes)]


def filled_manager(num_blocks: int, chains: list[list[int]]) -> BlockManager:
    """A manager whose cache holds each chain, every block released (cached-idle)."""
    manager = BlockManager(num_blocks, PrefixCache())
    for hashes in chains:
        blocks = manager.allocate(len(hashes))
        parent = ROOT_PARENT_HASH
        for block_id, block_hash in zip(blocks, hashes):
            manager.cache_block(parent, block_hash, block_id)
            parent = block_hash
        manager.release(blocks)
    return manager


def test_lru_eviction_takes_least_recent_leaf_first():
    old, new = chain(2, start=0), chain(2, start=1000)
    manager = filled_manager(4, [old, new])
    manager.prefix_cache.match(new)  # touch the new chain
    assert manager.num_free_blocks == 0 and manager.num_available_blocks == 4
    manager.allocate(1)
    # The leaf of the old chain goes first; its root stays (still a valid shorter prefix).
    assert manager.prefix_cache.match(old) != [] and len(manager.prefix_cache.match(old)) == 1
    assert len(manager.prefix_cache.match(new)) == 2


def test_blocks_in_use_are_never_evicted():
    hashes = chain(2)
    manager = filled_manager(2, [hashes])
    held = manager.prefix_cache.match(hashes)
    manager.acquire(held)
    with pytest.raises(OutOfKvBlocks):
        manager.allocate(1)
    assert manager.prefix_cache.match(hashes) == held
    manager.release(held)
    assert len(manager.allocate(2)) == 2
    assert len(manager.prefix_cache) == 0


def test_failed_allocation_takes_nothing():
    manager = BlockManager(4, PrefixCache())
    manager.allocate(3)
    with pytest.raises(OutOfKvBlocks):
        manager.allocate(2)
    assert manager.num_free_blocks == 1


def test_shared_block_is_freed_only_by_its_last_holder():
    manager = BlockManager(2, PrefixCache())
    [block] = manager.allocate(1)
    manager.acquire([block])
    manager.release([block])
    assert manager.num_free_blocks == 1
    manager.release([block])
    assert manager.num_free_blocks == 2
    with pytest.raises(AssertionError):
        manager.release([block])


def test_kv_event_bursts_merge_only_consecutive_events_of_one_kind():
    from shared.engine_service import _merge_runs

    burst = [("stored", [1]), ("stored", [2]), ("evicted", [1]), ("stored", [3])]
    assert _merge_runs(burst) == [("stored", [1, 2]), ("evicted", [1]), ("stored", [3])]
