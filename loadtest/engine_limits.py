"""What this machine could do at best for each engine figure: the floors ``pdd bench engine``
prints each figure's fraction of.

- Decode and extend read every weight once per step plus the batch's KV: their floor is
  those bytes at the machine's read bandwidth (``read_gb_s``).
- Prefill (and an extend's matrix products) multiply every non-embedding weight with every
  token, plus causal attention: their floor is those FLOPs at the machine's peak fp32 rate.
  Logits are computed for one row per sequence only, so the LM head is left out.

``MachineLimits.measure`` takes both on the machine at hand, with torch's threads: the best of a
few large fp32 matrix products (through oneDNN where torch has it, as the engine's own) and of a
few sums over 512 MiB. ``pdd bench engine`` measures them unless ``--peak-gflop-s`` and
``--read-gb-s`` are given. The constants below are the Zen 3 development machine's (2 cores,
AVX2/FMA: ~157 GFLOP/s fp32, ~12 GB/s read by one core).
"""

import time
from dataclasses import dataclass

import torch

PEAK_GFLOP_S = 157.0
READ_GB_S = 12.0


@dataclass(frozen=True)
class ModelCosts:
    """The model's bytes and FLOPs that the floors count.

    Attributes:
        weight_bytes: Every parameter once (tied embeddings once).
        matmul_params: Parameters multiplied with every computed token (no embedding, no LM head).
        attention_flops_per_pair: FLOPs of one query-key pair across all layers and heads
            (QK^T and PV: 4 x heads x head_dim x layers).
        kv_bytes_per_token: K and V of one token across all layers.
    """

    weight_bytes: int
    matmul_params: int
    attention_flops_per_pair: int
    kv_bytes_per_token: int

    @classmethod
    def of(cls, model: torch.nn.Module) -> "ModelCosts":
        """Read the costs from an HF decoder (Llama family: ``model.model.embed_tokens``, ``lm_head``)."""
        config = model.config
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        params = {id(p): p for p in model.parameters()}
        excluded = {id(model.get_input_embeddings().weight), id(model.get_output_embeddings().weight)}
        itemsize = next(iter(params.values())).element_size()
        return cls(
            weight_bytes=sum(p.numel() * p.element_size() for p in params.values()),
            matmul_params=sum(p.numel() for key, p in params.items() if key not in excluded),
            attention_flops_per_pair=4 * config.num_attention_heads * head_dim * config.num_hidden_layers,
            kv_bytes_per_token=2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * itemsize,
        )


@dataclass(frozen=True)
class MachineLimits:
    """Peak fp32 compute and read bandwidth of the machine the figures were taken on."""

    peak_gflop_s: float = PEAK_GFLOP_S
    read_gb_s: float = READ_GB_S

    @classmethod
    def measure(cls, repeats: int = 5) -> "MachineLimits":
        """This machine's limits, measured now with ``torch.get_num_threads()`` threads."""
        return cls(peak_gflop_s=_matmul_gflop_s(repeats), read_gb_s=_read_gb_s(repeats))

    def decode_floor_ms(self, costs: ModelCosts, batch: int, context: int) -> float:
        """Least time for one decode step of ``batch`` sequences at ``context`` tokens."""
        return (costs.weight_bytes + batch * context * costs.kv_bytes_per_token) / self.read_gb_s / 1e6

    def chunk_floor_ms(self, costs: ModelCosts, new_tokens: int, cached: int) -> float:
        """Least time for a forward of ``new_tokens`` over ``cached`` tokens of context: the
        larger of reading weights and KV, and computing the products and causal attention."""
        pairs = new_tokens * cached + new_tokens * (new_tokens + 1) // 2
        flops = 2 * costs.matmul_params * new_tokens + costs.attention_flops_per_pair * pairs
        read_bytes = costs.weight_bytes + (cached + new_tokens) * costs.kv_bytes_per_token
        return max(flops / self.peak_gflop_s / 1e6, read_bytes / self.read_gb_s / 1e6)

    def prefill_ceiling_tok_s(self, costs: ModelCosts, prompt_tokens: int) -> float:
        """Most prompt tokens per second a cold prefill of ``prompt_tokens`` could reach."""
        return prompt_tokens / self.chunk_floor_ms(costs, prompt_tokens, 0) * 1000


def _best_s(run, repeats: int) -> float:
    run()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best


def _matmul_gflop_s(repeats: int, rows: int = 1024, size: int = 2048) -> float:
    """fp32 ``[rows, size] @ [size, size]``: through a oneDNN-packed weight where torch has one
    (the engine's own path), else ``torch.mm``."""
    x, weight = torch.randn(rows, size), torch.randn(size, size)
    if torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, rows)
        seconds = _best_s(lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""), repeats)
    else:
        seconds = _best_s(lambda: torch.mm(x, weight.T), repeats)
    return 2 * rows * size * size / seconds / 1e9


def _read_gb_s(repeats: int, num_bytes: int = 512 << 20) -> float:
    """A sum over ``num_bytes`` of fp32, far larger than any cache."""
    data = torch.ones(num_bytes // 4)
    return num_bytes / _best_s(data.sum, repeats) / 1e9
