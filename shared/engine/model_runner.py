"""The model runner: one packed forward pass of an HF model over the paged KV pool.

A batch is a list of ``(sequence, tokens to compute, samples)``. Their tokens are packed
into one row; paged attention (``attention``) reads and writes the batch's KV through their
block tables, one batched call per layer. Only the rows that sample keep logits. Llama-family
models run the lean forward (``llama_forward``) over the model's own weights; any other model
runs its HF forward with the paged attention installed.
"""

import math
from dataclasses import dataclass

import torch

from shared.engine import attention, heap, paged_kernel
from shared.engine.attention import SequencePlan, build_plan, forward_plan
from shared.engine.kv_pool import KvPool
from shared.engine.llama_forward import LeanLlama
from shared.engine.sequence import Sequence
from shared.kv_layout import KvLayout
from shared.model_loader import LoadedModel


@dataclass(frozen=True)
class ScheduledSequence:
    """One sequence's share of a step.

    Attributes:
        seq: The sequence.
        num_tokens: Its pending tokens computed this step (from ``seq.num_kv_tokens``).
        samples: Whether its next token is sampled after them.
    """

    seq: Sequence
    num_tokens: int
    samples: bool


class ModelRunner:
    """Runs the model over scheduled sequences and returns the logits of the sampling rows."""

    def __init__(self, loaded: LoadedModel, layout: KvLayout, pool: KvPool, *, lean: bool = True):
        """``lean``: run the lean forward when the model supports it (``LeanLlama.supports``)."""
        self.model = loaded.model
        attention.install(self.model)
        self.lean = LeanLlama(self.model) if lean and LeanLlama.supports(self.model) else None
        self._device = loaded.device
        self._layout = layout
        self._pool = pool
        self.kernel = paged_kernel.kernel_for(pool.kv, layout.head_dim)
        if loaded.device.type == "cpu":
            heap.keep_freed_memory()  # before the engine's thread starts: it then shares the tuned arena

    def run(self, batch: list[ScheduledSequence]) -> torch.Tensor:
        """Logits of every sampling entry of ``batch``, in order (shape ``[samplers, vocab]``)."""
        input_ids, positions, slots, plans, sample_rows = [], [], [], [], []
        for entry in batch:
            seq = entry.seq
            start, end = seq.num_kv_tokens, seq.num_kv_tokens + entry.num_tokens
            plans.append(
                SequencePlan(
                    len(input_ids),
                    len(input_ids) + entry.num_tokens,
                    seq.block_ids[: math.ceil(end / self._layout.block_size)],
                    end,
                )
            )
            input_ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            slots.extend(self._slot(seq, position) for position in range(start, end))
            if entry.samples:
                sample_rows.append(len(input_ids) - 1)
        return self._forward(input_ids, positions, slots, plans, sample_rows)

    def _forward(self, input_ids, positions, slots, plans, sample_rows) -> torch.Tensor:
        device = self._device
        plan = build_plan(self._pool, torch.tensor(slots, dtype=torch.long, device=device), plans, self.kernel)
        # With nothing to sample (a prompt chunk), still keep one row: HF treats 0 as "all".
        keep = torch.tensor(sample_rows or [len(input_ids) - 1], dtype=torch.long, device=device)
        if self.lean is not None:
            ids = torch.tensor(input_ids, device=device)
            with torch.inference_mode():
                return self.lean.forward(plan, ids, torch.tensor(positions, device=device), keep)
        with torch.inference_mode(), forward_plan(plan):
            out = self.model(
                input_ids=torch.tensor([input_ids], device=device),
                position_ids=torch.tensor([positions], device=device),
                use_cache=False,
                logits_to_keep=keep,
            )
        return out.logits[0]

    def _slot(self, seq: Sequence, position: int) -> int:
        block_size = self._layout.block_size
        return seq.block_ids[position // block_size] * block_size + position % block_size
