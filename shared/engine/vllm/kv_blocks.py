"""Whole tokens' K and V in and out of vLLM's CPU KV cache.

vLLM's CPU attention keeps one tensor per layer, ``[blocks, kv_heads, block_size, 2 * head_dim]``,
whose bytes per (block, head) are the block's keys transposed (``[head_dim, block_size]``, as
its "vec" kernels read them) followed by its values (``[block_size, head_dim]``). Writes go
through vLLM's own ``cpu_attn_reshape_and_cache``, so they match whatever the kernel expects;
reads undo the layout above, which :func:`check_layout` verifies against that same op at
start-up (another instruction set, another layout: refused, not misread).
"""

import torch

from shared.errors import ConfigError


class VllmKvBlocks:
    """Reads and writes tokens' KV in the per-layer cache tensors of one vLLM worker.

    Args:
        caches: The layers' cache tensors, in layer order.
        block_size: Tokens per block.
        isa: The instruction set vLLM's CPU attention runs with (``vec``, ``vec16``, ...).
    """

    def __init__(self, caches: list[torch.Tensor], block_size: int, isa: str):
        self.caches, self.block_size, self.isa = caches, block_size, isa
        _, self.num_kv_heads, _, two_head_dim = caches[0].shape
        self.head_dim = two_head_dim // 2

    def write(self, block_ids: list[int], first_token: int, kv: torch.Tensor):
        """Write ``kv`` (``[layers, 2, tokens, kv_heads, head_dim]``) as the request's tokens
        from ``first_token`` on; ``block_ids`` are the request's blocks from its first."""
        slots = self._slots(block_ids, first_token, kv.shape[2])
        for layer, cache in enumerate(self.caches):
            write_tokens(cache, kv[layer, 0], kv[layer, 1], slots, self.isa)

    def read(self, block_ids: list[int], first_token: int, end_token: int) -> torch.Tensor:
        """Tokens ``[first, end)`` as ``[layers, 2, tokens, kv_heads, head_dim]``."""
        first_block, last_block = first_token // self.block_size, (end_token - 1) // self.block_size
        index = torch.tensor(block_ids[first_block : last_block + 1], dtype=torch.long)
        offset = first_token - first_block * self.block_size
        out = []
        for cache in self.caches:
            keys, values = read_blocks(cache, index)  # [blocks, heads, block_size, dim] each
            both = torch.stack((keys, values))  # [2, blocks, heads, block_size, dim]
            tokens = both.permute(0, 1, 3, 2, 4).reshape(2, -1, self.num_kv_heads, self.head_dim)
            out.append(tokens[:, offset : offset + end_token - first_token])
        return torch.stack(out).contiguous()

    def _slots(self, block_ids: list[int], first_token: int, num_tokens: int) -> torch.Tensor:
        positions = torch.arange(first_token, first_token + num_tokens)
        blocks = torch.tensor(block_ids, dtype=torch.long)[positions // self.block_size]
        return blocks * self.block_size + positions % self.block_size


def write_tokens(cache: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor, isa: str):
    """Write ``[tokens, kv_heads, head_dim]`` keys and values into ``slots`` with vLLM's op."""
    from vllm import _custom_ops as ops

    num_blocks, heads, block_size, _ = cache.shape
    key_cache, value_cache = cache.view(num_blocks, heads, 2 * block_size, -1).chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(
        keys.contiguous(), values.contiguous(), key_cache, value_cache, slots.to(torch.long), isa
    )


def read_blocks(cache: torch.Tensor, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocks ``index`` of one layer as keys and values, ``[blocks, heads, block_size, dim]``."""
    num_blocks, heads, block_size, two_dim = cache.shape
    dim = two_dim // 2
    halves = cache.view(num_blocks, heads, 2, block_size * dim)[index]
    keys = halves[:, :, 0].view(-1, heads, dim, block_size).transpose(2, 3)
    values = halves[:, :, 1].view(-1, heads, block_size, dim)
    return keys, values


def check_layout(like: torch.Tensor, isa: str, seed: int = 0):
    """Write random tokens with vLLM's op into a scratch cache shaped like ``like`` and read them
    back; raise ConfigError when the layout is not the one :func:`read_blocks` reads."""
    _, heads, block_size, two_dim = like.shape
    scratch = torch.zeros((2, heads, block_size, two_dim), dtype=like.dtype)
    generator = torch.Generator().manual_seed(seed)
    shape = (2 * block_size, heads, two_dim // 2)
    keys = torch.randn(shape, generator=generator).to(like.dtype)
    values = torch.randn(shape, generator=generator).to(like.dtype)
    write_tokens(scratch, keys, values, torch.arange(2 * block_size), isa)
    read_keys, read_values = read_blocks(scratch, torch.arange(2))
    as_tokens = lambda t: t.permute(0, 2, 1, 3).reshape(shape)
    if not (torch.equal(as_tokens(read_keys), keys) and torch.equal(as_tokens(read_values), values)):
        raise ConfigError(
            f"--engine vllm: vLLM's CPU KV cache layout for instruction set {isa!r} is not "
            "one PDD can read (known: head-major keys transposed per block, then values)"
        )
