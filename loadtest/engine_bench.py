"""Engine microbenchmark: prefill, decode, extend and KV export/import speeds, printed as JSON.

Every figure is measured in this one run, through the backend interface, so ratios (batch-4
vs batch-1 throughput, extend vs decode step) compare like with like on a noisy machine. Run
it with ``pdd bench engine [--engine vllm]`` (``--quick`` for a smoke run on the tiny model).
"""

import statistics
import time
from collections.abc import Callable

import torch

from loadtest.engine_limits import MachineLimits, ModelCosts
from shared.engine.backend import BackendOptions, EngineBackend, create_backend
from shared.engine.hf_engine import HfEngine
from shared.engine.sampling import SamplingParams
from shared.kv_layout import KvLayout
from shared.kv_wire import decode_frame, frame_bytes
from shared.model_loader import LoadedModel

_WORDS = [
    "cross",
    "datacenter",
    "prefill",
    "decode",
    "relay",
    "handoff",
    "cache",
    "block",
    "token",
    "stream",
    "latency",
    "bandwidth",
    "jitter",
    "link",
    "site",
    "model",
    "layer",
    "head",
    "batch",
    "step",
    "extend",
    "export",
    "import",
]


def synthetic_prompt(loaded: LoadedModel, num_tokens: int, seed: int) -> list[int]:
    """Real words, tokenized, cut to ``num_tokens``; distinct per seed so nothing hits the cache."""
    words = [_WORDS[(seed * 7 + i * 13 + i // 5) % len(_WORDS)] for i in range(num_tokens * 2)]
    ids = loaded.tokenizer.encode(f"Request {seed}: " + " ".join(words), add_special_tokens=False)
    return ids[:num_tokens]


def _median_s(run: Callable[[], float], repeats: int) -> float:
    return statistics.median(run() for _ in range(repeats))


def open_engine(loaded: LoadedModel, engine_name: str = "hf", kv_cache_bytes: int = 512 << 20) -> EngineBackend:
    """One backend for a whole benchmark (vLLM allows one engine per process)."""
    block_size = 32 if engine_name == "vllm" else 16  # vLLM's CPU attention takes multiples of 32
    return create_backend(
        engine_name,
        BackendOptions(
            model=loaded.name,
            device=str(loaded.device),
            dtype=str(loaded.dtype).removeprefix("torch."),
            kv_cache_bytes=kv_cache_bytes,
            block_size=block_size,
        ),
        loaded,
    )


def _drain(engine: EngineBackend):
    """Step until the engine has nothing left (a freed export's blocks return in a step)."""
    while engine.has_work():
        engine.step()


def _until_output(engine: EngineBackend, request_ids: list[str]):
    """Step until each request has produced a token or absorbed its extend."""
    waiting = set(request_ids)
    while waiting:
        waiting -= {out.request_id for out in engine.step()}


def bench_prefill(
    engine: EngineBackend,
    loaded: LoadedModel,
    num_tokens: int,
    repeats: int,
    clock: Callable[[], float] = time.perf_counter,
) -> float:
    """Prompt tokens per second for a cold prefill of ``num_tokens`` (to its first token)."""
    seeds = iter(range(1000, 2000))

    def once() -> float:
        prompt = synthetic_prompt(loaded, num_tokens, next(seeds))
        start = clock()
        engine.add_request("p", prompt, SamplingParams(max_tokens=1))
        _until_output(engine, ["p"])
        elapsed = clock() - start
        engine.free("p")
        _drain(engine)
        return elapsed

    return num_tokens / _median_s(once, repeats)


def bench_decode(
    engine: EngineBackend,
    loaded: LoadedModel,
    batch: int,
    context: int,
    steps: int,
    clock: Callable[[], float] = time.perf_counter,
) -> float:
    """Milliseconds per decode step with ``batch`` sequences at ``context`` tokens."""
    ids = [f"d{batch}-{i}" for i in range(batch)]
    for i, request_id in enumerate(ids):
        # Prompt i is the same at every batch size: a larger batch finds the smaller ones'
        # prompts in the prefix cache, which only shortens the set-up before the timed steps.
        engine.add_request(
            request_id,
            synthetic_prompt(loaded, context, 100 + i),
            SamplingParams(max_tokens=steps + 8, ignore_eos=True),
        )
    _until_output(engine, ids)
    engine.step()  # warm-up
    start = clock()
    for _ in range(steps):
        engine.step()
    elapsed = clock() - start
    for request_id in ids:
        engine.free(request_id)
    _drain(engine)
    return elapsed / steps * 1000


def bench_extend(
    engine: EngineBackend,
    loaded: LoadedModel,
    context: int,
    num_tokens: int,
    repeats: int,
    clock: Callable[[], float] = time.perf_counter,
) -> float:
    """Milliseconds for main decode to absorb ``num_tokens`` handed-over token IDs in one pass.

    As on a real main decoder, the prompt KV is already there (here from the prefix cache)
    and the sequence is parked until the relay's tokens arrive.
    """
    if context % engine.block_size:
        raise ValueError("context must be a multiple of the block size")
    prompt = synthetic_prompt(loaded, context, 7000 + num_tokens)
    engine.add_request("cache", prompt, SamplingParams(max_tokens=1))
    _drain(engine)
    engine.free("cache")
    _drain(engine)
    sampling = SamplingParams(max_tokens=num_tokens + 8, ignore_eos=True)
    seeds = iter(range(77, 1077))

    def once() -> float:
        # Fresh tokens each time: an engine that caches the extended tokens' blocks (vLLM
        # re-reads prompt + handed tokens through its prefix cache) must not find them there.
        handed = synthetic_prompt(loaded, num_tokens, next(seeds))
        engine.begin_import("x", prompt, sampling)
        engine.finish_import("x", [])
        engine.extend("x", handed)
        start = clock()
        _until_output(engine, ["x"])
        elapsed = clock() - start
        engine.free("x")
        _drain(engine)
        return elapsed

    return _median_s(once, repeats) * 1000


def bench_transfer(loaded: LoadedModel, context: int, repeats: int, engine: EngineBackend | None = None) -> dict:
    """Export (encode) and import (validate + stage or write) throughput of a prompt's KV, GB/s:
    ``engine`` exports its own prompts, and imports fresh prompts an HF engine exported."""
    engine = engine or open_engine(loaded)
    peer = HfEngine(loaded, num_blocks=context // engine.block_size + 8, block_size=engine.block_size)
    kv_bytes = context * KvLayout.from_model(loaded.model).kv_bytes_per_token
    export_s, import_s = [], []
    for repeat in range(repeats):
        prompt = synthetic_prompt(loaded, context, 5000 + repeat)
        engine.add_request("out", prompt, SamplingParams(max_tokens=1))
        _until_output(engine, ["out"])
        start = time.perf_counter()
        [frame_bytes(parts) for parts in engine.export_frames("out", 0, context)]
        export_s.append(time.perf_counter() - start)
        engine.free("out")
        _drain(engine)
        fresh = synthetic_prompt(loaded, context, 6000 + repeat)
        peer.add_request("in", fresh, SamplingParams(max_tokens=1))
        _drain(peer)
        buffers = [bytearray(frame_bytes(parts)) for parts in peer.export_frames("in", 0, context)]
        peer.free("in")
        engine.begin_import("in", fresh, SamplingParams(max_tokens=1))
        start = time.perf_counter()
        for buffer in buffers:
            engine.import_frame(decode_frame(buffer, engine.frame_expectation))
        import_s.append(time.perf_counter() - start)
        engine.free("in")
    return {
        "kv_bytes": kv_bytes,
        "export_gb_s": kv_bytes / statistics.median(export_s) / 1e9,
        "import_gb_s": kv_bytes / statistics.median(import_s) / 1e9,
    }


DECODE_BATCHES = (1, 4, 8, 16)
EXTEND_TOKENS = (16, 64, 100)
PREFILL_TOKENS = {"256": 256, "1k": 1024, "4k": 4096}


def run_engine_bench(
    loaded: LoadedModel,
    *,
    quick: bool = False,
    engine_name: str = "hf",
    limits: MachineLimits | None = None,
    cpu_time: bool = False,
) -> dict:
    """All engine figures for ``loaded`` on one ``engine_name`` backend; ``quick`` shrinks contexts
    and repeats. Flat keys (``decode_b1_ms`` ... ``prefill_4k_tok_s``) carry the headline figures,
    and ``limit_fraction`` each one's share of this machine's floor (``engine_limits``).
    ``cpu_time``: time by the process's CPU time (every thread's) instead of the wall clock; with
    one thread, what other processes on a shared machine take does not count."""
    clock = time.process_time if cpu_time else time.perf_counter
    limits = limits or MachineLimits()
    context = 256 if quick else 1024
    steps = 4 if quick else 16
    repeats = 1 if quick else 3
    # Room for batch 16 at ``context`` beside the prefix cache's idle blocks.
    engine = open_engine(loaded, engine_name, kv_cache_bytes=1280 << 20)
    decode_ms = {b: bench_decode(engine, loaded, b, context, steps, clock) for b in DECODE_BATCHES}
    extend_ms = {n: bench_extend(engine, loaded, context, n, repeats, clock) for n in EXTEND_TOKENS}
    prefill = {
        name: bench_prefill(engine, loaded, n, repeats, clock)
        for name, n in PREFILL_TOKENS.items()
        if n < engine.max_context_len
    }
    figures = {f"decode_b{b}_ms": ms for b, ms in decode_ms.items()}
    figures |= {f"extend_{n}_ms": ms for n, ms in extend_ms.items()}
    figures |= {f"prefill_{name}_tok_s": tok_s for name, tok_s in prefill.items()}
    return {
        "model": loaded.name,
        "engine": engine_name,
        "device": str(loaded.device),
        "dtype": str(loaded.dtype).removeprefix("torch."),
        "clock": "process_cpu" if cpu_time else "wall",
        "torch_threads": torch.get_num_threads(),
        **figures,
        "limit_fraction": _limit_fractions(loaded, limits, context, decode_ms, extend_ms, prefill),
        "machine_limits": {"peak_gflop_s": limits.peak_gflop_s, "read_gb_s": limits.read_gb_s},
        "prefill_tok_s": {str(PREFILL_TOKENS[name]): tok_s for name, tok_s in prefill.items()},
        "decode_context_tokens": context,
        "decode_ms_per_step": {f"batch_{b}": ms for b, ms in decode_ms.items()},
        "decode_throughput_ratio_batch4_vs_batch1": 4 * decode_ms[1] / decode_ms[4],
        "extend_ms": {str(n): ms for n, ms in extend_ms.items()},
        "extend_cost_in_decode_steps": {str(n): ms / decode_ms[1] for n, ms in extend_ms.items()},
        "kv_transfer": bench_transfer(loaded, context, repeats, engine),
    }


def _limit_fractions(loaded: LoadedModel, limits: MachineLimits, context: int, decode_ms, extend_ms, prefill) -> dict:
    """Each flat figure's fraction of the machine's floor (1.0 = at the limit)."""
    costs = ModelCosts.of(loaded.model)
    fractions = {f"decode_b{b}_ms": limits.decode_floor_ms(costs, b, context) / ms for b, ms in decode_ms.items()}
    fractions |= {f"extend_{n}_ms": limits.chunk_floor_ms(costs, n, context) / ms for n, ms in extend_ms.items()}
    fractions |= {
        f"prefill_{name}_tok_s": tok_s / limits.prefill_ceiling_tok_s(costs, PREFILL_TOKENS[name])
        for name, tok_s in prefill.items()
    }
    return fractions


def compare_engines(
    loaded: LoadedModel,
    engine_names: list[str],
    *,
    quick: bool = False,
    limits: MachineLimits | None = None,
    cpu_time: bool = False,
) -> dict:
    """Each engine's figures in one run, and each figure's ratio to the first engine's (the HF
    engine and one vLLM engine can share a process)."""
    figures = {
        name: run_engine_bench(loaded, quick=quick, engine_name=name, limits=limits, cpu_time=cpu_time)
        for name in engine_names
    }
    base = figures[engine_names[0]]
    ratios = {}
    for name in engine_names[1:]:
        other = figures[name]
        ratios[f"{name}/{engine_names[0]}"] = {
            key: other[key] / value for key, value in base.items() if key in headline_keys(base) and key in other
        }
    return {"engines": figures, "ratios": ratios}


def headline_keys(figures: dict) -> list[str]:
    """The flat figure keys of one engine's results, in report order."""
    return [
        key
        for key, value in figures.items()
        if key.startswith(("decode_b", "extend_", "prefill_")) and isinstance(value, float)
    ]


def format_side_by_side(figures: dict[str, dict]) -> str:
    """A text table: each engine's figure with its fraction of the machine's limit beside it,
    and each engine's ratio to the first."""
    names = list(figures)
    base = figures[names[0]]
    header = "figure".ljust(20) + "".join(f"{name:>22}" for name in names)
    header += "".join(f"{name + '/' + names[0]:>14}" for name in names[1:])
    lines = [header, "-" * len(header)]
    for key in headline_keys(base):
        row = key.ljust(20)
        for name in names:
            value, fraction = figures[name].get(key), figures[name]["limit_fraction"].get(key)
            row += f"{value:>12.1f} ({fraction:4.2f} lim)" if value is not None else f"{'-':>22}"
        for name in names[1:]:
            row += f"{figures[name][key] / base[key]:>14.2f}" if key in figures[name] else f"{'-':>14}"
        lines.append(row)
    machine = base["machine_limits"]
    lines.append(
        f"(lim: fraction of this machine's floor at {machine['peak_gflop_s']:.0f} GFLOP/s fp32 and "
        f"{machine['read_gb_s']:.1f} GB/s read, loadtest/engine_limits.py; decode/extend in ms, prefill in tok/s)"
    )
    return "\n".join(lines)
