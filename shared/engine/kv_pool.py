"""The preallocated KV pool: one tensor holding every block of every layer.

Layout ``[layers, 2 (K/V), kv_heads, num_blocks, block_size, head_dim]``. Allocating it
once avoids the per-step re-concatenation of HF's DynamicCache. Heads outermost (within a
layer's K or V) make a block of one head 16 contiguous rows: gathering a batch's block
tables gives every sequence's K and V as contiguous ``[tokens, head_dim]`` rows per head,
the layout SDPA reads fastest (measured against token-major blocks: 1.4x less attention time
at batch 16, docs/engine.md); export and import copy one block at a time between the pool
and the wire's token-major frames.
"""

import torch

from shared.kv_layout import KvLayout


class KvPool:
    """Fixed-capacity storage for KV blocks; knows nothing about who owns which block."""

    def __init__(self, layout: KvLayout, num_blocks: int, device: torch.device):
        self.layout = layout
        self.num_blocks = num_blocks
        self.device = device
        self.kv = torch.zeros(
            layout.num_layers,
            2,
            layout.num_kv_heads,
            num_blocks,
            layout.block_size,
            layout.head_dim,
            dtype=layout.dtype,
            device=device,
        )
        # Flat views [kv_heads, num_blocks * block_size, head_dim] per layer for slot writes.
        self._flat = self.kv.view(layout.num_layers, 2, layout.num_kv_heads, -1, layout.head_dim)

    @property
    def kv_bytes(self) -> int:
        """Total bytes the pool occupies."""
        return self.kv.numel() * self.kv.element_size()

    def write(self, layer: int, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor):
        """Store new tokens' K and V (``[kv_heads, tokens, head_dim]``) at flat slot indices."""
        self._flat[layer, 0].index_copy_(1, slots, keys)
        self._flat[layer, 1].index_copy_(1, slots, values)

    def gather_blocks(self, layer: int, block_tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of ``block_tables`` (``[sequences, blocks]``): two ``[sequences, kv_heads,
        blocks * block_size, head_dim]`` views of one copy per tensor, token rows contiguous.

        Rows past a sequence's length (a part-filled last block, padding blocks) hold whatever
        the pool holds there: the caller masks them.
        """
        num_seqs = block_tables.shape[0]
        flat = block_tables.reshape(-1)
        shape = (self.layout.num_kv_heads, num_seqs, -1, self.layout.head_dim)
        keys = self.kv[layer, 0].index_select(1, flat).view(shape).transpose(0, 1)
        values = self.kv[layer, 1].index_select(1, flat).view(shape).transpose(0, 1)
        return keys, values

    def export_tokens(self, block_ids: list[int], num_tokens: int) -> torch.Tensor:
        """Copy out ``num_tokens`` tokens held in ``block_ids``: ``[layers, 2, tokens, heads, dim]``.

        One strided copy per block straight into the token-major result (no intermediate
        gather), every layer's K and V in the same call.
        """
        layout = self.layout
        tokens_kv = torch.empty(
            layout.num_layers,
            2,
            num_tokens,
            layout.num_kv_heads,
            layout.head_dim,
            dtype=layout.dtype,
            device=self.device,
        )
        head_major = tokens_kv.permute(0, 1, 3, 2, 4)
        for start, block_id, length in self._block_runs(block_ids, num_tokens):
            head_major[:, :, :, start : start + length].copy_(self.kv[:, :, :, block_id, :length])
        return tokens_kv

    def import_tokens(self, block_ids: list[int], tokens_kv: torch.Tensor):
        """Write ``[layers, 2, tokens, heads, dim]`` into ``block_ids`` from their first slot on.

        Converts dtype and device when the sender's differ (heterogeneous instances).
        """
        num_tokens = tokens_kv.shape[2]
        head_major = tokens_kv.to(device=self.device, dtype=self.layout.dtype).permute(0, 1, 3, 2, 4)
        for start, block_id, length in self._block_runs(block_ids, num_tokens):
            self.kv[:, :, :, block_id, :length].copy_(head_major[:, :, :, start : start + length])

    def _block_runs(self, block_ids: list[int], num_tokens: int):
        """``(first token, block id, tokens)`` of each block holding part of ``num_tokens``."""
        block_size = self.layout.block_size
        if num_tokens > len(block_ids) * block_size:
            raise ValueError(f"{num_tokens} tokens do not fit in {len(block_ids)} blocks")
        for index, block_id in enumerate(block_ids):
            start = index * block_size
            if start >= num_tokens:
                return
            yield start, block_id, min(block_size, num_tokens - start)
