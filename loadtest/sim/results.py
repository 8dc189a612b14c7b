"""What a simulation measured, in the benchmark's terms (``results.json``'s per-mode figures)."""

from dataclasses import dataclass, field

import numpy as np

from loadtest.bench import percentiles


@dataclass
class RequestResult:
    """One simulated request as its client would see it.

    Attributes:
        session: Session number.
        turn: Turn in the session.
        kind: ``cold``, ``warm`` or ``odd``.
        prompt_tokens: Prompt length.
        output_tokens: Tokens generated.
        pipeline: ``P-MD`` or ``P-RLD-MD``.
        ttft_s: Arrival to first token at the client.
        e2e_s: Arrival to last token.
        max_gap_s: Longest gap between two tokens.
        gaps: ``(gap_s, count)``: inter-token gaps and how many tokens had each.
        eager_tokens: Tokens the relay produced.
        wan_kv_bytes: KV bytes the request sent over the WAN (what its transfer carried).
        finished_on: ``MD`` or ``RLD``.
        handoff_mode: ``one-shot`` or ``catch-up`` when handed over.
        wan_cancelled: Its WAN transfer was cancelled (odd traffic).
        prefill_done_s: Arrival to the end of its prefill.
        arrival_s: Simulated arrival time.
        room_wait_s: Per path (``md``, ``relay``), how long its flow waited for room there.
        prefill_cached_tokens: Prompt tokens its prefill found cached (as the ``pdd`` field).
    """

    session: int
    turn: int
    kind: str
    prompt_tokens: int
    output_tokens: int
    pipeline: str = ""
    ttft_s: float | None = None
    e2e_s: float | None = None
    max_gap_s: float = 0.0
    gaps: list = field(default_factory=list)
    eager_tokens: int = 0
    wan_kv_bytes: int = 0
    finished_on: str = ""
    handoff_mode: str | None = None
    wan_cancelled: bool = False
    prefill_done_s: float = 0.0
    arrival_s: float = 0.0
    room_wait_s: dict = field(default_factory=dict)
    prefill_cached_tokens: int = 0

    def add_gap(self, gap_s: float, count: int):
        """``count`` tokens came ``gap_s`` after the one before each."""
        if count > 0:
            self.gaps.append((gap_s, count))
            self.max_gap_s = max(self.max_gap_s, gap_s)


def _percentiles(values, weights=None) -> dict:
    """``pdd bench``'s p50/p90/p99/mean in ms of ``values`` (seconds); with ``weights`` (a count
    per value, as inter-token gaps come), the weighted quantiles."""
    if weights is None or not len(values):
        return percentiles([v * 1000 for v in values])
    values = np.asarray(values, dtype=float) * 1000
    order = np.argsort(values)
    values, weights = values[order], np.asarray(weights, dtype=float)[order]
    cumulative = np.cumsum(weights) / weights.sum()
    at = {f"p{round(q * 100)}": round(float(np.interp(q, cumulative, values)), 1) for q in (0.5, 0.9, 0.99)}
    return at | {"mean": round(float((values * weights).sum() / weights.sum()), 1)}


@dataclass
class SimResult:
    """Every finished request of a run, and the run's totals.

    Attributes:
        requests: Finished requests.
        wan_bytes: Bytes the WAN pipe carried (cancelled transfers count what they sent).
        deployment: What ran.
        duration_s: Simulated time at the end.
        busy_s: Per instance, seconds it spent computing.
    """

    requests: list[RequestResult]
    wan_bytes: int
    deployment: object
    duration_s: float
    busy_s: dict

    def summary(self, ttft_slo_s: float, itl_slo_s: float, window_s: float | None = None) -> dict:
        """The benchmark's per-mode figures (``pdd bench``'s ``summarise``), predicted.

        ``window_s`` divides goodput (default: first arrival to last answer)."""
        done = [r for r in self.requests if r.ttft_s is not None]
        good = [r for r in done if r.ttft_s <= ttft_slo_s and r.max_gap_s <= itl_slo_s]
        if window_s is None:
            window_s = max((r.arrival_s + r.e2e_s for r in done), default=0.0) - min(
                (r.arrival_s for r in done), default=0.0
            )
        output = sum(r.output_tokens for r in done)
        pipelines: dict[str, int] = {}
        for r in done:
            pipelines[r.pipeline] = pipelines.get(r.pipeline, 0) + 1
        return {
            "requests": len(done),
            "ttft_ms": _percentiles([r.ttft_s for r in done]),
            "itl_ms": _percentiles([g for r in done for g, _ in r.gaps], [n for r in done for _, n in r.gaps]),
            "goodput_rps": round(len(good) / window_s, 3) if window_s else 0.0,
            "sla_attainment": round(len(good) / len(done), 4) if done else 0.0,
            "wan_kv_bytes": self.wan_bytes,
            "rld_token_share": round(sum(r.eager_tokens for r in done) / output, 4) if output else 0.0,
            "pipelines": pipelines,
            "finished_on": {k: sum(1 for r in done if r.finished_on == k) for k in ("MD", "RLD")},
            "wall_s": round(window_s, 1),
        }
