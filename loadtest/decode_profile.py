"""Where a decode step's CPU goes, per batch size: the thread's CPU time around each piece.

``python -m loadtest.decode_profile [--model smollm2] [--batches 1,4,16] [--context 1024]
[--steps 16] [--threads 1]`` runs an HF engine with ``batch`` sequences at ``context`` tokens,
times ``steps`` decode steps by ``time.thread_time()`` and prints one JSON line per batch:
the step's CPU ms and, per step, the CPU ms inside the matrix products (``F.linear`` and the
lean forward's ``PackedLinear``), the K/V gather (``KvPool.gather_blocks``), SDPA, the K/V
write, sampling (``HfEngine._sample`` and the batched row facts), the forward pass as a whole
and the scheduler; ``rest_of_forward`` is the forward's time outside those (embedding,
RMSNorm, rotary, residuals, Python). Pieces that do not exist in the engine being measured
are skipped, so the same script times an older checkout (``PYTHONPATH`` to it).
"""

import argparse
import json
import time
from collections import defaultdict

import torch
import torch.nn.functional as F

from loadtest.engine_bench import _drain, _until_output, open_engine, synthetic_prompt
from shared.engine import hf_engine, kv_pool, model_runner, sampler
from shared.engine.sampling import SamplingParams
from shared.model_loader import load_model

_SPENT_S: dict[str, float] = defaultdict(float)


def _timed(owner, name: str, piece: str):
    """Replace ``owner.name`` by a wrapper adding its thread CPU time to ``piece``."""
    inner = getattr(owner, name, None)
    if inner is None:
        return

    def wrapper(*args, **kwargs):
        start = time.thread_time()
        try:
            return inner(*args, **kwargs)
        finally:
            _SPENT_S[piece] += time.thread_time() - start

    setattr(owner, name, wrapper)


def _instrument():
    _timed(F, "linear", "matmul")
    _timed(F, "scaled_dot_product_attention", "sdpa")
    _timed(kv_pool.KvPool, "gather_blocks", "gather")
    _timed(kv_pool.KvPool, "write", "kv_write")
    _timed(hf_engine.HfEngine, "_sample", "sampling")
    _timed(hf_engine, "row_facts", "sampling")
    _timed(sampler, "row_facts", "sampling")
    _timed(model_runner.ModelRunner, "run", "forward")
    _timed(model_runner, "build_plan", "build_plan")
    try:
        from shared.engine import llama_forward
    except ImportError:  # an engine without the lean forward
        return
    _timed(llama_forward.PackedLinear, "__call__", "matmul")


def profile_batch(engine, loaded, batch: int, context: int, steps: int) -> dict:
    """CPU ms per decode step, whole and by piece, with ``batch`` sequences at ``context``."""
    ids = [f"p{batch}-{i}" for i in range(batch)]
    for i, rid in enumerate(ids):
        prompt = synthetic_prompt(loaded, context, 100 + i)
        engine.add_request(rid, prompt, SamplingParams(max_tokens=steps + 8, ignore_eos=True))
    _until_output(engine, ids)
    engine.step()
    _SPENT_S.clear()
    start = time.thread_time()
    for _ in range(steps):
        engine.step()
    step_ms = (time.thread_time() - start) / steps * 1000
    pieces = {name: s / steps * 1000 for name, s in _SPENT_S.items()}
    inside = sum(pieces.get(name, 0.0) for name in ("matmul", "sdpa", "gather", "kv_write", "build_plan"))
    pieces["rest_of_forward"] = pieces.get("forward", 0.0) - inside
    pieces["outside_forward"] = step_ms - pieces.get("forward", 0.0)
    for rid in ids:
        engine.free(rid)
    _drain(engine)
    return {"batch": batch, "step_cpu_ms": round(step_ms, 1), "ms": {k: round(v, 1) for k, v in pieces.items()}}


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--batches", default="1,4,16")
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    loaded = load_model(args.model)
    engine = open_engine(loaded, "hf", kv_cache_bytes=1280 << 20)
    _instrument()
    for batch in (int(b) for b in args.batches.split(",")):
        print(json.dumps(profile_batch(engine, loaded, batch, args.context, args.steps)), flush=True)


if __name__ == "__main__":
    main()
