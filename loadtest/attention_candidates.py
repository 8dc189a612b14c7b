"""Decode attention candidates on SmolLM2-135M's geometry, timed before choosing one.

``python -m loadtest.attention_candidates [--batches 1,4,8,16] [--threads 1]`` times, over 30
layers of a pool with scattered blocks (9 query heads, 3 KV heads, head dim 64, 16-token
blocks, ~1K tokens of context per sequence, lengths differing by up to 49), one decode step's
attention by each candidate, and prints one JSON line per (batch, candidate): milliseconds
per step (median of ``--repeats``; the calling thread's CPU time with one thread, so other
processes on the machine skew it less; wall time otherwise) and the largest difference from
the per-sequence reference.

- ``per_sequence``: what the engine did before issue 31: gather each sequence's blocks,
  one SDPA call per sequence;
- ``batched_token_major``: one gather of the batch's block tables from a
  ``[blocks, block_size, kv_heads, dim]`` pool, one masked SDPA call with ``enable_gqa``;
- ``batched_head_major``: the same from a ``[kv_heads, blocks, block_size, dim]`` pool, where the
  gathered rows of each head are contiguous (what the engine does now);
- ``gather_only``: the head-major gather alone, the copy a kernel reading blocks in place saves;
- ``compiled_in_place``: ``torch.compile`` of gather + attention written as reductions, which
  Inductor fuses into loads from the pool (no gathered copy).
"""

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

LAYERS, Q_HEADS, KV_HEADS, HEAD_DIM, BLOCK = 30, 9, 3, 64, 16
CONTEXT_BLOCKS = 65  # 1,024-1,040 tokens


class Candidates:
    """One pool in each layout, and the batch's block tables, lengths and queries."""

    def __init__(self, batch: int, pool_blocks: int):
        self.batch = batch
        self.token_major = torch.randn(LAYERS, 2, pool_blocks, BLOCK, KV_HEADS, HEAD_DIM)
        self.head_major = self.token_major.permute(0, 1, 4, 2, 3, 5).contiguous()
        self.tables = torch.randperm(pool_blocks)[: batch * CONTEXT_BLOCKS].view(batch, CONTEXT_BLOCKS)
        self.lengths = [CONTEXT_BLOCKS * BLOCK - 16 - (37 * i) % 50 for i in range(batch)]
        visible = torch.arange(CONTEXT_BLOCKS * BLOCK)[None, :] < torch.tensor(self.lengths)[:, None]
        self.mask = torch.zeros(visible.shape).masked_fill_(~visible, float("-inf"))[:, None, None]
        self.query = torch.randn(batch, Q_HEADS, 1, HEAD_DIM)
        self._compiled = None

    def per_sequence(self, layer: int) -> torch.Tensor:
        outs = []
        for i, length in enumerate(self.lengths):
            k, v = (
                self.token_major[layer, kv].index_select(0, self.tables[i]).flatten(0, 1)[:length].transpose(0, 1)
                for kv in (0, 1)
            )
            outs.append(F.scaled_dot_product_attention(self.query[i : i + 1], k[None], v[None], enable_gqa=True))
        return torch.cat(outs)

    def batched_token_major(self, layer: int) -> torch.Tensor:
        flat = self.tables.flatten()
        k, v = (
            self.token_major[layer, kv].index_select(0, flat).view(self.batch, -1, KV_HEADS, HEAD_DIM).transpose(1, 2)
            for kv in (0, 1)
        )
        return F.scaled_dot_product_attention(self.query, k, v, attn_mask=self.mask, enable_gqa=True)

    def batched_head_major(self, layer: int) -> torch.Tensor:
        k, v = self.gather_only(layer)
        return F.scaled_dot_product_attention(self.query, k, v, attn_mask=self.mask, enable_gqa=True)

    def gather_only(self, layer: int):
        flat = self.tables.flatten()
        shape = (KV_HEADS, self.batch, -1, HEAD_DIM)
        return tuple(self.head_major[layer, kv].index_select(1, flat).view(shape).transpose(0, 1) for kv in (0, 1))

    def compiled_in_place(self, layer: int) -> torch.Tensor:
        if self._compiled is None:
            self._compiled = torch.compile(_reduction_attention, dynamic=False)
        return self._compiled(self.head_major[layer], self.tables, self.query, self.mask)


def _reduction_attention(pool_layer, tables, query, mask):
    batch = tables.shape[0]
    k = pool_layer[0][:, tables].view(KV_HEADS, batch, -1, HEAD_DIM).transpose(0, 1)
    v = pool_layer[1][:, tables].view(KV_HEADS, batch, -1, HEAD_DIM).transpose(0, 1)
    q = query.view(batch, KV_HEADS, Q_HEADS // KV_HEADS, HEAD_DIM)
    scores = (q.unsqueeze(-2) * k.unsqueeze(2)).sum(-1) * HEAD_DIM**-0.5 + mask
    weights = torch.softmax(scores, -1)
    return (weights.unsqueeze(-1) * v.unsqueeze(2)).sum(-2).view(batch, Q_HEADS, 1, HEAD_DIM)


NAMES = ("per_sequence", "batched_token_major", "batched_head_major", "gather_only", "compiled_in_place")


def time_candidate(candidates: Candidates, name: str, repeats: int, clock) -> dict:
    """Median milliseconds of one step (all layers) and the largest difference from the reference."""
    run = getattr(candidates, name)
    with torch.inference_mode():
        out = run(0)
        error = 0.0 if name == "gather_only" else float((out - candidates.per_sequence(0)).abs().max())
        times_ms = []
        for _ in range(repeats):
            start = clock()
            for layer in range(LAYERS):
                run(layer)
            times_ms.append((clock() - start) * 1000)
    return {"batch": candidates.batch, "candidate": name, "ms": statistics.median(times_ms), "max_abs_diff": error}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", default="1,4,8,16")
    parser.add_argument("--candidates", default=",".join(NAMES))
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    clock = time.thread_time if args.threads == 1 else time.perf_counter
    batches = [int(b) for b in args.batches.split(",")]
    for batch in batches:
        candidates = Candidates(batch, max(batches) * CONTEXT_BLOCKS + 8)
        for name in args.candidates.split(","):
            print(json.dumps(time_candidate(candidates, name, args.repeats, clock)), flush=True)


if __name__ == "__main__":
    main()
