"""What an engine-call log (``PDD_ENGINE_CALL_LOG``, ``shared/engine_call_log.py``) says about
head-of-line waits: per role, how long ``add_request`` (a new prompt) waited on the engine
thread behind the call in progress, beside how long a step that computed prompt tokens took.

``python -m loadtest.engine_calls /tmp/calls.jsonl`` prints one JSON object:
``{role: {"add_request_wait_ms": {p50, p90, p99, mean}, "prompt_step_ms": {...},
"decode_step_ms": {...}, "add_requests": N, "steps": N}}``. A role is the instance id
without its index (``prefill``, ``relay-decode``, ``main-decode``). A prompt step is a step
whose batch holds a sequence with more than one new token (a prompt's chunk or an extend); a
decode step computes one token per sequence. Issue 31's criterion: ``add_request`` p90 wait
at most one prompt step.
"""

import argparse
import json
import sys
from collections import defaultdict

from loadtest.bench import percentiles


def role_of(instance: str) -> str:
    """``main-decode-1`` → ``main-decode``."""
    head, _, tail = instance.rpartition("-")
    return head if tail.isdigit() and head else instance


def summarise_calls(lines) -> dict:
    """The summary of an iterable of call-log lines (JSON strings; blank lines skipped)."""
    waits_ms: dict[str, list[float]] = defaultdict(list)
    prompt_steps_ms: dict[str, list[float]] = defaultdict(list)
    decode_steps_ms: dict[str, list[float]] = defaultdict(list)
    for line in lines:
        if not line.strip():
            continue
        call = json.loads(line)
        role = role_of(call["instance"])
        if call["call"] == "add_request":
            waits_ms[role].append((call["start_s"] - call["queued_s"]) * 1000)
        elif call["call"] == "step" and call.get("batch"):
            took_ms = (call["end_s"] - call["start_s"]) * 1000
            computes_prompt = any(new_tokens > 1 for new_tokens, _cached in call["batch"])
            (prompt_steps_ms if computes_prompt else decode_steps_ms)[role].append(took_ms)
    roles = sorted(set(waits_ms) | set(prompt_steps_ms) | set(decode_steps_ms))
    return {
        role: {
            "add_request_wait_ms": percentiles(waits_ms[role]),
            "prompt_step_ms": percentiles(prompt_steps_ms[role]),
            "decode_step_ms": percentiles(decode_steps_ms[role]),
            "add_requests": len(waits_ms[role]),
            "steps": len(prompt_steps_ms[role]) + len(decode_steps_ms[role]),
        }
        for role in roles
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("log", help="an engine-call log (PDD_ENGINE_CALL_LOG)")
    args = parser.parse_args(argv)
    with open(args.log) as lines:
        json.dump(summarise_calls(lines), sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
