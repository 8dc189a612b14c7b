"""``pdd profile``: the engine's cost model, measured on the machine it runs on.

Every sample is one real engine step (or one KV export or import) timed on this machine:
cold prefills, prefills over a cached prefix, decode steps across batch sizes and contexts,
and extends of handed-over tokens. A non-negative least-squares fit over
:data:`~loadtest.sim.cost_model.FEATURES` turns them into a ``LinearCostModel``; the JSON keeps
the samples and the fit's error on each, so a reader can see how well a line explains them.
"""

import functools
import json
import os
import platform
import statistics
import time
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import torch

from loadtest.bulk_bench import loopback_bytes_per_s
from loadtest.engine_bench import _median_s, bench_transfer, synthetic_prompt
from loadtest.sim.cost_model import LinearCostModel, linear_as_json, nonnegative_least_squares, step_features
from loadtest.sim.step_speeds import calibrate
from shared.engine.hf_engine import DEFAULT_MAX_BATCH_TOKENS, HfEngine
from shared.engine.sampling import SamplingParams
from shared.model_loader import LoadedModel

SIZES = {
    "full": {
        "cold": (128, 512, 1024, 2048),
        "cached": ((512, 128), (1024, 128), (1024, 512), (2048, 256)),
        "decode": ((1, 256), (1, 1024), (1, 2048), (4, 256), (4, 1024), (8, 512)),
        "extend": (16, 64, 100),
        "extend_context": 1024,
        "repeats": 3,
        "steps": 8,
        "transfer_context": 1024,
    },
    "quick": {
        "cold": (32, 128),
        "cached": ((64, 32), (128, 64)),
        "decode": ((1, 64), (4, 64)),
        "extend": (8, 32),
        "extend_context": 64,
        "repeats": 1,
        "steps": 2,
        "transfer_context": 64,
    },
}


def _timed_step(engine: HfEngine) -> float:
    start = time.perf_counter()
    engine.step()
    return time.perf_counter() - start


def prefill_samples(loaded: LoadedModel, sizes: dict) -> list[dict]:
    """Cold prefills and prefills over a cached prefix, one step each."""
    engine = HfEngine(loaded, num_blocks=4096 * 1024 // 16 // 64 + 64, max_batch_tokens=1 << 20)
    seeds, samples = iter(range(5000, 9000)), []

    def prefill(new: int, cached: int) -> float:
        prompt = synthetic_prompt(loaded, cached + new, next(seeds))
        if cached:
            engine.add_request("warm", prompt[:cached], SamplingParams(max_tokens=1))
            engine.step()
            engine.free("warm")
        engine.add_request("p", prompt, SamplingParams(max_tokens=1))
        elapsed = _timed_step(engine)
        engine.free("p")
        return elapsed

    for new in sizes["cold"]:
        samples.append(
            {
                "kind": "prefill",
                "new": new,
                "context": 0,
                "seconds": _median_s(functools.partial(prefill, new, 0), sizes["repeats"]),
            }
        )
    for cached, new in sizes["cached"]:
        samples.append(
            {
                "kind": "prefill",
                "new": new,
                "context": cached,
                "seconds": _median_s(functools.partial(prefill, new, cached), sizes["repeats"]),
            }
        )
    return samples


def decode_samples(loaded: LoadedModel, sizes: dict) -> list[dict]:
    """Decode steps of ``batch`` sequences at ``context`` tokens (median of ``steps``)."""
    samples = []
    for batch, context in sizes["decode"]:
        steps = sizes["steps"]
        engine = HfEngine(loaded, num_blocks=batch * ((context + steps + 16) // 16 + 2) + 8, max_batch_tokens=context)
        for i in range(batch):
            engine.add_request(
                f"d{i}",
                synthetic_prompt(loaded, context, 300 + i),
                SamplingParams(max_tokens=steps + 4, ignore_eos=True),
            )
            engine.step()
        engine.step()  # warm-up
        times = [_timed_step(engine) for _ in range(steps)]
        samples.append(
            {"kind": "decode", "batch": batch, "context": context + 1 + steps // 2, "seconds": statistics.median(times)}
        )
    return samples


def extend_samples(loaded: LoadedModel, sizes: dict) -> list[dict]:
    """Main decode absorbing ``n`` handed-over tokens over a cached prompt, one step."""
    context, samples = sizes["extend_context"], []
    engine = HfEngine(loaded, num_blocks=(context + 256) // 16 * 2 + 16, max_batch_tokens=4096)
    prompt = synthetic_prompt(loaded, context, 41)
    engine.add_request("warm", prompt, SamplingParams(max_tokens=1))
    engine.step()
    engine.free("warm")
    for n in sizes["extend"]:
        handed = synthetic_prompt(loaded, n, 77)

        def once(n: int = n, handed: list[int] = handed) -> float:
            engine.begin_import("x", prompt, SamplingParams(max_tokens=n + 8, ignore_eos=True))
            engine.finish_import("x", [])
            engine.extend("x", handed)
            elapsed = _timed_step(engine)
            engine.free("x")
            return elapsed

        samples.append({"kind": "extend", "new": n, "context": context, "seconds": _median_s(once, sizes["repeats"])})
    return samples


def features_of(sample: dict) -> np.ndarray:
    """A sample's step features."""
    if sample["kind"] == "decode":
        return step_features([], sample["batch"], sample["batch"] * sample["context"])
    return step_features([(sample["new"], sample["context"])], 0, 0)


def fit(samples: list[dict], transfer: dict, kv_bytes_per_token: int, source: str) -> LinearCostModel:
    """The linear model through ``samples``, weighted by relative error (short decode steps
    matter as much as long prefills)."""
    features = np.stack([features_of(s) for s in samples])
    seconds = np.asarray([s["seconds"] for s in samples])
    coefficients = nonnegative_least_squares(features / seconds[:, None], np.ones_like(seconds))
    return LinearCostModel(
        tuple(float(c) for c in coefficients),
        transfer["export_gb_s"] * 1e9,
        transfer["import_gb_s"] * 1e9,
        kv_bytes_per_token,
        DEFAULT_MAX_BATCH_TOKENS,
        source,
    )


def _fit_source(loaded: LoadedModel) -> str:
    """What the fit was measured on: the model, its device, this machine and today's date."""
    return (
        f"{loaded.name} on {loaded.device} ({platform.machine()}, {platform.processor() or 'cpu'}), "
        f"{datetime.now(UTC).date().isoformat()}"
    )


def _add_fit_errors(samples: list[dict], model: LinearCostModel):
    """Add to each sample the seconds ``model`` predicts for it and its relative error."""
    for sample in samples:
        predicted = float(np.dot(model.coefficients, features_of(sample)))
        sample["predicted_seconds"] = round(predicted, 5)
        sample["rel_error"] = round(predicted / sample["seconds"] - 1, 3)


def measure_profile(
    loaded: LoadedModel,
    *,
    quick: bool = False,
    contention: bool = True,
    deployment_model: str | None = None,
    calibration_runs: int | None = None,
) -> dict:
    """Measure, fit, and return the profile JSON (``contention``: also how engines sharing the
    machine slow each other, see :func:`contention_samples`; ``deployment_model``: also how fast
    each kind of step runs inside a deployment of that model, over ``calibration_runs`` fresh
    deployments, see ``step_speeds.calibrate``)."""
    sizes = SIZES["quick" if quick else "full"]
    samples = prefill_samples(loaded, sizes) + decode_samples(loaded, sizes) + extend_samples(loaded, sizes)
    transfer = bench_transfer(loaded, sizes["transfer_context"], sizes["repeats"])
    kv_bytes = transfer["kv_bytes"] // sizes["transfer_context"]
    model = fit(samples, transfer, kv_bytes, _fit_source(loaded))
    local_bytes_per_s = loopback_bytes_per_s(loaded, megabytes=16 if quick else 64, repeats=sizes["repeats"])
    _add_fit_errors(samples, model)
    deployment_steps = (
        calibrate(deployment_model, model, quick=quick, runs=calibration_runs) if deployment_model else None
    )
    return {
        "model": loaded.name,
        "device": str(loaded.device),
        "dtype": str(loaded.dtype).removeprefix("torch."),
        "quick": quick,
        "host_cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "shared_host_speed": (
            contention_samples(loaded.name, max_processes=2 if quick else 3, steps=sizes["steps"])
            if contention
            else None
        ),
        "cost_model": linear_as_json(model),
        "samples": samples,
        "kv_transfer": transfer,
        "local_path": {
            "bytes_per_s": round(local_bytes_per_s),
            "source": "the bulk channel's sender and receiver on loopback, plaintext (as the "
            "deployment's local path), median of the repeats",
        },
        "deployment_steps": deployment_steps,
    }


def write_profile(profile: dict, path: Path):
    """Write the profile JSON."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(profile, indent=2) + "\n")


def _contended_worker(model_name: str, index: int, kind: str, steps: int, barrier, results):
    """One of several engine processes computing at the same time (a child process)."""
    from shared.model_loader import load_model

    loaded = load_model(model_name)
    engine = HfEngine(loaded, num_blocks=512, max_batch_tokens=4096)
    seeds = iter(range(20_000, 30_000))
    if kind == "decode":
        engine.add_request(
            "d", synthetic_prompt(loaded, 512, 7), SamplingParams(max_tokens=3 * steps + 8, ignore_eos=True)
        )
        engine.step()

    def once() -> float:
        if kind == "decode":
            return _timed_step(engine)
        engine.add_request("p", synthetic_prompt(loaded, 256, next(seeds)), SamplingParams(max_tokens=1))
        elapsed = _timed_step(engine)
        engine.free("p")
        return elapsed

    once()  # warm-up
    alone = 0.0
    for turn in range(barrier.parties):  # each measures alone while the others wait
        barrier.wait(timeout=300)
        if turn == index:
            alone = statistics.median(once() for _ in range(steps))
        barrier.wait(timeout=300)
    together = statistics.median(once() for _ in range(steps))
    results.put((kind, alone, together))


def contention_samples(model_name: str, *, max_processes: int, steps: int) -> dict:
    """Speed of an engine while ``k`` engine processes compute at once, relative to alone
    (measured for k = 2 .. ``max_processes``, half decoding and half prefilling): what a busy
    neighbour costs on this machine, oversubscribed threads included."""
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    speeds = {"1": 1.0}
    for k in range(2, max_processes + 1):
        barrier, results = context.Barrier(k), context.Queue()
        kinds = ["decode" if i % 2 == 0 else "prefill" for i in range(k)]
        workers = [
            context.Process(target=_contended_worker, args=(model_name, i, kind, steps, barrier, results))
            for i, kind in enumerate(kinds)
        ]
        for worker in workers:
            worker.start()
        try:
            rows = [results.get(timeout=600) for _ in workers]
        finally:
            for worker in workers:
                worker.join(timeout=60)
                if worker.is_alive():
                    worker.kill()
        if any(worker.exitcode for worker in workers):
            raise RuntimeError(f"a contention worker failed (exit codes {[w.exitcode for w in workers]})")
        speeds[str(k)] = round(statistics.mean(alone / together for _, alone, together in rows), 3)
    return speeds
