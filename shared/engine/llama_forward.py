"""A lean forward pass for the Llama family, over the model's own weights.

HF's ``LlamaForCausalLM`` goes through a module call, a kwargs dict and a mask/cache check per
layer and per projection; this runs the same operations directly: the embedding, RMSNorm as
HF writes it, the model's own rotary module for cos/sin, SiLU-gated MLP, residual adds, and
the engine's paged attention (``attention.paged_attention``). Two things differ:

- q/k/v and gate/up are one matrix product each (their weights concatenated once at load);
- on CPU in fp32 every product of several rows uses a oneDNN weight prepacked once at load
  instead of the strided weight (``PackedLinear``): 1.7-2.2x less CPU than ``F.linear`` for the
  4-16 rows of a batched decode step, on SmolLM2's shapes, one thread (docs/engine.md); a
  product of one row uses it too, or ``F.linear`` over the model's own weights where that
  timed faster at load (``choose_one_row_path``).

Each output element is still one fp32 dot product over the same inputs, summed in the
kernel's own order, so results differ from HF's at the last bits; the engine's exactness
tests (greedy tokens identical to ``generate``) are the judge. Models outside what this
covers (biases, other activations, other architectures, a GPU) keep HF's forward
(``LeanLlama.supports``).
"""

import time
from dataclasses import dataclass

import structlog
import torch
import torch.nn.functional as F

from shared.engine.attention import ForwardPlan, paged_attention

log = structlog.get_logger(__name__)

PACK_ROWS_HINT = 16
"""Rows oneDNN lays a packed weight out for; with hint 1, products of 4-16 rows ran 1.5x slower."""

ONE_ROW_TRIALS = 3
"""Passes each way when ``choose_one_row_path`` times one-row products at load."""


def _can_pack(weight: torch.Tensor) -> bool:
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.float32
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


class PackedLinear:
    """``x @ weight.T`` for one fixed weight: the concatenation (along the output features) of
    ``parts``, each ``[out_features_i, in_features]``, no bias.

    On CPU in fp32 a product of several rows uses a oneDNN-packed copy of the concatenation. A
    product of one row (a batch-1 decode step) uses it too, or, with ``one_row_over_parts``,
    ``F.linear`` over each part, the model's own weights, as HF's modules compute it: which is
    faster depends on the CPU and the thread count, so ``LeanLlama`` times both at load.
    Elsewhere every product uses the concatenation as given.
    """

    def __init__(self, parts: list[torch.Tensor]):
        self._parts = [part.detach() for part in parts]
        weight = self._parts[0] if len(self._parts) == 1 else torch.cat(self._parts)
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.one_row_over_parts = False
        if _can_pack(weight):
            self._packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), PACK_ROWS_HINT)
            self._weight = None
        else:
            self._packed = None
            self._weight = weight

    @property
    def packs(self) -> bool:
        """Whether products go through a oneDNN-packed copy (CPU, fp32)."""
        return self._packed is not None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``[rows, in_features]`` -> ``[rows, out_features]``."""
        if self._packed is None:
            return F.linear(x, self._weight)
        if self.one_row_over_parts and x.shape[0] == 1:
            if len(self._parts) == 1:
                return F.linear(x, self._parts[0])
            return torch.cat([F.linear(x, part) for part in self._parts], dim=-1)
        return torch.ops.mkldnn._linear_pointwise(x, self._packed, None, "none", [], "")


def choose_one_row_path(products: list[PackedLinear], trials: int = ONE_ROW_TRIALS) -> dict:
    """Time one row through every packing product both ways (``trials`` alternating passes over
    all of them, the weights streamed from memory as in a decode step), keep the faster for
    all, and return what was measured: ``over_parts`` and the best pass of each, ms."""
    packing = [product for product in products if product.packs]
    if not packing:
        return {"over_parts": False}
    rows = [torch.zeros(1, product.in_features) for product in packing]
    best_s = {True: float("inf"), False: float("inf")}
    with torch.inference_mode():
        for _ in range(trials):
            for over_parts in (True, False):
                for product in packing:
                    product.one_row_over_parts = over_parts
                start = time.perf_counter()
                for product, row in zip(packing, rows, strict=True):
                    product(row)
                best_s[over_parts] = min(best_s[over_parts], time.perf_counter() - start)
    over_parts = best_s[True] < best_s[False]
    for product in packing:
        product.one_row_over_parts = over_parts
    return {"over_parts": over_parts, "parts_ms": best_s[True] * 1000, "packed_ms": best_s[False] * 1000}


@dataclass(frozen=True)
class _Layer:
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    qkv: PackedLinear
    o: PackedLinear
    gate_up: PackedLinear
    down: PackedLinear


class LeanLlama:
    """The forward pass of a ``LlamaForCausalLM`` over the paged KV pool, without HF's modules."""

    def __init__(self, model: torch.nn.Module):
        config = model.config
        self._num_heads = config.num_attention_heads
        self._num_kv_heads = config.num_key_value_heads
        self._head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self._intermediate = config.intermediate_size
        self._eps = config.rms_norm_eps
        self._scaling = self._head_dim**-0.5
        inner = model.model
        self._embed = inner.embed_tokens.weight
        self._rotary = inner.rotary_emb
        self._final_norm = inner.norm.weight
        self._lm_head = PackedLinear([model.lm_head.weight])
        self._layers = [_pack_layer(layer) for layer in inner.layers]
        self.one_row_path = choose_one_row_path(self.products)
        log.info("one_row_products_chosen", **self.one_row_path)

    @property
    def products(self) -> list[PackedLinear]:
        """Every matrix product of the forward, lm_head last."""
        return [p for layer in self._layers for p in (layer.qkv, layer.o, layer.gate_up, layer.down)] + [self._lm_head]

    @staticmethod
    def supports(model: torch.nn.Module) -> bool:
        """Whether ``model`` is a Llama this forward computes as HF does (no biases, SiLU, one
        tensor-parallel slice), on the CPU (the lean forward has not been run on a GPU)."""
        config = getattr(model, "config", None)
        return (
            type(model).__name__ == "LlamaForCausalLM"
            and model.device.type == "cpu"
            and not getattr(config, "attention_bias", True)
            and not getattr(config, "mlp_bias", True)
            and getattr(config, "hidden_act", None) == "silu"
            and getattr(config, "pretraining_tp", 1) == 1
        )

    def forward(
        self, plan: ForwardPlan, input_ids: torch.Tensor, position_ids: torch.Tensor, keep_rows: torch.Tensor
    ) -> torch.Tensor:
        """Logits ``[len(keep_rows), vocab]`` of the packed rows ``keep_rows``.

        ``input_ids`` and ``position_ids`` are ``[tokens]``; the pass writes every token's K/V
        into the pool through ``plan``. Call under ``torch.inference_mode()``.
        """
        hidden = F.embedding(input_ids, self._embed)
        cos, sin = self._rotary(hidden, position_ids[None])
        cos, sin = cos[0, :, None, :], sin[0, :, None, :]  # [tokens, 1, head_dim]
        for index, layer in enumerate(self._layers):
            hidden = hidden + self._attention(
                plan, index, layer, _rms_norm(hidden, layer.input_norm, self._eps), cos, sin
            )
            hidden = hidden + self._mlp(layer, _rms_norm(hidden, layer.post_norm, self._eps))
        last = _rms_norm(hidden.index_select(0, keep_rows), self._final_norm, self._eps)
        return self._lm_head(last)

    def _attention(self, plan: ForwardPlan, index: int, layer: _Layer, x, cos, sin) -> torch.Tensor:
        tokens, dim, heads = x.shape[0], self._head_dim, self._num_heads
        qkv = layer.qkv(x).view(tokens, heads + 2 * self._num_kv_heads, dim)
        # q's and k's heads are adjacent in each row: one rotation for both.
        qk = _rotate(qkv[:, : heads + self._num_kv_heads], cos, sin)
        q, k, v = qk[:, :heads], qk[:, heads:], qkv[:, heads + self._num_kv_heads :]
        # paged_attention takes HF's [1, heads, tokens, dim] views.
        out = paged_attention(
            plan, index, q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], self._scaling
        )
        return layer.o(out.reshape(tokens, self._num_heads * dim))

    def _mlp(self, layer: _Layer, x) -> torch.Tensor:
        gate, up = layer.gate_up(x).split([self._intermediate, self._intermediate], dim=-1)
        return layer.down(F.silu(gate) * up)


def _pack_layer(layer: torch.nn.Module) -> _Layer:
    attn, mlp = layer.self_attn, layer.mlp
    return _Layer(
        input_norm=layer.input_layernorm.weight,
        post_norm=layer.post_attention_layernorm.weight,
        qkv=PackedLinear([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]),
        o=PackedLinear([attn.o_proj.weight]),
        gate_up=PackedLinear([mlp.gate_proj.weight, mlp.up_proj.weight]),
        down=PackedLinear([mlp.down_proj.weight]),
    )


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # LlamaRMSNorm: fp32 statistics, weight applied last. In fp32 torch's fused rms_norm gives
    # the same bits as HF's pow/mean/rsqrt sequence (tests/test_model_runner.py) in fewer passes.
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)
    dtype = x.dtype
    x32 = x.to(torch.float32)
    variance = x32.pow(2).mean(-1, keepdim=True)
    return weight * (x32 * torch.rsqrt(variance + eps)).to(dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # HF's apply_rotary_pos_emb on one tensor: x * cos + rotate_half(x) * sin.
    half = x.shape[-1] // 2
    return (x * cos) + (torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin)
