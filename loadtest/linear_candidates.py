"""Matrix-product candidates on SmolLM2-135M's shapes, timed before choosing one.

``python -m loadtest.linear_candidates [--rows 1,4,16] [--threads 1] [--repeats 5]`` times,
for each row count, the products of 30 layers (q/k/v, o, gate/up, down; weights distinct per
layer, so they are read from memory as in a real step) plus lm_head, and prints one JSON line
per (rows, candidate): ms (median of ``--repeats``, the thread's CPU time) and the largest
difference from ``F.linear``:

- ``linear_separate``: ``F.linear`` (MKL) with q, k, v, gate and up as separate products (HF);
- ``linear_fused``: ``F.linear`` with q/k/v and gate/up concatenated;
- ``onednn_packed``: the fused weights prepacked once by oneDNN for 16 rows
  (``torch.ops.mkldnn._linear_pointwise``), what ``llama_forward.PackedLinear`` does.
"""

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

LAYERS, HIDDEN, INTERMEDIATE, KV_DIM, VOCAB = 30, 576, 1536, 192, 49152


def _layer_weights() -> dict[str, torch.Tensor]:
    return {
        "q": torch.randn(HIDDEN, HIDDEN),
        "k": torch.randn(KV_DIM, HIDDEN),
        "v": torch.randn(KV_DIM, HIDDEN),
        "o": torch.randn(HIDDEN, HIDDEN),
        "gate": torch.randn(INTERMEDIATE, HIDDEN),
        "up": torch.randn(INTERMEDIATE, HIDDEN),
        "down": torch.randn(HIDDEN, INTERMEDIATE),
    }


def _candidates(layers: list[dict], lm_head: torch.Tensor) -> dict:
    fused = [
        {
            "qkv": torch.cat([w["q"], w["k"], w["v"]]),
            "o": w["o"],
            "gu": torch.cat([w["gate"], w["up"]]),
            "down": w["down"],
        }
        for w in layers
    ]
    packed = [{name: torch.ops.mkldnn._reorder_linear_weight(t, 16) for name, t in f.items()} for f in fused]
    packed_lm = torch.ops.mkldnn._reorder_linear_weight(lm_head, 16)

    def separate(x, x_inner):
        outs = [F.linear(x, w[n]) for w in layers for n in ("q", "k", "v", "o", "gate", "up")]
        return outs + [F.linear(x_inner, w["down"]) for w in layers] + [F.linear(x, lm_head)]

    def linear_fused(x, x_inner):
        outs = [F.linear(x, f[n]) for f in fused for n in ("qkv", "o", "gu")]
        return outs + [F.linear(x_inner, f["down"]) for f in fused] + [F.linear(x, lm_head)]

    def onednn(x, x_inner):
        run = torch.ops.mkldnn._linear_pointwise
        outs = [run(x, p[n], None, "none", [], "") for p in packed for n in ("qkv", "o", "gu")]
        outs += [run(x_inner, p["down"], None, "none", [], "") for p in packed]
        return outs + [run(x, packed_lm, None, "none", [], "")]

    return {"linear_separate": separate, "linear_fused": linear_fused, "onednn_packed": onednn}


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", default="1,4,16")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    layers = [_layer_weights() for _ in range(LAYERS)]
    lm_head = torch.randn(VOCAB, HIDDEN)
    candidates = _candidates(layers, lm_head)
    for rows in (int(r) for r in args.rows.split(",")):
        x, x_inner = torch.randn(rows, HIDDEN), torch.randn(rows, INTERMEDIATE)
        reference = candidates["linear_fused"](x, x_inner)
        for name, run in candidates.items():
            times = []
            for _ in range(args.repeats):
                start = time.thread_time()
                outs = run(x, x_inner)
                times.append(time.thread_time() - start)
            diff = (
                max(float((a - b).abs().max()) for a, b in zip(outs, reference, strict=True))
                if name != "linear_separate"
                else None
            )
            line = {"rows": rows, "candidate": name, "ms": round(statistics.median(times) * 1000, 1), "max_diff": diff}
            print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
