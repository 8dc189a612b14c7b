"""The shape of one instance's KV cache: what two instances must agree on to share blocks."""

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the layout is read from a model's config; checking frames against it needs no torch
    import torch

DEFAULT_BLOCK_SIZE = 16


@dataclass(frozen=True)
class KvLayout:
    """Geometry of the KV cache of one model.

    Attributes:
        num_layers: Decoder layers, each with its own K and V.
        num_kv_heads: Key/value heads per layer (GQA: fewer than query heads).
        head_dim: Channels per head.
        block_size: Tokens per KV block.
        dtype: Element type of the pool.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: "torch.dtype"

    @classmethod
    def from_model(cls, model: "torch.nn.Module", block_size: int = DEFAULT_BLOCK_SIZE) -> "KvLayout":
        """Read the layout from an HF decoder config."""
        config = model.config
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return cls(
            num_layers=config.num_hidden_layers,
            num_kv_heads=config.num_key_value_heads,
            head_dim=head_dim,
            block_size=block_size,
            dtype=model.dtype,
        )

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K plus V for one token across all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype.itemsize

    @property
    def kv_bytes_per_block(self) -> int:
        """Bytes of one full block across all layers."""
        return self.kv_bytes_per_token * self.block_size
