"""The preallocated KV pool: one tensor holding every block of every layer.

Layout ``[layers, 2 (K/V), kv_heads, num_blocks, block_size, head_dim]``. Allocating it
once avoids the per-step re-concatenation of HF's DynamicCache. Heads outermost (within a
layer's K or V) make a block of one head 16 contiguous rows: gathering a batch's block
tables gives every sequence's K and V as contiguous ``[tokens, head_dim]`` rows per head,
the layout SDPA reads fastest (measured against token-major blocks: 1.4x less attention time
at batch 16, docs/engine.md); export and import are still one gather/scatter over block ids.
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
        """Copy out ``num_tokens`` tokens held in ``block_ids``: ``[layers, 2, tokens, heads, dim]``."""
        index = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        tokens = self.kv.index_select(3, index).flatten(3, 4)[:, :, :, :num_tokens]
        return tokens.transpose(2, 3).contiguous()

    def import_tokens(self, block_ids: list[int], tokens_kv: torch.Tensor):
        """Write ``[layers, 2, tokens, heads, dim]`` into ``block_ids`` from their first slot on.

        Converts dtype and device when the sender's differ (heterogeneous instances).
        """
        block_size = self.layout.block_size
        num_tokens = tokens_kv.shape[2]
        slots = torch.cat([torch.arange(b * block_size, (b + 1) * block_size, device=self.device) for b in block_ids])[
            :num_tokens
        ]
        tokens_kv = tokens_kv.to(device=self.device, dtype=self.layout.dtype)
        self._flat.index_copy_(3, slots, tokens_kv.transpose(2, 3))
