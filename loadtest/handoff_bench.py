"""How much a handoff stalls main decode's other streams: one-shot vs catch-up.

Main decode runs ``other_streams`` requests decoding at ``context`` tokens. A relayed request
is handed over with ``handoff_tokens`` token IDs, either in one extend (one-shot) or in
bounded chunks absorbed step by step (catch-up, as the relay's HandoffMachine sends them).
Every step produces one token for each other stream, so a step's duration is their
inter-token gap; we report the worst gap during the handoff against the median gap without
one. Both modes run in one invocation on the same engine (side by side, same noise).
"""

import statistics
import time

from loadtest.engine_bench import synthetic_prompt
from shared.engine.backend import generate
from shared.engine.hf_engine import HfEngine
from shared.engine.sampling import SamplingParams
from shared.model_loader import LoadedModel


def _timed_steps(engine: HfEngine, steps: int) -> list[float]:
    gaps = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        gaps.append(time.perf_counter() - start)
    return gaps


def _handoff_gaps(engine: HfEngine, prompt: list[int], handed: list[int], chunk_tokens: int) -> list[float]:
    """Step durations while main decode absorbs ``handed`` in chunks of ``chunk_tokens``."""
    sampling = SamplingParams(max_tokens=len(handed) + 8, ignore_eos=True)
    engine.begin_import("h", prompt, sampling)  # the prompt's blocks come from the prefix cache
    engine.finish_import("h", [])
    gaps, start = [], 0
    while start < len(handed):
        end = min(start + chunk_tokens, len(handed))
        engine.extend("h", handed[start:end], sample=end == len(handed))
        gaps.extend(_timed_steps(engine, 1))
        start = end
    engine.free("h")
    return gaps


def run_handoff_bench(
    loaded: LoadedModel,
    *,
    other_streams: int = 3,
    context: int = 512,
    handoff_tokens: int = 100,
    chunk_tokens: int = 32,
    repeats: int = 3,
) -> dict:
    """Worst inter-token gap of the other streams during a handoff, per mode."""
    if context % 16:
        raise ValueError("context must be a multiple of the block size")
    engine = HfEngine(
        loaded,
        num_blocks=(other_streams + 2) * ((context + 400) // 16 + 4),
        max_batch_tokens=max(context, handoff_tokens + other_streams),
    )
    for i in range(other_streams):
        engine.add_request(
            f"s{i}", synthetic_prompt(loaded, context, i), SamplingParams(max_tokens=390, ignore_eos=True)
        )
        engine.step()
    prompt = synthetic_prompt(loaded, context, 99)
    generate(engine, "warm", prompt + [0], SamplingParams(max_tokens=1))  # caches the prompt's blocks
    handed = synthetic_prompt(loaded, handoff_tokens, 7)
    baseline = _timed_steps(engine, 8)
    modes = {"one_shot": handoff_tokens, "catch_up": chunk_tokens}
    worst = {mode: [] for mode in modes}
    for _ in range(repeats):
        for mode, size in modes.items():
            worst[mode].append(max(_handoff_gaps(engine, prompt, handed, size)))
            baseline += _timed_steps(engine, 2)
    median_ms = statistics.median(baseline) * 1000
    report = {
        "model": loaded.name,
        "other_streams": other_streams,
        "context_tokens": context,
        "handoff_tokens": handoff_tokens,
        "catch_up_chunk_tokens": chunk_tokens,
        "baseline_gap_ms": round(median_ms, 1),
    }
    for mode in modes:
        gap_ms = statistics.median(worst[mode]) * 1000
        report[mode] = {"worst_gap_ms": round(gap_ms, 1), "stall_vs_baseline": round(gap_ms / median_ms, 2)}
    report["catch_up_vs_one_shot_worst_gap"] = round(
        report["catch_up"]["worst_gap_ms"] / report["one_shot"]["worst_gap_ms"], 2
    )
    return report
