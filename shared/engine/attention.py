"""Paged attention plugged into HF models through ``AttentionInterface``.

HF's decoder layers still compute q/k/v and rotary embeddings; this function replaces
only the cache and the attention: it writes each new token's K/V into its pool slot,
gathers each sequence's blocks and runs HF's own SDPA attention per sequence. Several
sequences are packed into one forward pass (batch dimension 1, tokens concatenated).

Outside an engine forward (no plan active) it behaves exactly like HF's ``sdpa``, so the
same model object can still run ``model.generate`` as a reference.
"""

from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from shared.engine.kv_pool import KvPool

ATTENTION_NAME = "pdd_paged"


@dataclass(frozen=True)
class SequencePlan:
    """Where one sequence's new tokens sit in the packed batch and in the pool.

    Attributes:
        query_start: First packed position of this sequence's new tokens.
        query_end: One past its last packed position.
        block_ids: The sequence's block table (as a long tensor).
        context_len: Tokens of KV the sequence has once this forward has written.
    """

    query_start: int
    query_end: int
    block_ids: torch.Tensor
    context_len: int

    @property
    def num_new_tokens(self) -> int:
        """New tokens this sequence contributes to the forward."""
        return self.query_end - self.query_start


@dataclass(frozen=True)
class ForwardPlan:
    """Everything the attention function needs for one packed forward pass.

    Attributes:
        pool: The KV pool written and read.
        slots: Flat pool slot of every packed token, in packed order.
        sequences: Per-sequence plans, in packed order.
    """

    pool: KvPool
    slots: torch.Tensor
    sequences: list[SequencePlan]


_active_plan: ContextVar[ForwardPlan | None] = ContextVar("pdd_forward_plan", default=None)


@contextmanager
def forward_plan(plan: ForwardPlan):
    """Make ``plan`` the one the attention function uses during the enclosed forward."""
    token = _active_plan.set(plan)
    try:
        yield
    finally:
        _active_plan.reset(token)


def paged_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Attention over pool-resident KV; HF's attention-interface signature."""
    plan = _active_plan.get()
    if plan is None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs
        )
    layer = module.layer_idx
    # [1, heads, tokens, dim] -> [tokens, heads, dim] for slot writes.
    plan.pool.write(layer, plan.slots, key[0].transpose(0, 1), value[0].transpose(0, 1))
    outputs = []
    for seq in plan.sequences:
        q = query[:, :, seq.query_start : seq.query_end]
        if seq.num_new_tokens == seq.context_len:
            # Nothing cached before: the new K/V are the whole context, no gather needed.
            k = key[:, :, seq.query_start : seq.query_end]
            v = value[:, :, seq.query_start : seq.query_end]
        else:
            k, v = plan.pool.gather(layer, seq.block_ids, seq.context_len)
            k, v = k.unsqueeze(0), v.unsqueeze(0)
        out, _ = sdpa_attention_forward(module, q, k, v, _extend_mask(seq, q.device), scaling=scaling, dropout=0.0)
        outputs.append(out)
    return torch.cat(outputs, dim=1) if len(outputs) > 1 else outputs[0], None


def _extend_mask(seq: SequencePlan, device) -> torch.Tensor | None:
    """Bottom-right aligned causal mask for new tokens over cached context.

    SDPA's ``is_causal`` aligns top-left, which is right only when there is no cached
    context; a single new token sees everything, so it needs no mask either.
    """
    new, total = seq.num_new_tokens, seq.context_len
    if new == 1 or new == total:
        return None
    q_pos = torch.arange(total - new, total, device=device).unsqueeze(1)
    k_pos = torch.arange(total, device=device).unsqueeze(0)
    return (k_pos <= q_pos)[None, None]


def _paged_mask(*args, **kwargs):
    # Engine forwards build their masks per sequence; anything else gets HF's sdpa mask.
    if _active_plan.get() is not None:
        return None
    return sdpa_mask(*args, **kwargs)


def install(model: torch.nn.Module):
    """Register the paged attention and switch ``model`` to it."""
    AttentionInterface.register(ATTENTION_NAME, paged_attention_forward)
    AttentionMaskInterface.register(ATTENTION_NAME, _paged_mask)
    model.set_attn_implementation(ATTENTION_NAME)
