"""The scheduler: which sequences compute how many tokens in the next step, and their blocks.

It owns the table of live sequences and their block tables. Each step takes decodes first,
then prompts and extends by fewest tokens left to compute (ties in arrival order), under a
token budget: a short or warm prompt never waits behind more than the one step in progress of
a long prompt's chunks (which fill whatever budget the short ones leave). A prompt's first
computed chunk may be bounded lower (``first_chunk_tokens``), so a prefill's first blocks are
ready sooner. A sequence that cannot get blocks
waits for others to finish; when none can run at all, the youngest running sequence is
preempted (its blocks freed, its KV recomputed later, as vLLM's recompute preemption does).
Completed blocks are published to the prefix cache as soon as their KV exists.
"""

import math

from shared.block_hash import ROOT_PARENT_HASH, hash_block
from shared.engine.backend import RequestStatus
from shared.engine.block_manager import BlockManager
from shared.engine.model_runner import ScheduledSequence
from shared.engine.prefix_cache import PrefixCache
from shared.engine.sequence import Sequence
from shared.errors import OutOfKvBlocks, UnknownRequest


class Scheduler:
    """The live sequences of one engine and the blocks they hold."""

    def __init__(
        self,
        blocks: BlockManager,
        prefix_cache: PrefixCache,
        block_size: int,
        max_batch_tokens: int,
        enable_prefix_cache: bool = True,
        first_chunk_tokens: int = 0,
    ):
        self.blocks = blocks
        self.prefix_cache = prefix_cache
        self.block_size = block_size
        self.max_batch_tokens = max_batch_tokens
        self.enable_prefix_cache = enable_prefix_cache
        self.first_chunk_tokens = first_chunk_tokens
        self.sequences: dict[str, Sequence] = {}
        self.num_preemptions = 0

    def get(self, request_id: str) -> Sequence:
        """The live sequence ``request_id``."""
        seq = self.sequences.get(request_id)
        if seq is None:
            raise UnknownRequest(f"unknown request {request_id!r}")
        return seq

    def adopt_cached_prefix(self, seq: Sequence, block_hashes: list[int]) -> list[int]:
        """Give ``seq`` the cached blocks of its longest prefix hit; return their ids."""
        hit = self.prefix_cache.match(block_hashes) if self.enable_prefix_cache else []
        self.blocks.acquire(hit)
        seq.block_ids = list(hit)
        seq.block_hashes = block_hashes[: len(hit)]
        seq.num_kv_tokens = seq.num_cached_tokens = len(hit) * self.block_size
        return hit

    def remove(self, request_id: str) -> Sequence:
        """Forget a sequence and release its blocks (cached ones stay reusable)."""
        seq = self.sequences.pop(request_id, None)
        if seq is None:
            raise UnknownRequest(f"unknown request {request_id!r}")
        self.blocks.release(seq.block_ids)
        seq.block_ids = []
        return seq

    def has_work(self) -> bool:
        """Whether a step would compute anything."""
        return any(seq.schedulable for seq in self.sequences.values())

    def schedule(self) -> tuple[list[ScheduledSequence], Sequence | None]:
        """The next step's batch; or, when nothing fits even after preemption, the sequence
        that can never fit (it must fail)."""
        candidates = sorted((s for s in self.sequences.values() if s.schedulable), key=lambda s: s.num_pending_tokens)
        budget, batch, starved = self.max_batch_tokens, [], []
        for seq in candidates:
            num_tokens = min(seq.num_pending_tokens, budget, self._chunk_bound(seq))
            if num_tokens == 0:
                break
            try:
                self.ensure_blocks(seq, seq.num_kv_tokens + num_tokens)
            except OutOfKvBlocks:
                starved.append(seq)
                continue
            samples = seq.num_kv_tokens + num_tokens == len(seq.token_ids) and not seq.hold_after_compute
            batch.append(ScheduledSequence(seq, num_tokens, samples))
            budget -= num_tokens
        if batch or not starved:
            return batch, None
        victim = self._preemption_victim(spare=starved[0])
        if victim is None:
            return [], starved[0]
        self._preempt(victim)
        return self.schedule()

    def _chunk_bound(self, seq: Sequence) -> int:
        """Most tokens ``seq`` may compute in this step."""
        if self.first_chunk_tokens and not seq.num_computed_tokens:
            return self.first_chunk_tokens
        return self.max_batch_tokens

    def computed(self, batch: list[ScheduledSequence]) -> list[Sequence]:
        """Record the step's KV as computed; return the held extends it completed."""
        absorbed = []
        for entry in batch:
            seq = entry.seq
            seq.num_kv_tokens += entry.num_tokens
            seq.num_computed_tokens += entry.num_tokens
            self.cache_full_blocks(seq)
            if seq.hold_after_compute and not seq.num_pending_tokens and seq.status is RequestStatus.RUNNING:
                seq.hold_after_compute = False
                absorbed.append(seq)
        return absorbed

    def ensure_blocks(self, seq: Sequence, num_tokens: int):
        """Grow ``seq``'s block table to hold ``num_tokens`` tokens."""
        missing = math.ceil(num_tokens / self.block_size) - len(seq.block_ids)
        if missing > 0:
            seq.block_ids.extend(self.blocks.allocate(missing))

    def cache_full_blocks(self, seq: Sequence):
        """Publish every newly completed block of ``seq`` to the prefix cache."""
        block_size = self.block_size
        for index in range(len(seq.block_hashes), seq.num_kv_tokens // block_size):
            parent = seq.block_hashes[-1] if seq.block_hashes else ROOT_PARENT_HASH
            block_hash = hash_block(parent, seq.token_ids[index * block_size : (index + 1) * block_size])
            if self.enable_prefix_cache:
                self.blocks.cache_block(parent, block_hash, seq.block_ids[index])
            seq.block_hashes.append(block_hash)

    def _preemption_victim(self, spare: Sequence) -> Sequence | None:
        """The youngest running sequence holding blocks, other than ``spare`` (the oldest waits)."""
        running = [
            s for s in self.sequences.values() if s is not spare and s.status is RequestStatus.RUNNING and s.block_ids
        ]
        return running[-1] if running else None

    def _preempt(self, seq: Sequence):
        """Free a running sequence's blocks; it recomputes its KV later. Its output is unchanged:
        token ``i`` depends only on the tokens before it and on ``(seed, i)``."""
        self.blocks.release(seq.block_ids)
        seq.block_ids, seq.block_hashes, seq.num_kv_tokens = [], [], 0
        self.num_preemptions += 1
