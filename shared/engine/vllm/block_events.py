"""vLLM's KV cache events as PDD's: which blocks are cached, named by PDD's chained hashes.

vLLM names a block by its own hash; PDD's cache-index, router and wire frames name it by the
chained xxh3 hash of its tokens (``shared/block_hash.py``). ``BlockMirror`` receives vLLM's
``BlockStored`` (tokens and parent included) and ``BlockRemoved`` events, keeps the mapping,
and tells the backend's listener what PDD calls stored and evicted. Its set of cached hashes
answers prefix lookups and dumps without touching vLLM.
"""

from collections.abc import Callable

from shared.block_hash import ROOT_PARENT_HASH, hash_blocks


class BlockMirror:
    """The cached blocks of one vLLM engine, under PDD's hashes.

    Args:
        block_size: Tokens per block (vLLM's and PDD's are the same).
        listener: ``("stored" | "evicted", hashes)``, or None.
    """

    def __init__(self, block_size: int, listener: Callable[[str, list[int]], None] | None = None):
        self.block_size, self.listener = block_size, listener
        self._ours: dict[object, int] = {}  # vLLM hash -> PDD hash, in the order stored

    def publish(self, batch):
        """An ``EventPublisher``'s ``publish``: apply one batch of vLLM events."""
        for event in batch.events:
            kind = type(event).__name__
            if kind == "BlockStored":
                self._stored(event)
            elif kind == "BlockRemoved":
                self._removed(event.block_hashes)
            elif kind == "AllBlocksCleared":
                self._removed(list(self._ours))

    def shutdown(self):
        """The ``EventPublisher`` interface: nothing to close."""

    def get_publisher_config(self):
        """The ``EventPublisher`` interface: no socket to describe."""
        return

    def _stored(self, event):
        parent = (
            self._ours.get(event.parent_block_hash, ROOT_PARENT_HASH)
            if event.parent_block_hash is not None
            else ROOT_PARENT_HASH
        )
        hashes = hash_blocks(event.token_ids, self.block_size, parent)
        new = []
        for theirs, ours in zip(event.block_hashes, hashes):
            if theirs not in self._ours:
                self._ours[theirs] = ours
                new.append(ours)
        if new and self.listener:
            self.listener("stored", new)

    def _removed(self, their_hashes):
        gone = [self._ours.pop(theirs) for theirs in their_hashes if theirs in self._ours]
        if gone and self.listener:
            self.listener("evicted", gone)

    def cached_prefix_blocks(self, block_hashes: list[int]) -> int:
        """Leading blocks of the chain that are cached."""
        cached = set(self._ours.values())
        count = 0
        for block_hash in block_hashes:
            if block_hash not in cached:
                break
            count += 1
        return count

    def cached_hashes(self) -> list[int]:
        """Every cached block, parents before children (the order they were stored)."""
        return list(self._ours.values())
