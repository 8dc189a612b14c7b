"""Chained block hashes: the key of every prefix cache and of the cache-index.

A block's hash covers its parent's hash and its own token IDs, so one 64-bit value names
the whole prefix up to and including that block. Only full blocks are hashed.
"""

from collections.abc import Sequence

import numpy as np
import xxhash

HASH_SCHEME_VERSION = 1
"""Bumped whenever the byte layout hashed below changes; carried in every message."""

ROOT_PARENT_HASH = 0
"""The parent hash of a sequence's first block."""


def hash_block(parent_hash: int, token_ids: Sequence[int]) -> int:
    """Hash one block: xxh3-64 of the parent hash (u64 LE) then the token IDs (u32 LE).

    Args:
        parent_hash: Hash of the previous block, or ``ROOT_PARENT_HASH`` for the first.
        token_ids: Exactly one block's token IDs.

    Returns:
        The block's 64-bit hash as a Python int.
    """
    hasher = xxhash.xxh3_64()
    hasher.update(parent_hash.to_bytes(8, "little"))
    hasher.update(np.asarray(token_ids, dtype="<u4").tobytes())
    return hasher.intdigest()


def hash_blocks(token_ids: Sequence[int], block_size: int, parent_hash: int = ROOT_PARENT_HASH) -> list[int]:
    """Chained hashes of every full block in ``token_ids``; a partial tail is skipped.

    Args:
        token_ids: Token IDs starting at a block boundary.
        block_size: Tokens per block.
        parent_hash: Hash of the block before ``token_ids[0]``.

    Returns:
        One hash per full block, in order.
    """
    hashes = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent_hash = hash_block(parent_hash, token_ids[start : start + block_size])
        hashes.append(parent_hash)
    return hashes


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading block hashes two chains share. Chained: equal at ``i`` means equal up
    to ``i``, so the shared entries are a prefix and a binary search finds its end."""
    low, high = 0, min(len(a), len(b))
    if high and a[high - 1] == b[high - 1]:
        return high
    while low < high:  # a[:low] == b[:low]; a[high] != b[high]
        middle = (low + high) // 2
        if a[middle] == b[middle]:
            low = middle + 1
        else:
            high = middle
    return low
