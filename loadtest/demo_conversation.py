"""A short multi-turn agent conversation against a running deployment, one line per turn.

Turn 1 carries a long cold tool output (over a thousand tokens): its KV would take seconds to
cross the default 100 Mbit/s link, so the router relays it (P→RLD→MD) and the first tokens
come from the relay. Later turns re-send the growing context: the main decoder already
holds it, only the new blocks cross the WAN, and they go P→MD.
"""

import json
import time

from openai import OpenAI

TOOL_OUTPUT_LINES = [
    "src/router/service.py: 212 lines, routes OpenAI requests to prefill and decode instances",
    "src/prefill/service.py: 198 lines, computes prompt KV and ships it on two paths",
    "src/relay_decode/service.py: 141 lines, decodes eager tokens while the WAN copy is in flight",
    "src/main_decode/service.py: 133 lines, keeps a decode-side radix cache and absorbs handoffs",
    "tests/test_pipeline_e2e.py: 17 passed in 14.2 s, token-exact against transformers",
    "bench/results.json: p50 TTFT 410 ms, p99 TTFT 2.9 s, WAN bytes per request 1.8 MB",
]

TURNS = [
    (
        "Here is the output of `ls -R` and the last test run of our repository:\n\n{tool}\n\n"
        "Summarise what the project does in two sentences."
    ),
    (
        "The test run also printed: `FAILED tests/test_faults.py::test_partition - timeout after 4 s`. "
        "What is the most likely cause?"
    ),
    "Suggest one concrete change to make that test pass, in one sentence.",
    "Thanks. Write a one-line commit message for that change.",
]


def long_tool_output(num_lines: int = 24) -> str:
    """A realistic, deterministic tool output of roughly 25 tokens per line."""
    return "\n".join(
        f"[{i:03d}] {TOOL_OUTPUT_LINES[i % len(TOOL_OUTPUT_LINES)]} (checked at step {i * 7})" for i in range(num_lines)
    )


def run_demo(
    base_url: str, model: str, max_tokens: int = 48, first_turn_max_tokens: int = 96, *, reference=None, after_turn=None
) -> int:
    """Hold the conversation; print one line per turn and the answers; return an exit code.

    Args:
        base_url: The router's OpenAI base URL.
        model: The model's name, for the header line.
        max_tokens: Answer length of turns 2 on.
        first_turn_max_tokens: Answer length of turn 1.
        reference: ``reference(messages, max_tokens) -> str``, transformers' greedy answer; when
            given, each turn says whether the served text equals it, and a mismatch fails.
        after_turn: ``after_turn(turn)``, called after each turn (e.g. to change the link).
    """
    client = OpenAI(base_url=base_url, api_key="not-needed")
    served = client.models.list().data[0].id
    messages = [{"role": "system", "content": "You are a careful coding agent. Answer briefly."}]
    print(f"model {served} ({model}); {len(TURNS)} turns, max {first_turn_max_tokens} then {max_tokens} tokens\n")
    print(
        f"{'turn':>4} {'prompt':>7} {'TTFT ms':>8} {'pipeline':>9} {'eager':>6} {'handoff':>10} "
        f"{'done on':>8} {'MD cached':>10} {'WAN KB':>8}" + (f" {'exact':>6}" if reference else "")
    )
    mismatches = 0
    for turn, template in enumerate(TURNS, 1):
        messages.append({"role": "user", "content": template.format(tool=long_tool_output())})
        # A longer first answer lets the relay hand over once the WAN copy has landed.
        limit = first_turn_max_tokens if turn == 1 else max_tokens
        answer, ttft_ms, pdd = stream_turn(client, served, messages, limit)
        exact = "" if reference is None else f" {'yes' if answer == reference(messages, limit) else 'NO':>6}"
        mismatches += exact.strip() == "NO"
        messages.append({"role": "assistant", "content": answer})
        handoff = f"{pdd.get('handoff_mode')}x{pdd.get('handoff_chunks')}" if pdd.get("handoff_mode") else "-"
        print(
            f"{turn:>4} {pdd.get('prompt_tokens', 0):>7} {ttft_ms or 0:>8.0f} {pdd.get('pipeline', '?'):>9} "
            f"{pdd.get('eager_tokens', 0):>6} {handoff:>10} {pdd.get('finished_on')!s:>8} "
            f"{pdd.get('cached_blocks_md', 0):>10} {pdd.get('wan_kv_bytes', 0) / 1024:>8.0f}{exact}"
        )
        print(f"     ↳ {json.dumps(answer)[:110]}", flush=True)
        if after_turn is not None:
            after_turn(turn)
    if mismatches:
        print(f"{mismatches} answer(s) differ from transformers' greedy output")
    return 1 if mismatches else 0


def stream_turn(client, served: str, messages: list[dict], limit: int) -> tuple[str, float | None, dict]:
    """One greedy streamed answer: its text, TTFT in ms (None if empty) and ``pdd`` fields."""
    started = time.perf_counter()
    ttft_ms, text, pdd = None, [], {}
    stream = client.chat.completions.create(
        model=served, messages=messages, max_tokens=limit, temperature=0, stream=True
    )
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            ttft_ms = ttft_ms or (time.perf_counter() - started) * 1000
            text.append(chunk.choices[0].delta.content)
        extra = getattr(chunk, "model_extra", None) or {}
        pdd = extra.get("pdd", pdd)
    return "".join(text), ttft_ms, pdd
