"""Where a decode step's CPU goes: torch ops by category, one thread, per batch size.

``python -m loadtest.decode_profile [--model smollm2] [--batches 1,4,16] [--context 1024]
[--steps 8]`` runs an HF engine with ``batch`` sequences at ``context`` tokens and profiles
``steps`` decode steps with ``torch.profiler``. It prints one JSON line per batch: the step's
CPU ms (the thread's CPU time, unprofiled steps), and the profiled ops' self CPU ms per step
by category (matrix products by weight shape, attention, the K/V gather, elementwise ops,
sampling); ``other`` is the step's time outside any torch op (Python, the framework, the
scheduler).
"""

import argparse
import json
import time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from loadtest.engine_bench import _drain, _until_output, open_engine, synthetic_prompt
from shared.engine.sampling import SamplingParams
from shared.model_loader import load_model

_CATEGORIES = {
    "aten::mm": "matmul",
    "aten::addmm": "matmul",
    "aten::bmm": "matmul",
    "aten::linear": "matmul",
    "aten::_scaled_dot_product_flash_attention_for_cpu": "sdpa",
    "aten::index_select": "gather/index",
    "aten::index_copy_": "kv_write",
    "aten::index": "gather/index",
    "aten::argmax": "sampling",
    "aten::isfinite": "sampling",
    "aten::all": "sampling",
    "aten::any": "sampling",
    "aten::embedding": "embedding",
}


def _category(name: str) -> str:
    if name in _CATEGORIES:
        return _CATEGORIES[name]
    if name in ("aten::mul", "aten::add", "aten::pow", "aten::mean", "aten::rsqrt", "aten::silu", "aten::neg"):
        return "elementwise"
    if name in ("aten::cat", "aten::copy_", "aten::contiguous", "aten::clone", "aten::to", "aten::_to_copy"):
        return "copies"
    return "other_ops"


def profile_batch(engine, loaded, batch: int, context: int, steps: int) -> dict:
    """Step CPU ms (unprofiled) and per-category self CPU ms per step (profiled)."""
    ids = [f"p{batch}-{i}" for i in range(batch)]
    for i, rid in enumerate(ids):
        prompt = synthetic_prompt(loaded, context, 100 + i)
        engine.add_request(rid, prompt, SamplingParams(max_tokens=3 * steps + 8, ignore_eos=True))
    _until_output(engine, ids)
    engine.step()
    start = time.thread_time()
    for _ in range(steps):
        engine.step()
    step_ms = (time.thread_time() - start) / steps * 1000
    with profile(activities=[ProfilerActivity.CPU]):
        engine.step()  # the profiler's own first-use cost stays out of the figures
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        for _ in range(steps):
            engine.step()
    by_category: dict[str, float] = defaultdict(float)
    by_op: dict[str, float] = defaultdict(float)
    for event in prof.key_averages(group_by_input_shape=True):
        ms = event.self_cpu_time_total / 1000 / steps
        name = event.key
        cat = _category(name)
        if cat == "matmul":
            shapes = event.input_shapes
            cat = f"matmul {'x'.join(str(tuple(s)) for s in shapes if s)}"
        by_category[cat] += ms
        by_op[name] += ms
    ops_ms = sum(by_category.values())
    for rid in ids:
        engine.free(rid)
    _drain(engine)
    top = sorted(by_op.items(), key=lambda kv: -kv[1])[:15]
    return {
        "batch": batch,
        "step_cpu_ms": round(step_ms, 2),
        "profiled_ops_ms": round(ops_ms, 2),
        "categories_ms": {k: round(v, 2) for k, v in sorted(by_category.items(), key=lambda kv: -kv[1])},
        "top_ops_ms": {k: round(v, 2) for k, v in top},
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--batches", default="1,4,16")
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    loaded = load_model(args.model)
    engine = open_engine(loaded, "hf", kv_cache_bytes=1280 << 20)
    for batch in (int(b) for b in args.batches.split(",")):
        print(json.dumps(profile_batch(engine, loaded, batch, args.context, args.steps)), flush=True)


if __name__ == "__main__":
    main()
