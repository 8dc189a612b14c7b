"""HfEngine microbenchmark: prefill, decode, extend and KV export/import speeds, printed as JSON.

Every figure is measured in this one run, so ratios (batch-4 vs batch-1 throughput, extend
vs decode step) compare like with like on a noisy machine. Run it with
``pdd bench engine`` (``--quick`` for a smoke run on the tiny model).
"""

import statistics
import time
from collections.abc import Callable

from shared.engine.hf_engine import HfEngine
from shared.engine.sampling import SamplingParams
from shared.kv_wire import decode_frame, frame_bytes
from shared.model_loader import LoadedModel

_WORDS = ("cross datacenter prefill decode relay handoff cache block token stream latency "
          "bandwidth jitter link site model layer head batch step extend export import").split()


def synthetic_prompt(loaded: LoadedModel, num_tokens: int, seed: int) -> list[int]:
    """Real words, tokenized, cut to ``num_tokens``; distinct per seed so nothing hits the cache."""
    words = [_WORDS[(seed * 7 + i * 13 + i // 5) % len(_WORDS)] for i in range(num_tokens * 2)]
    ids = loaded.tokenizer.encode(f"Request {seed}: " + " ".join(words), add_special_tokens=False)
    return ids[:num_tokens]


def _median_s(run: Callable[[], float], repeats: int) -> float:
    return statistics.median(run() for _ in range(repeats))


def bench_prefill(loaded: LoadedModel, num_tokens: int, repeats: int) -> float:
    """Prompt tokens per second for a cold prefill of ``num_tokens``."""
    engine = HfEngine(loaded, num_blocks=num_tokens // 16 + 8, max_batch_tokens=num_tokens)
    seeds = iter(range(1000, 2000))

    def once() -> float:
        prompt = synthetic_prompt(loaded, num_tokens, next(seeds))
        start = time.perf_counter()
        engine.add_request("p", prompt, SamplingParams(max_tokens=1))
        engine.step()
        elapsed = time.perf_counter() - start
        engine.free("p")
        return elapsed

    return num_tokens / _median_s(once, repeats)


def _decoding_engine(loaded: LoadedModel, batch: int, context: int, steps: int) -> HfEngine:
    """An engine with ``batch`` sequences prefilled to ``context`` tokens, ready to decode."""
    engine = HfEngine(loaded, num_blocks=batch * ((context + steps + 120) // 16 + 2),
                    max_batch_tokens=context)
    for i in range(batch):
        engine.add_request(f"d{i}", synthetic_prompt(loaded, context, i),
                           SamplingParams(max_tokens=steps + 120, ignore_eos=True))
        engine.step()
    return engine


def bench_decode(loaded: LoadedModel, batch: int, context: int, steps: int) -> float:
    """Milliseconds per decode step with ``batch`` sequences at ``context`` tokens."""
    engine = _decoding_engine(loaded, batch, context, steps)
    engine.step()  # warm-up
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    return (time.perf_counter() - start) / steps * 1000


def bench_extend(loaded: LoadedModel, context: int, num_tokens: int, repeats: int) -> float:
    """Milliseconds for main decode to absorb ``num_tokens`` handed-over token IDs in one pass.

    As on a real main decoder, the prompt KV is already there (here from the prefix cache)
    and the sequence is parked until the relay's tokens arrive.
    """
    if context % 16:
        raise ValueError("context must be a multiple of the block size")
    engine = _decoding_engine(loaded, 1, context, 4)
    prompt = synthetic_prompt(loaded, context, 0)  # d0's, now in the prefix cache
    engine.free("d0")
    handed = synthetic_prompt(loaded, num_tokens, 77)
    sampling = SamplingParams(max_tokens=num_tokens + 8, ignore_eos=True)

    def once() -> float:
        engine.begin_import("x", prompt, sampling)
        engine.finish_import("x", [])
        engine.extend("x", handed)
        start = time.perf_counter()
        engine.step()
        elapsed = time.perf_counter() - start
        engine.free("x")
        return elapsed

    return _median_s(once, repeats) * 1000


def bench_transfer(loaded: LoadedModel, context: int, repeats: int) -> dict:
    """Export (encode) and import (validate + write) throughput of a prompt's KV, GB/s."""
    sender = _decoding_engine(loaded, 1, context, 1)
    prompt = sender.get("d0").token_ids[:context]
    kv_bytes = context * sender.layout.kv_bytes_per_token
    export_s, import_s = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        frames = [frame_bytes(parts) for parts in sender.export_frames("d0")]
        export_s.append(time.perf_counter() - start)
        buffers = [bytearray(f) for f in frames]
        receiver = HfEngine(loaded, num_blocks=context // 16 + 4)  # cold: every block is written
        receiver.begin_import("d0", prompt, SamplingParams(max_tokens=1))
        start = time.perf_counter()
        for buffer in buffers:
            receiver.import_frame(decode_frame(buffer, receiver.frame_expectation))
        import_s.append(time.perf_counter() - start)
    return {
        "kv_bytes": kv_bytes,
        "export_gb_s": kv_bytes / statistics.median(export_s) / 1e9,
        "import_gb_s": kv_bytes / statistics.median(import_s) / 1e9,
    }


def run_engine_bench(loaded: LoadedModel, *, quick: bool = False) -> dict:
    """All engine figures for ``loaded``; ``quick`` shrinks contexts and repeats."""
    context = 256 if quick else 1024
    steps = 4 if quick else 16
    repeats = 1 if quick else 3
    decode_ms = {b: bench_decode(loaded, b, context, steps) for b in (1, 4)}
    decode_step_ms = decode_ms[1]
    extend_ms = {n: bench_extend(loaded, context, n, repeats) for n in (16, 64, 100)}
    return {
        "model": loaded.name,
        "device": str(loaded.device),
        "dtype": str(loaded.dtype).removeprefix("torch."),
        "prefill_tok_s": {str(n): bench_prefill(loaded, n, repeats) for n in (256, 1024)},
        "decode_context_tokens": context,
        "decode_ms_per_step": {f"batch_{b}": ms for b, ms in decode_ms.items()},
        "decode_throughput_ratio_batch4_vs_batch1": 4 * decode_ms[1] / decode_ms[4],
        "extend_ms": {str(n): ms for n, ms in extend_ms.items()},
        "extend_cost_in_decode_steps": {str(n): ms / decode_step_ms for n, ms in extend_ms.items()},
        "kv_transfer": bench_transfer(loaded, context, repeats),
    }
