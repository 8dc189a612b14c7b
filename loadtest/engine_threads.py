"""Torch intra-op threads per role, measured: several engine processes share the machine's
cores as a deployment's do, each busy with its role's work, under one thread setting each.

``python -m loadtest.engine_threads --roles prefill,decode,decode --threads 2,1,1`` starts one
process per role (SmolLM2, fp32), lets them load, starts them together and runs them for
``--seconds``; then prints one JSON line per process: a prefill engine's cold 1K-token prefills
(tokens/s), a decoder's batch-4 decode steps at 1K context (ms/step, median). docs/engine.md
has the figures and the defaults chosen from them.
"""

import argparse
import json
import multiprocessing
import statistics
import time

PROMPT_TOKENS = 1024
DECODE_BATCH = 4
DECODE_MAX_TOKENS = 1000  # more steps than a run takes; 4 x 2K tokens fit the 512 MiB pool


def _work(role: str, threads: int, start_at: multiprocessing.Value, ready, seconds: float, results):
    import torch

    from loadtest.engine_bench import _drain, _until_output, open_engine, synthetic_prompt
    from shared.engine.sampling import SamplingParams
    from shared.model_loader import load_model

    torch.set_num_threads(threads)
    loaded = load_model("smollm2")
    engine = open_engine(loaded)
    seeds = iter(range(10_000, 20_000))
    if role == "decode":
        ids = [f"d{i}" for i in range(DECODE_BATCH)]
        for request_id in ids:
            engine.add_request(
                request_id,
                synthetic_prompt(loaded, PROMPT_TOKENS, next(seeds)),
                SamplingParams(max_tokens=DECODE_MAX_TOKENS, ignore_eos=True),
            )
        _until_output(engine, ids)
    ready.release()
    while start_at.value == 0.0:
        time.sleep(0.05)
    times_s = []
    while time.monotonic() < start_at.value + seconds:
        begin = time.perf_counter()
        if role == "decode":
            engine.step()
        else:
            engine.add_request("p", synthetic_prompt(loaded, PROMPT_TOKENS, next(seeds)), SamplingParams(max_tokens=1))
            _until_output(engine, ["p"])
            engine.free("p")
            _drain(engine)
        times_s.append(time.perf_counter() - begin)
    median_s = statistics.median(times_s)
    figure = (
        {"decode_ms_per_step": median_s * 1000} if role == "decode" else {"prefill_tok_s": PROMPT_TOKENS / median_s}
    )
    results.put({"role": role, "threads": threads, "operations": len(times_s), **figure})


def run(roles: list[str], threads: list[int], seconds: float) -> list[dict]:
    """Run one process per role with its thread count, together; their figures in role order."""
    context = multiprocessing.get_context("spawn")
    start_at, ready, results = context.Value("d", 0.0), context.Semaphore(0), context.Queue()
    procs = [
        context.Process(target=_work, args=(role, n, start_at, ready, seconds, results))
        for role, n in zip(roles, threads, strict=True)
    ]
    for proc in procs:
        proc.start()
    for _ in procs:
        ready.acquire()
    start_at.value = time.monotonic() + 0.5
    figures = [results.get(timeout=seconds + 900) for _ in procs]  # a failed process: queue.Empty, no hang
    for proc in procs:
        proc.join()
    return figures


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--roles", default="prefill,decode,decode", help="one engine process per role")
    parser.add_argument("--threads", default="2,2,2", help="torch intra-op threads per process, in role order")
    parser.add_argument("--seconds", type=float, default=40.0, help="how long they run together")
    args = parser.parse_args()
    roles = args.roles.split(",")
    threads = [int(n) for n in args.threads.split(",")]
    for figure in run(roles, threads, args.seconds):
        print(json.dumps(figure))


if __name__ == "__main__":
    main()
