"""The preallocated KV pool: one tensor holding every block of every layer.

Layout ``[layers, 2 (K/V), num_blocks, block_size, kv_heads, head_dim]``. Allocating it
once avoids the per-step re-concatenation of HF's DynamicCache, and block-major storage
makes export and import a single gather/scatter over block ids.
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
            num_blocks,
            layout.block_size,
            layout.num_kv_heads,
            layout.head_dim,
            dtype=layout.dtype,
            device=device,
        )
        # Flat views [num_blocks * block_size, kv_heads, head_dim] per layer for slot writes.
        self._flat = self.kv.view(layout.num_layers, 2, -1, layout.num_kv_heads, layout.head_dim)

    @property
    def kv_bytes(self) -> int:
        """Total bytes the pool occupies."""
        return self.kv.numel() * self.kv.element_size()

    def write(self, layer: int, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor):
        """Store new tokens' K and V (``[tokens, kv_heads, head_dim]``) at flat slot indices."""
        self._flat[layer, 0].index_copy_(0, slots, keys)
        self._flat[layer, 1].index_copy_(0, slots, values)

    def gather(self, layer: int, block_ids: torch.Tensor, num_tokens: int):
        """K and V of one sequence's first ``num_tokens`` tokens, ``[kv_heads, tokens, head_dim]``."""
        keys = self.kv[layer, 0].index_select(0, block_ids).flatten(0, 1)[:num_tokens]
        values = self.kv[layer, 1].index_select(0, block_ids).flatten(0, 1)[:num_tokens]
        return keys.transpose(0, 1), values.transpose(0, 1)

    def export_tokens(self, block_ids: list[int], num_tokens: int) -> torch.Tensor:
        """Copy out ``num_tokens`` tokens held in ``block_ids``: ``[layers, 2, tokens, heads, dim]``."""
        index = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        return self.kv.index_select(2, index).flatten(2, 3)[:, :, :num_tokens].contiguous()

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
        self._flat.index_copy_(2, slots, tokens_kv)
