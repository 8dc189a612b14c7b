"""The simulator's requests: from a ``pdd bench`` output folder (what was measured) or a preset.

A request is a session turn whose prompt extends what the session sent before. Its KV blocks
are named by ``block_ids`` (one int per full block): a turn reuses the leading ids of the
session's previous context (its prompt and, for whoever decoded it, its answer) and adds
fresh ids for the rest. Caches then hit exactly where the real system's chained hashes would.
"""

import functools
import itertools
import json
import random
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class SimRequest:
    """One request of a simulated workload.

    Attributes:
        session: Session number.
        turn: Turn within the session (turns run one after another, like the benchmark's client).
        kind: ``cold``, ``warm`` or ``odd`` (long input, tiny output).
        prompt_tokens: Tokens of the whole prompt.
        output_tokens: Tokens it generates.
        max_tokens: Its output bound (the odd-traffic filter reads it).
        block_ids: Names of the full blocks of prompt and answer together.
        start_s: When the session starts (open loop) or 0 (closed loop).
        think_s: Presets: how long before ``start_s`` its history reached the caches.
        history_blocks: Presets: leading blocks its session sent before (cached at the session's
            home instances ``think_s`` before it arrives, if the pools have room).
    """

    session: int
    turn: int
    kind: str
    prompt_tokens: int
    output_tokens: int
    max_tokens: int
    block_ids: tuple[int, ...] = field(repr=False)
    start_s: float = 0.0
    think_s: float = 0.0
    history_blocks: int = 0

    def prompt_blocks(self, block_size: int) -> tuple[int, ...]:
        """Ids of the prompt's full blocks."""
        return self.block_ids[: self.prompt_tokens // block_size]


@dataclass(frozen=True)
class Workload:
    """Requests and how they are sent.

    Attributes:
        requests: Every request, sessions' turns in order.
        concurrency: Closed loop: sessions at once, each turn after the previous answer (0: open
            loop, every request at its ``start_s``).
        name: Where it came from.
    """

    requests: list[SimRequest]
    concurrency: int
    name: str


class _BlockNames:
    """Fresh block ids."""

    def __init__(self):
        self._next = itertools.count(1)

    def chain(self, reused: tuple[int, ...], total_blocks: int) -> tuple[int, ...]:
        """``reused`` then fresh ids up to ``total_blocks``."""
        reused = reused[:total_blocks]
        return reused + tuple(next(self._next) for _ in range(total_blocks - len(reused)))


def from_records(
    records: list[dict], block_size: int, concurrency: int, name: str, shared: dict[int, tuple[int, ...]] | None = None
) -> Workload:
    """A measured run's requests (``records.json`` of one mode): its prompt and output lengths,
    each follow-up reusing the previous turn's prompt and answer (and a session's first prompt
    its ``shared`` leading blocks, see :func:`shared_first_blocks`)."""
    names, requests = _BlockNames(), []
    by_session: dict[int, list[dict]] = {}
    for record in records:
        by_session.setdefault(record["session"], []).append(record)
    for session, turns in sorted(by_session.items()):
        context: tuple[int, ...] = (shared or {}).get(session, ())
        for record in sorted(turns, key=lambda r: r["turn"]):
            prompt, output = record["prompt_tokens"], max(1, record["output_tokens"])
            max_tokens = 2 if record["kind"] == "odd" else max(output, record.get("max_tokens", output))
            ids = names.chain(context[: prompt // block_size], (prompt + output) // block_size)
            requests.append(SimRequest(session, record["turn"], record["kind"], prompt, output, max_tokens, ids))
            context = ids
    return Workload(requests, concurrency, name)


def load_bench_records(folder: Path, mode: str, block_size: int) -> list[Workload]:
    """One workload per repetition of ``mode`` in a ``pdd bench run`` folder."""
    records = json.loads((Path(folder) / "records.json").read_text())[mode]
    config = json.loads((Path(folder) / "results.json").read_text())["config"]
    shared = _run_shared_blocks(str(folder), config.get("model") or "smollm2", block_size)
    repetitions = sorted({r.get("repetition", 0) for r in records})
    return [
        from_records(
            [r for r in records if r.get("repetition", 0) == rep and not r.get("error")],
            block_size,
            config.get("concurrency", 2),
            f"{folder}:{mode}:{rep}",
            shared,
        )
        for rep in repetitions
    ]


@functools.lru_cache(maxsize=8)
def _run_shared_blocks(folder: str, model: str, block_size: int) -> dict[int, tuple[int, ...]]:
    """:func:`shared_first_blocks` of a bench run's trace (none without one)."""
    from loadtest.runner import SYSTEM
    from loadtest.trace import load_trace
    from shared.model_loader import load_metadata

    path = Path(folder) / "trace.jsonl"
    if not path.exists():
        return {}
    return shared_first_blocks(load_trace(path), load_metadata(model).tokenizer, block_size, system_prompt=SYSTEM)


def shared_first_blocks(trace: list, tokenizer, block_size: int, *, system_prompt: str) -> dict[int, tuple[int, ...]]:
    """Per session, ids of the leading full blocks of its first prompt that another session's
    first prompt starts with too (the chat template, the system prompt, a common opening), named
    by their tokens so that caches hit across sessions where the real chained block hashes do.
    The ids are negative (a workload's own are positive)."""
    prompts = {}
    for turn in sorted(trace, key=lambda t: (t.session, t.turn)):
        if turn.session not in prompts:
            text = tokenizer.apply_chat_template(
                [{"role": "system", "content": system_prompt}, {"role": "user", "content": turn.content}],
                add_generation_prompt=True,
                tokenize=False,
            )
            prompts[turn.session] = tokenizer.encode(text, add_special_tokens=False)

    def prefixes(tokens):
        return [tuple(tokens[: (j + 1) * block_size]) for j in range(len(tokens) // block_size)]

    seen: dict[tuple, int] = {}
    for tokens in prompts.values():
        for prefix in prefixes(tokens):
            seen[prefix] = seen.get(prefix, 0) + 1
    ids: dict[tuple, int] = {}
    shared = {}
    for session, tokens in prompts.items():
        chain = []
        for prefix in prefixes(tokens):
            if seen[prefix] < 2:
                break
            chain.append(-ids.setdefault(prefix, len(ids) + 1))
        shared[session] = tuple(chain)
    return shared


# ----- presets ---------------------------------------------------------------------------

HIT_BUCKETS = [
    ((0.0, 0.9), 0.12),
    ((0.9, 0.95), 0.13),
    ((0.95, 0.97), 0.15),
    ((0.97, 0.98), 0.15),
    ((0.98, 0.99), 0.15),
    ((0.99, 1.0), 0.30),
]
"""The agentic preset's prefix-hit distribution: seven-bucket shape of the paper's traffic
(0-90 % up to 99-100 %), 75 % of requests above 95 %, mean 0.91."""


@dataclass(frozen=True)
class Preset:
    """A synthetic workload's shape.

    Attributes:
        context_tokens: Mean prompt length (each request draws ±25 %).
        output_tokens: Mean output (each request draws ±25 %).
        hit_buckets: ``((low, high), share)`` of the prefix-hit rate.
        odd_share: Share of long-input, very-short-output requests (fresh prompt, 2-8 tokens).
        think_s: How long before a request its session's previous turn ended (when its
            history reaches the caches of the session's home instances).
    """

    context_tokens: int
    output_tokens: int
    hit_buckets: list
    odd_share: float
    think_s: float = 2.0


PRESETS = {
    "agentic": Preset(65536, 1024, HIT_BUCKETS, 0.035),
    "chat": Preset(4096, 256, [((0.0, 0.5), 0.4), ((0.5, 0.9), 0.4), ((0.9, 1.0), 0.2)], 0.0, think_s=10.0),
}


def draw_hit_rate(rng: random.Random, buckets: list) -> float:
    """A hit rate from the bucket distribution."""
    ((low, high),) = rng.choices([b for b, _ in buckets], weights=[w for _, w in buckets])
    return rng.uniform(low, high)


def synthetic(
    preset: Preset,
    *,
    rate_rps: float,
    num_requests: int,
    block_size: int,
    seed: int = 0,
    fixed_hit_rate: float | None = None,
    name: str = "",
) -> Workload:
    """Open-loop requests at Poisson times, ``rate_rps`` per second. Each is the next turn of its
    own session: the hit rate it draws (or ``fixed_hit_rate``) is the share of its prompt that
    the session sent before, and that history lands in the caches of the session's home
    instances ``think_s`` before the request (a warm cluster, without simulating every earlier
    turn); whether it is still cached when the request comes is up to the pools' capacity."""
    rng, names, requests, arrival = random.Random(seed), _BlockNames(), [], 0.0
    for index in range(num_requests):
        arrival += rng.expovariate(rate_rps)
        odd = rng.random() < preset.odd_share
        prompt = max(block_size, int(preset.context_tokens * rng.uniform(0.75, 1.25)))
        hit = 0.0 if odd else fixed_hit_rate if fixed_hit_rate is not None else draw_hit_rate(rng, preset.hit_buckets)
        output = rng.randint(2, 8) if odd else max(1, int(preset.output_tokens * rng.uniform(0.75, 1.25)))
        ids = names.chain((), (prompt + output) // block_size)
        requests.append(
            SimRequest(
                index,
                0,
                "odd" if odd else "warm",
                prompt,
                output,
                output if odd else output + 64,
                ids,
                arrival,
                preset.think_s,
                history_blocks=int(prompt * hit) // block_size,
            )
        )
    return Workload(requests, 0, name or f"synthetic rate={rate_rps}")


def from_trace(
    trace: list, tokenizer, block_size: int, *, concurrency: int, system_prompt: str, name: str = "trace"
) -> Workload:
    """A ``pdd bench`` trace (``loadtest.trace.TraceTurn``), in tokens as the benchmark's client
    sends it: each turn's prompt is the session's history so far under the chat template, and
    each answer is taken to use its whole ``max_tokens``. Open-loop traces keep their start times."""

    def template(messages) -> int:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return len(tokenizer.encode(text, add_special_tokens=False))

    probe = [{"role": "system", "content": system_prompt}]
    marker_tokens = template(probe + [{"role": "user", "content": ""}]) - template(probe)  # a message's role markers
    names, requests = _BlockNames(), []
    sessions: dict[int, list] = {}
    for turn in trace:
        sessions.setdefault(turn.session, []).append(turn)
    for session, turns in sorted(sessions.items()):
        context: tuple[int, ...] = ()
        prompt = 0
        for index, turn in enumerate(sorted(turns, key=lambda t: t.turn)):
            added = len(tokenizer.encode(turn.content, add_special_tokens=False)) + marker_tokens
            prompt = (
                template([{"role": "system", "content": system_prompt}, {"role": "user", "content": turn.content}])
                if index == 0
                else prompt + added
            )
            output = max(1, turn.max_tokens)
            ids = names.chain(context[: prompt // block_size], (prompt + output) // block_size)
            requests.append(
                SimRequest(session, turn.turn, turn.kind, prompt, output, turn.max_tokens, ids, turn.start_s)
            )
            context = ids
            prompt += output + marker_tokens
    return Workload(requests, concurrency, name)


def retimed(
    base: Workload,
    *,
    rate_rps: float,
    num_requests: int,
    block_size: int,
    seed: int = 0,
    fixed_hit_rate: float | None = None,
) -> Workload:
    """``base``'s sessions repeated (each copy its own conversation) until ``num_requests``, the
    sessions starting at Poisson times so that requests come at ``rate_rps``; turns follow
    answers. ``fixed_hit_rate`` does not apply to a trace (its prefixes are what they are)."""
    rng, names = random.Random(seed), _BlockNames()
    sessions: dict[int, list[SimRequest]] = {}
    for request in base.requests:
        sessions.setdefault(request.session, []).append(request)
    templates = [sorted(turns, key=lambda r: r.turn) for _, turns in sorted(sessions.items())]
    turns_per_session = len(base.requests) / len(templates)
    requests, start, copy = [], 0.0, 0
    while len(requests) < num_requests:
        turns = templates[copy % len(templates)]
        start += rng.expovariate(rate_rps / turns_per_session)
        renamed: dict[int, int] = {}
        for request in turns:
            ids = tuple(renamed.setdefault(b, next(names._next)) for b in request.block_ids)
            requests.append(
                SimRequest(
                    copy,
                    request.turn,
                    request.kind,
                    request.prompt_tokens,
                    request.output_tokens,
                    request.max_tokens,
                    ids,
                    start,
                )
            )
        copy += 1
    return Workload(requests[:num_requests], 0, f"{base.name} at {rate_rps} rps")
