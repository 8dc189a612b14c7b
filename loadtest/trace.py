"""Seeded agentic traces: multi-turn sessions whose context grows with tool outputs.

Each session opens with a long cold turn (a task plus a big tool output), then follows with
turns that add a short user message or a tool output to the growing context (the model's
own answers are appended by the runner, so every later turn re-sends what the caches hold).
That gives the skew the paper reports: most requests hit above 95 % of their prompt, a
minority are cold or low-hit. A few percent are "odd": a long fresh document with a very
short output bound. All text is real words, deterministic per seed. Traces save to and
load from JSONL.
"""

import json
import random
from dataclasses import asdict, dataclass
from pathlib import Path

_SUBJECTS = [
    "router",
    "prefill",
    "relay",
    "main decoder",
    "cache index",
    "link",
    "scheduler",
    "tokenizer",
    "benchmark",
    "deployment",
    "KV pool",
    "handoff",
]
_VERBS = [
    "reported",
    "timed out after",
    "recovered in",
    "allocated",
    "evicted",
    "shipped",
    "measured",
    "retried",
    "streamed",
    "checkpointed",
]
_UNITS = ["ms", "blocks", "MB", "tokens", "requests", "retries"]
_QUESTIONS = [
    "What changed since the last run?",
    "Which component is the bottleneck?",
    "Summarise the failures.",
    "What should we try next?",
    "Is this within the SLO?",
    "Explain the latency spike.",
    "Which line matters most?",
]


@dataclass(frozen=True)
class TraceTurn:
    """One request of a session.

    Attributes:
        session: Session number.
        turn: Turn number within the session, from 0.
        content: The user message added this turn (the runner keeps the history).
        max_tokens: Output bound.
        kind: ``cold`` (first turn), ``warm`` (follow-up) or ``odd`` (long input, tiny output).
        start_s: Offset of the session's start (open loop); turns follow answers.
    """

    session: int
    turn: int
    content: str
    max_tokens: int
    kind: str
    start_s: float = 0.0


def tool_output(rng: random.Random, lines: int) -> str:
    """Log-like lines of real words."""
    return "\n".join(
        f"[{i:03d}] {rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.randint(1, 999)} "
        f"{rng.choice(_UNITS)} while handling step {rng.randint(1, 99)}"
        for i in range(lines)
    )


def generate_trace(
    seed: int,
    *,
    sessions: int,
    turns: int,
    cold_lines: int = 60,
    tool_lines: int = 8,
    tool_turn_share: float = 0.2,
    max_tokens: int = 24,
    odd_share: float = 0.04,
    session_rate_per_s: float = 0.0,
) -> list[TraceTurn]:
    """A trace of ``sessions`` × ``turns`` requests (plus odd requests at ``odd_share``).

    With ``session_rate_per_s`` > 0 sessions start at Poisson times (open loop).
    """
    rng = random.Random(seed)
    trace, start = [], 0.0
    for session in range(sessions):
        if session_rate_per_s > 0:
            start += rng.expovariate(session_rate_per_s)
        trace.append(
            TraceTurn(
                session,
                0,
                "Here is the tool output of the job:\n" + tool_output(rng, cold_lines) + "\n" + rng.choice(_QUESTIONS),
                max_tokens,
                "cold",
                start,
            )
        )
        for turn in range(1, turns):
            content = _follow_up(rng, tool_lines, tool_turn_share)
            trace.append(TraceTurn(session, turn, content, max_tokens, "warm", start))
    odd_count = round(len(trace) * odd_share / (1 - odd_share)) if odd_share else 0
    for i in range(odd_count):
        session = sessions + i
        trace.append(
            TraceTurn(
                session,
                0,
                "Classify this log as OK or FAIL:\n" + tool_output(rng, cold_lines) + "\nAnswer with one word.",
                2,
                "odd",
                rng.uniform(0, start) if start else 0.0,
            )
        )
    return trace


def _follow_up(rng: random.Random, tool_lines: int, tool_turn_share: float) -> str:
    """A warm turn's message: at ``tool_turn_share``, a new tool output and a question; else a question."""
    if rng.random() < tool_turn_share:
        return "New tool output:\n" + tool_output(rng, tool_lines) + "\n" + rng.choice(_QUESTIONS)
    return rng.choice(_QUESTIONS)


def estimated_hit_rates(trace: list[TraceTurn]) -> list[float]:
    """Per request, the share of its context already sent by earlier turns (by characters;
    the model's answers, which the runner adds, only raise it)."""
    sent: dict[int, int] = {}
    rates = []
    for turn in trace:
        before = sent.get(turn.session, 0)
        sent[turn.session] = before + len(turn.content)
        rates.append(before / sent[turn.session])
    return rates


def save_trace(trace: list[TraceTurn], path: Path):
    """One JSON object per line."""
    path.write_text("".join(json.dumps(asdict(t)) + "\n" for t in trace))


def load_trace(path: Path) -> list[TraceTurn]:
    """Read a JSONL trace (``pdd bench trace --format jsonl``).

    Raises:
        ValueError: a line is not one of our trace's turns (an aiperf mooncake trace, say).
    """
    turns = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            turns.append(TraceTurn(**json.loads(line)))
        except (TypeError, json.JSONDecodeError) as exc:
            raise ValueError(
                f"{path}:{number} is not a turn of a pdd trace ({exc}); write one with "
                "`pdd bench trace --format jsonl` (the default format, mooncake, is aiperf's)"
            ) from None
    return turns
