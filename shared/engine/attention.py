"""Batched paged attention plugged into HF models through ``AttentionInterface``.

HF's decoder layers (or the lean forward) still compute q/k/v and rotary embeddings; this
function replaces only the cache and the attention. Several sequences are packed into one
forward pass (batch dimension 1, tokens concatenated). In every layer it writes each new
token's K/V into its pool slot, then attends, by one of two paths:

**The in-place kernel** (``paged_kernel``, where it could be built: a C compiler, AVX2/FMA or
AVX-512, a CPU fp32 pool): one call per layer for every sequence of the batch, reading K/V blocks where
they lie in the pool through the block tables, GQA without repetition, causal within each
sequence's new tokens. No K/V is copied. Its sums run in its own order, so results differ
from SDPA's in the last bits; the exactness tests (greedy tokens identical to ``generate``,
which runs SDPA) are the judge, as for the lean forward.

**Gather + SDPA** otherwise:

- one SDPA call for all sequences that have cached context (decodes, extends, prompt chunks
  over a cached prefix), or one per run of them whose gathered K/V fit
  ``GATHER_BUDGET_BYTES`` (8 MiB: five sequences at 1K context): their block tables, padded
  to the longest, gather the run's K/V in one copy per tensor (``KvPool.gather_blocks``);
  queries are padded to the most new tokens of a sequence, and a float mask built once per
  forward (bottom-right causal within each sequence, nothing past its length) hides
  padding. GQA reads each K/V head once (``enable_gqa``), never repeated;
- one causal SDPA call per prompt with nothing cached, on its own new K/V (no gather, and
  the causal kernel skips the masked half, which a mask would not).

Decodes and extends are separate groups, so a batch of decodes is never padded to an
extend's length. The kernel is SDPA's CPU flash kernel in every case of this path, as in
``model.generate``; padding only appends masked (zero-weight) keys, so each row's result is
the one a single-sequence call gives (the exactness tests compare against ``generate``).

Outside an engine forward (no plan active) it behaves exactly like HF's ``sdpa``, so the
same model object can still run ``model.generate`` as a reference.
"""

from collections.abc import Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from shared.engine.kv_pool import KvPool
from shared.engine.paged_kernel import PagedKernel, check_batch, chunk_tokens

ATTENTION_NAME = "pdd_paged"
# Most bytes of one layer's gathered K and V per SDPA call. Batch 16 at 1K context on the
# 2-core Zen 3 machine: 271-289 ms of CPU per decode step in runs of at most 8 MiB, 667-871 ms
# in one call over the whole batch (its 25 MB gather leaves the cache before SDPA reads it back).
GATHER_BUDGET_BYTES = 8 << 20


@dataclass(frozen=True)
class SequencePlan:
    """Where one sequence's new tokens sit in the packed batch and in the pool.

    Attributes:
        query_start: First packed position of this sequence's new tokens.
        query_end: One past its last packed position.
        block_ids: The sequence's block table, enough blocks for ``context_len`` tokens.
        context_len: Tokens of KV the sequence has once this forward has written.
    """

    query_start: int
    query_end: int
    block_ids: Sequence[int]
    context_len: int

    @property
    def num_new_tokens(self) -> int:
        """New tokens this sequence contributes to the forward."""
        return self.query_end - self.query_start


@dataclass(frozen=True)
class PagedGroup:
    """Sequences attended in one SDPA call over their gathered blocks.

    Attributes:
        query_rows: ``[sequences * queries]`` packed positions feeding each padded query row.
        block_tables: ``[sequences, blocks]``; short tables padded with block 0 (masked).
        mask: ``[sequences, 1, queries, blocks * block_size]`` additive float mask.
        out_rows: Packed positions of the valid padded rows, in ``valid`` order.
        valid: Indices of the valid rows among ``sequences * queries``; None when all are.
    """

    query_rows: torch.Tensor
    block_tables: torch.Tensor
    mask: torch.Tensor
    out_rows: torch.Tensor
    valid: torch.Tensor | None

    @property
    def num_queries(self) -> int:
        """Query rows per sequence after padding."""
        return self.mask.shape[2]


@dataclass(frozen=True)
class KernelBatch:
    """A forward's sequences for the in-place kernel, all in one call per layer (``paged_kernel``).

    Attributes:
        kernel: The loaded kernel.
        tables: ``[sequences, blocks]`` int64 block tables, short ones padded (never read).
        meta: ``[sequences, 3]`` int64: first packed position, new tokens, context length.
        num_tokens: Packed tokens of the forward.
        chunk: New tokens per work unit of the kernel (``paged_kernel.chunk_tokens``).
    """

    kernel: PagedKernel
    tables: torch.Tensor
    meta: torch.Tensor
    num_tokens: int
    chunk: int

    def attend(self, pool: KvPool, layer: int, query: torch.Tensor, scaling: float | None) -> torch.Tensor:
        """``[tokens, heads, dim]`` from HF's ``[1, heads, tokens, dim]`` query."""
        head_dim = query.shape[3]
        if query.shape[2] != self.num_tokens:
            raise ValueError(f"{query.shape[2]} packed tokens, the plan has {self.num_tokens}")
        q = query[0].transpose(0, 1).contiguous()
        scale = head_dim**-0.5 if scaling is None else scaling
        return self.kernel.attend(q, pool.kv[layer, 0], pool.kv[layer, 1], self.tables, self.meta, scale, self.chunk)


@dataclass(frozen=True)
class ForwardPlan:
    """Everything the attention function needs for one packed forward pass.

    Attributes:
        pool: The KV pool written and read.
        slots: Flat pool slot of every packed token, in packed order.
        groups: Batched calls over cached context (decodes, then multi-token sequences).
        fresh: ``(start, end)`` packed ranges of prompts with nothing cached.
        num_tokens: Packed tokens in the forward.
        in_place: Every sequence, for the in-place kernel (then ``groups`` and ``fresh`` are
            empty); None without the kernel.
    """

    pool: KvPool
    slots: torch.Tensor
    groups: list[PagedGroup]
    fresh: list[tuple[int, int]]
    num_tokens: int
    in_place: KernelBatch | None = None


def build_plan(
    pool: KvPool, slots: torch.Tensor, sequences: list[SequencePlan], kernel: PagedKernel | None = None
) -> ForwardPlan:
    """Group ``sequences`` into batched calls; the tables and masks serve every layer.

    With ``kernel``, every sequence goes to it instead: one call per layer for the whole batch,
    K/V read where they lie in the pool.
    """
    device = pool.device
    num_tokens = max((s.query_end for s in sequences), default=0)
    if kernel is not None and sequences:
        return ForwardPlan(pool, slots, [], [], num_tokens, _kernel_batch(pool, kernel, sequences))
    cached = [s for s in sequences if s.num_new_tokens < s.context_len]
    fresh = [(s.query_start, s.query_end) for s in sequences if s.num_new_tokens == s.context_len]
    groups = [
        _paged_group(pool, members, device)
        for kind in ([s for s in cached if s.num_new_tokens == 1], [s for s in cached if s.num_new_tokens > 1])
        for members in _within_gather_budget(pool, kind)
    ]
    return ForwardPlan(pool, slots, groups, fresh, num_tokens)


def _block_tables(members: list[SequencePlan], block_size: int) -> torch.Tensor:
    """``[sequences, blocks]`` block tables, each cut to its context, short ones padded with
    block 0 (never read: masked, or past the context the kernel is given)."""
    width = max(-(-s.context_len // block_size) for s in members)
    tables = torch.zeros(len(members), width, dtype=torch.long)
    for i, s in enumerate(members):
        used = -(-s.context_len // block_size)
        tables[i, :used] = torch.tensor(list(s.block_ids[:used]), dtype=torch.long)
    return tables


def _kernel_batch(pool: KvPool, kernel: PagedKernel, members: list[SequencePlan]) -> KernelBatch:
    block_size = pool.layout.block_size
    tables = _block_tables(members, block_size)
    meta = torch.tensor([(s.query_start, s.num_new_tokens, s.context_len) for s in members], dtype=torch.long)
    num_tokens = max(s.query_end for s in members)
    check_batch(tables, meta, num_tokens, pool.num_blocks, block_size)
    kv_heads = pool.layout.num_kv_heads
    chunk = chunk_tokens([s.num_new_tokens for s in members], kv_heads, torch.get_num_threads())
    return KernelBatch(kernel, tables, meta, num_tokens, chunk)


def _within_gather_budget(pool: KvPool, members: list[SequencePlan]) -> list[list[SequencePlan]]:
    """``members`` in runs whose gathered K and V of one layer fit ``GATHER_BUDGET_BYTES``
    (at least one sequence each): a gather that stays in the CPU's cache is read back from
    there by the attention call that follows."""
    layout = pool.layout
    row_bytes = 2 * layout.num_kv_heads * layout.head_dim * layout.dtype.itemsize * layout.block_size
    runs, run, run_bytes = [], [], 0
    for s in members:
        seq_bytes = -(-s.context_len // layout.block_size) * row_bytes
        if run and run_bytes + seq_bytes > GATHER_BUDGET_BYTES:
            runs.append(run)
            run, run_bytes = [], 0
        run.append(s)
        run_bytes += seq_bytes
    return [*runs, run] if run else runs


def _paged_group(pool: KvPool, members: list[SequencePlan], device) -> PagedGroup:
    block_size = pool.layout.block_size
    num_queries = max(s.num_new_tokens for s in members)
    tables = _block_tables(members, block_size)
    num_blocks = tables.shape[1]
    rows = torch.empty(len(members), num_queries, dtype=torch.long)
    # Query i of a sequence sits at context position first + i; it sees keys up to there.
    last_key = torch.empty(len(members), num_queries, dtype=torch.long)
    for i, s in enumerate(members):
        steps = torch.arange(num_queries).clamp(max=s.num_new_tokens - 1)  # padded rows repeat the last
        rows[i] = s.query_start + steps
        last_key[i] = s.context_len - s.num_new_tokens + steps
    visible = torch.arange(num_blocks * block_size)[None, None, :] <= last_key[:, :, None]
    mask = torch.zeros(visible.shape, dtype=pool.layout.dtype).masked_fill_(~visible, float("-inf"))
    valid_flags = (
        torch.arange(num_queries)[None, :] < torch.tensor([s.num_new_tokens for s in members])[:, None]
    ).flatten()
    all_valid = bool(valid_flags.all())
    valid = None if all_valid else valid_flags.nonzero().squeeze(1)
    out_rows = rows.flatten() if all_valid else rows.flatten()[valid]
    return PagedGroup(
        rows.flatten().to(device),
        tables.to(device),
        mask.unsqueeze(1).to(device),
        out_rows.to(device),
        None if valid is None else valid.to(device),
    )


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
    """Attention over pool-resident KV; HF's attention-interface signature.

    ``query`` is ``[1, heads, tokens, dim]``, ``key``/``value`` ``[1, kv_heads, tokens, dim]``;
    returns ``([1, tokens, heads, dim], None)``.
    """
    plan = _active_plan.get()
    if plan is None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs
        )
    return paged_attention(plan, module.layer_idx, query, key, value, scaling), None


def paged_attention(plan: ForwardPlan, layer: int, query, key, value, scaling: float | None) -> torch.Tensor:
    """Write the new tokens' K/V of ``layer`` into the pool, then attend every sequence of ``plan``.

    ``query`` is ``[1, heads, tokens, dim]``, ``key``/``value`` ``[1, kv_heads, tokens, dim]``;
    returns ``[1, tokens, heads, dim]``.
    """
    plan.pool.write(layer, plan.slots, key[0], value[0])
    num_heads, head_dim = query.shape[1], query.shape[3]
    if plan.in_place is not None:
        return plan.in_place.attend(plan.pool, layer, query, scaling).unsqueeze(0)
    if len(plan.groups) == 1 and not plan.fresh and plan.groups[0].valid is None:
        group = plan.groups[0]  # the common step: one batch of decodes, or one chunk
        if group.query_rows.shape[0] == plan.num_tokens:
            return _group_attention(plan.pool, layer, group, query, scaling).view(1, -1, num_heads, head_dim)
    out = query.new_empty(plan.num_tokens, num_heads, head_dim)
    for group in plan.groups:
        out.index_copy_(0, group.out_rows, _group_attention(plan.pool, layer, group, query, scaling))
    for start, end in plan.fresh:
        attended = F.scaled_dot_product_attention(
            query[:, :, start:end],
            key[:, :, start:end],
            value[:, :, start:end],
            is_causal=end - start > 1,
            scale=scaling,
            enable_gqa=True,
        )
        out[start:end] = attended[0].transpose(0, 1)
    return out.unsqueeze(0)


def _group_attention(pool: KvPool, layer: int, group: PagedGroup, query, scaling) -> torch.Tensor:
    """The group's valid rows, ``[rows, heads, dim]``, in ``out_rows`` order."""
    keys, values = pool.gather_blocks(layer, group.block_tables)
    num_seqs, num_queries = group.block_tables.shape[0], group.num_queries
    num_heads, num_kv_heads = query.shape[1], keys.shape[1]
    if num_queries == 1 and num_heads > num_kv_heads:
        # One query per sequence: the query heads sharing a K/V head are that head's query
        # rows, so the kernel reads each K/V row once for all of them.
        q = query[0].index_select(1, group.query_rows).transpose(0, 1)  # [sequences, heads, dim]
        q = q.reshape(num_seqs, num_kv_heads, num_heads // num_kv_heads, -1)
        attended = F.scaled_dot_product_attention(q, keys, values, attn_mask=group.mask, scale=scaling)
        return attended.reshape(num_seqs, num_heads, -1)
    # [heads, rows, dim] -> [sequences, heads, queries, dim]
    q = query[0].index_select(1, group.query_rows).view(query.shape[1], num_seqs, num_queries, -1).transpose(0, 1)
    attended = F.scaled_dot_product_attention(q, keys, values, attn_mask=group.mask, scale=scaling, enable_gqa=True)
    rows = attended.transpose(1, 2).reshape(num_seqs * num_queries, query.shape[1], -1)
    return rows if group.valid is None else rows.index_select(0, group.valid)


def _paged_mask(*args, **kwargs):
    # Engine forwards build their masks in the plan; anything else gets HF's sdpa mask.
    if _active_plan.get() is not None:
        return None
    return sdpa_mask(*args, **kwargs)


def install(model: torch.nn.Module):
    """Register the paged attention and switch ``model`` to it."""
    AttentionInterface.register(ATTENTION_NAME, paged_attention_forward)
    AttentionMaskInterface.register(ATTENTION_NAME, _paged_mask)
    model.set_attn_implementation(ATTENTION_NAME)
