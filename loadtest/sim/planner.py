"""Sizing: the cheapest instance counts of a design that meet an SLA at a rate, found by
simulation.

A first guess comes from the cost model alone (prefill seconds and decode slots per request);
then the simulator decides. While the SLA is missed, the busiest service grows; once it is
met, every service shrinks one instance at a time while the SLA still holds. The answer is a
local minimum: one instance fewer of any kind misses the SLA (checked by the same simulator,
same seed, so every comparison sees the same requests).
"""

import math
from collections.abc import Callable
from dataclasses import dataclass

from loadtest.sim.cluster import Counts, Evaluation, Setting, Sla, WorkloadSource, build, evaluate

ROLES = ("prefill", "relay_decode", "main_decode")
MAX_EVALUATIONS = 40
LINK_BOUND_UTILISATION = 0.7
MAX_INSTANCES = 160
"""A line busier than this (averaged over the whole run, drain included) is the bottleneck: more
instances only queue more bytes on it."""
PREFILL_UTILISATION = 0.6
"""The first guess keeps prefill busy this share of the time (queueing stays short of the TTFT bound)."""
DECODE_UTILISATION = 0.8
"""The first guess fills this share of the decoders' slots."""


@dataclass
class Plan:
    """A sized design.

    Attributes:
        evaluation: The chosen counts' simulation.
        fewer: For each service, the simulation with one instance fewer (None: at its minimum).
        evaluations: Simulations the search ran.
    """

    evaluation: Evaluation
    fewer: dict
    evaluations: int

    @property
    def feasible(self) -> bool:
        """Whether the counts found meet the SLA."""
        return self.evaluation.meets_sla

    @property
    def counts(self) -> Counts:
        """The chosen counts."""
        return self.evaluation.counts


def _minimum(design: str, role: str) -> int:
    if role == "relay_decode":
        return 1 if design == "pdd" else 0
    return 1


def _reused_blocks(request, previous: tuple[int, ...]) -> int:
    if request.history_blocks:
        return request.history_blocks
    count = 0
    for mine, theirs in zip(request.block_ids, previous):
        if mine != theirs:
            break
        count += 1
    return count


def first_guess(
    design: str,
    setting: Setting,
    source: WorkloadSource,
    rate_rps: float,
    *,
    utilisation: float = PREFILL_UTILISATION,
    num_requests: int = 200,
) -> Counts:
    """Counts from the cost model alone: prefill busy ``utilisation`` of the time, decoders
    holding as many requests as their pools fit."""
    deployment = build(design, Counts(1, 1, 1), setting)
    workload = source(
        rate_rps=rate_rps, num_requests=num_requests, block_size=setting.block_size, seed=0, fixed_hit_rate=None
    )
    cost = deployment.prefill.cost
    prefill_s, previous = 0.0, {}
    for request in workload.requests:
        cached = min(
            _reused_blocks(request, previous.get(request.session, ())) * setting.block_size, request.prompt_tokens - 1
        )
        previous[request.session] = request.block_ids
        for start in range(cached, request.prompt_tokens, setting.max_batch_tokens):
            prefill_s += cost.step_s([(min(setting.max_batch_tokens, request.prompt_tokens - start), start)])
    prefill = math.ceil(rate_rps * prefill_s / len(workload.requests) / utilisation)
    mean_blocks = sum(len(r.block_ids) + 1 for r in workload.requests) / len(workload.requests)
    main = deployment.main_decode
    batch = max(1, int(main.pool_blocks / mean_blocks))
    mean_context = sum(r.prompt_tokens for r in workload.requests) / len(workload.requests)
    step_s = main.cost.step_s([], batch, int(batch * mean_context))
    mean_output = sum(r.output_tokens for r in workload.requests) / len(workload.requests)
    decoders = math.ceil(rate_rps * mean_output * step_s / batch / DECODE_UTILISATION)
    return Counts(max(1, prefill), _minimum(design, "relay_decode") + (1 if design == "pdd" else 0), max(1, decoders))


def size(
    design: str,
    setting: Setting,
    source: WorkloadSource,
    rate_rps: float,
    sla: Sla,
    *,
    num_requests: int = 600,
    seed: int = 0,
    start: Counts | None = None,
    fixed_hit_rate: float | None = None,
) -> Plan:
    """The cheapest counts found (see the module's docstring)."""
    runs = {}

    def run(counts: Counts) -> Evaluation:
        if counts not in runs:
            runs[counts] = evaluate(
                design,
                counts,
                setting,
                source,
                rate_rps,
                sla,
                num_requests=num_requests,
                seed=seed,
                fixed_hit_rate=fixed_hit_rate,
            )
        return runs[counts]

    counts = start or first_guess(design, setting, source, rate_rps)
    current = run(counts)
    while not current.meets_sla and len(runs) < MAX_EVALUATIONS:
        role = _grow(design, current, sla)
        if role is None or counts.prefill + counts.relay_decode + counts.main_decode >= MAX_INSTANCES:
            break  # the time goes on the link (no instance count fixes it), or past what we try
        step = max(1, getattr(counts, role) // 8)
        counts = counts.bump(role, step)
        current = run(counts)
    while current.meets_sla and len(runs) < MAX_EVALUATIONS:
        smaller = _first_smaller(design, counts, current, run)
        if smaller is None:
            break
        counts, current = smaller.counts, smaller
    return Plan(current, _one_fewer_each(design, counts, run), len(runs))


def _first_smaller(
    design: str, counts: Counts, current: Evaluation, run: Callable[[Counts], Evaluation]
) -> Evaluation | None:
    """The first of ``counts`` less one instance of a service (least busy service first) that
    still meets the SLA; None when none does."""
    for role in sorted(ROLES, key=lambda r: -current.busy_share.get(r, 0.0))[::-1]:
        if getattr(counts, role) <= _minimum(design, role):
            continue
        trial = run(counts.bump(role, -1))
        if trial.meets_sla:
            return trial
    return None


def _one_fewer_each(design: str, counts: Counts, run: Callable[[Counts], Evaluation]) -> dict:
    """For each of the design's services, the simulation with one instance fewer (None: at its minimum)."""
    return {
        role: (run(counts.bump(role, -1)) if getattr(counts, role) > _minimum(design, role) else None)
        for role in ROLES
        if design == "pdd" or role != "relay_decode"
    }


def _grow(design: str, evaluation: Evaluation, sla: Sla) -> str | None:
    """Which service to add to, from where the slowest requests' time went; None when it went
    on the link (more instances would not help)."""
    busy = {role: share for role, share in evaluation.busy_share.items() if design == "pdd" or role != "relay_decode"}
    decoders = {role: share for role, share in busy.items() if role != "prefill"}
    if evaluation.link_utilisation >= LINK_BOUND_UTILISATION:
        return None
    if evaluation.summary["itl_quantile_s"] > sla.itl_s:
        return max(decoders, key=decoders.get)
    waits = evaluation.slow_waits
    if not waits:
        return "main_decode"
    if waits["prefill_s"] >= 0.5 * waits["ttft_s"]:
        return "prefill"
    if waits["main_decode_room_s"] >= max(waits["relay_room_s"], 0.2 * waits["ttft_s"]):
        return "main_decode"
    if design == "pdd" and waits["relay_room_s"] >= 0.2 * waits["ttft_s"]:
        return "relay_decode"
    if waits["prefill_s"] >= 0.25 * waits["ttft_s"]:
        return "prefill"
    return None


def _row(evaluation: Evaluation) -> dict:
    summary = evaluation.summary
    return {
        "prefill": evaluation.counts.prefill,
        "relay_decode": evaluation.counts.relay_decode,
        "main_decode": evaluation.counts.main_decode,
        "cost": round(evaluation.cost, 3),
        "meets_sla": evaluation.meets_sla,
        "ttft_q_ms": round(summary["ttft_quantile_s"] * 1000, 1),
        "itl_q_ms": round(summary["itl_quantile_s"] * 1000, 1),
    }


def frontier(
    setting: Setting, source: WorkloadSource, rate_rps: float, sla: Sla, plan: Plan, *, num_requests: int, seed: int = 0
) -> list[dict]:
    """The cost/latency frontier around the plan: counts from one fewer to two more of each
    service, each simulated; the rows no cheaper row beats on TTFT."""
    base = plan.counts
    rows = []
    for dp in (-1, 0, 1, 2):
        for dr in (-1, 0, 1):
            for dm in (-1, 0, 1, 2):
                counts = Counts(base.prefill + dp, base.relay_decode + dr, base.main_decode + dm)
                if min(counts.prefill, counts.relay_decode, counts.main_decode) < 1:
                    continue
                rows.append(
                    _row(evaluate("pdd", counts, setting, source, rate_rps, sla, num_requests=num_requests, seed=seed))
                )
    rows.sort(key=lambda r: (r["cost"], r["ttft_q_ms"]))
    front, best = [], float("inf")
    for row in rows:
        if row["ttft_q_ms"] < 0.99 * best:  # a dearer row must be faster by more than noise
            front.append(row)
            best = row["ttft_q_ms"]
    return front


def plan_report(
    setting: Setting,
    source: WorkloadSource,
    rate_rps: float,
    sla: Sla,
    *,
    num_requests: int,
    with_frontier: bool = False,
    seed: int = 0,
) -> dict:
    """``pdd plan``'s answer (its ``--json`` keys first)."""
    plan = size("pdd", setting, source, rate_rps, sla, num_requests=num_requests, seed=seed)
    evaluation = plan.evaluation
    report = {
        "prefill": plan.counts.prefill,
        "relay_decode": plan.counts.relay_decode,
        "main_decode": plan.counts.main_decode,
        "link_utilisation": round(evaluation.link_utilisation, 3),
        "rld_token_share": evaluation.summary["rld_token_share"],
        "meets_sla": plan.feasible,
        "cost": round(evaluation.cost, 3),
        "rate_rps": rate_rps,
        "sla": {"ttft_s": sla.ttft_s, "itl_s": sla.itl_s, "quantile": sla.quantile},
        "ttft_q_ms": round(evaluation.summary["ttft_quantile_s"] * 1000, 1),
        "itl_q_ms": round(evaluation.summary["itl_quantile_s"] * 1000, 1),
        "one_fewer_meets_sla": {role: (None if e is None else e.meets_sla) for role, e in plan.fewer.items()},
        "bottleneck": evaluation.bottleneck,
        "busy_share": evaluation.busy_share,
        "chips": {"a": setting.chip_a, "b": setting.chip_b},
        "model": setting.model,
        "evaluations": plan.evaluations,
    }
    if with_frontier:
        report["frontier"] = frontier(setting, source, rate_rps, sla, plan, num_requests=num_requests, seed=seed)
    return report


def render_plan(report: dict) -> str:
    """The plan as a user reads it."""
    q = f"p{report['sla']['quantile'] * 100:g}"
    verdict = "meets" if report["meets_sla"] else "does NOT meet"
    lines = [
        (
            f"PDD for {report['rate_rps']} rps on {report['chips']['a']} (prefill, relay) + "
            f"{report['chips']['b']} (main decode), {report['model']}:"
        ),
        (
            f"  prefill {report['prefill']}, relay_decode {report['relay_decode']}, "
            f"main_decode {report['main_decode']}  (cost {report['cost']} in chip-A units)"
        ),
        (
            f"  {verdict} the SLA: TTFT {q} {report['ttft_q_ms'] / 1000:.2f} s (bound {report['sla']['ttft_s']} s), "
            f"ITL {q} {report['itl_q_ms']:.0f} ms (bound {report['sla']['itl_s'] * 1000:.0f} ms)"
        ),
        (
            f"  link utilisation {report['link_utilisation']:.0%}, relay token share {report['rld_token_share']:.3f}, "
            f"busiest: {report['bottleneck']}"
        ),
        "  one instance fewer meets the SLA: "
        + ", ".join(
            f"{role} {'yes' if ok else 'no' if ok is not None else '(at its minimum)'}"
            for role, ok in report["one_fewer_meets_sla"].items()
        ),
        f"  {report['evaluations']} simulations, {report.get('duration_s', 0)} s",
    ]
    if "frontier" in report:
        lines += ["", f"cost/latency frontier (TTFT {q}):", "  cost   P  RLD  MD   TTFT     ITL   SLA"]
        for row in report["frontier"]:
            lines.append(
                f"  {row['cost']:5.1f} {row['prefill']:3} {row['relay_decode']:4} {row['main_decode']:3} "
                f"{row['ttft_q_ms'] / 1000:6.2f}s {row['itl_q_ms']:5.0f}ms {'met' if row['meets_sla'] else '-'}"
            )
    return "\n".join(lines)
