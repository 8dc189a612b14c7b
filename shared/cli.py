"""The ``pdd`` command line: ``pdd generate`` and ``pdd bench engine`` (services come later)."""

import argparse
import json
import sys
import time

from shared.errors import PddError
from shared.logging import configure_logging


def _add_model_args(parser: argparse.ArgumentParser):
    parser.add_argument("--model", default="smollm2",
                        help="smollm2 (default), tiny (random test model) or an HF model folder")
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every ``pdd`` subcommand."""
    parser = argparse.ArgumentParser(prog="pdd", description=__doc__)
    parser.add_argument("--log-level", default="warning", help="debug, info, warning or error")
    commands = parser.add_subparsers(dest="command", required=True)

    generate = commands.add_parser("generate", help="run the engine in-process on one prompt")
    generate.add_argument("prompt", help="the user message (or raw text with --raw)")
    _add_model_args(generate)
    generate.add_argument("--max-tokens", type=int, default=128)
    generate.add_argument("--temperature", type=float, default=0.0)
    generate.add_argument("--top-p", type=float, default=1.0)
    generate.add_argument("--seed", type=int, default=None)
    generate.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    generate.add_argument("--raw", action="store_true", help="do not apply the chat template")

    bench = commands.add_parser("bench", help="benchmarks")
    bench_kinds = bench.add_subparsers(dest="bench", required=True)
    engine = bench_kinds.add_parser("engine", help="engine microbenchmark, JSON on stdout")
    _add_model_args(engine)
    engine.add_argument("--quick", action="store_true", help="short contexts, one repeat")
    return parser


def cmd_generate(args) -> int:
    """Stream one completion to stdout; statistics go to stderr."""
    from shared.engine.engine import Engine
    from shared.engine.sampling import SamplingParams
    from shared.model_loader import load_model

    loaded = load_model(args.model, device=args.device, dtype=args.dtype)
    tokenizer = loaded.tokenizer
    if args.raw:
        prompt = tokenizer.encode(args.prompt)
    else:
        prompt = list(tokenizer.apply_chat_template(
            [{"role": "user", "content": args.prompt}], add_generation_prompt=True,
            tokenize=True, return_dict=False))
    sampling = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                              top_p=args.top_p, seed=args.seed, stop=tuple(args.stop))
    engine = Engine(loaded)
    start = time.perf_counter()
    engine.add_request("cli", prompt, sampling)
    printed, first_token_s = "", None
    while engine.has_work():
        for out in engine.step():
            if out.error:
                raise PddError(out.error)
            first_token_s = first_token_s or time.perf_counter() - start
        text = tokenizer.decode(engine.get("cli").output_token_ids, skip_special_tokens=True)
        # Hold back a trailing replacement char: a multi-byte character may be half-decoded.
        stable = text.rstrip("\ufffd")
        sys.stdout.write(stable[len(printed):])
        sys.stdout.flush()
        printed = stable
    seq = engine.free("cli")
    elapsed = time.perf_counter() - start
    num_out = len(seq.output_token_ids)
    print(file=sys.stdout)
    print(json.dumps({"prompt_tokens": len(prompt), "output_tokens": num_out,
                      "finish_reason": seq.finish_reason, "ttft_s": round(first_token_s, 3),
                      "decode_tok_s": round((num_out - 1) / max(elapsed - first_token_s, 1e-9), 1)}),
          file=sys.stderr)
    return 0


def cmd_bench(args) -> int:
    """Run the engine microbenchmark and print its JSON."""
    from loadtest.engine_bench import run_engine_bench
    from shared.model_loader import load_model

    model = "tiny" if args.quick and args.model == "smollm2" else args.model
    loaded = load_model(model, device=args.device, dtype=args.dtype)
    print(json.dumps(run_engine_bench(loaded, quick=args.quick), indent=2))
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``pdd`` console script."""
    args = build_parser().parse_args(argv)
    configure_logging(args.log_level)
    handlers = {"generate": cmd_generate, "bench": cmd_bench}
    try:
        return handlers[args.command](args)
    except (PddError, ValueError) as exc:
        print(f"pdd: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
