"""The paper's "bathtub": benefit/cost (BCR) against the prefix-hit rate under cache-hit pricing.

A request pays for its prompt at the full price on missed tokens and at ``HIT_PRICE`` on hit
ones, and for its output at ``OUTPUT_PRICE``. Hits also cut the prefill's work, but not in
proportion: the tokens still computed attend over the whole cached context, so a prefill's
cost falls slowly at first and fast near the top. Revenue falls linearly. BCR therefore dips
in the middle when decode is a small part of a request's cost, and falls all the way when it
is not (the model's KV read per decoded token against its prefill FLOPs decides).

Two ways to draw it:

- :func:`cost_model_bathtub`: a request's chip-seconds from the cost model alone, each
  service loaded as the planner's first guess loads it (``PREFILL_UTILISATION``,
  ``DECODE_UTILISATION``). Smooth, so a fine grid of hit rates shows the tail-chunk dips of an
  engine that prefills one request at a time (``max_prefill_requests=1``): a prompt whose
  missed part is just over a multiple of the chunk budget runs one more, nearly empty, step
  that still reads every weight.
- :func:`simulated_bathtub`: the deployment re-sized by the simulator at each hit rate, BCR
  the revenue of its SLA goodput per unit of cost. It checks the first against the real
  policies, at the price of whole instances (a small cluster moves in steps).
"""

from dataclasses import replace

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from loadtest.sim.cluster import Counts, Setting, Sla, build, instance_chips, preset, preset_source
from loadtest.sim.planner import DECODE_UTILISATION, PREFILL_UTILISATION, size

HIT_PRICE = 0.1
"""Hit tokens are billed at 10 % of a miss (the paper's 10-25 %, low end)."""
OUTPUT_PRICE = 4.0
"""An output token is billed like four input tokens (an assumption; common list prices)."""
SIMULATED_HIT_RATES = (0.0, 0.2, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99)
FINE_HIT_RATES = tuple(i / 200 for i in range(199))
"""0 to 0.99 in steps of 0.005: fine enough to see a dip one chunk of 8,192 tokens wide
(0.125 of a 64K prompt) and its edges."""
PAPER_DIPS = (0.2, 0.4, 0.7)
"""Where the paper's BCR curve dips."""
DESIGN = "same-dc-pd"
"""The bathtub is prefix caching's economics under hit pricing, so it is drawn without a WAN
(at low hit rates every design that ships KV across the line is bound by the line instead)."""


def revenue_per_request(prompt_tokens: float, output_tokens: float, hit_rate: float) -> float:
    """What a request pays, in input-token units, under cache-hit pricing."""
    return prompt_tokens * ((1 - hit_rate) + hit_rate * HIT_PRICE) + output_tokens * OUTPUT_PRICE


def prefill_seconds(cost, new_tokens: int, cached_tokens: int) -> float:
    """Engine seconds a prompt's missed part costs, chunk by chunk. A chunk that fills a step
    pays the whole step. A smaller one (the tail) pays its step too when the engine runs one
    request's chunks alone (``max_prefill_requests == 1``); when the engine fills the step with
    other requests' chunks, it shares the step's fixed part (weights read, launch: a one-token
    step's time) in proportion to its tokens."""
    budget, seconds, done = cost.max_batch_tokens, 0.0, 0
    while done < new_tokens:
        take = min(budget, new_tokens - done)
        context = cached_tokens + done
        seconds += cost.step_s([(take, context)])
        if cost.max_prefill_requests != 1:
            seconds -= cost.step_s([(1, context)]) * (1 - take / budget)
        done += take
    return seconds


class _RequestCost:
    """A same-datacenter request's cost in chip-A units: its prefill's share of a prefill instance
    and its decode's share of a full decoder, each at the load the planner's first guess aims at
    (the deployment built once, called per request shape)."""

    def __init__(self, setting: Setting):
        deployment = build(DESIGN, Counts(1, 0, 1), setting)
        self.prefill, self.decode = deployment.prefill, deployment.main_decode

    def __call__(self, hit_rate: float, prompt_tokens: int, output_tokens: int) -> float:
        cached = min(int(prompt_tokens * hit_rate), prompt_tokens - 1)
        prefill_s = prefill_seconds(self.prefill.cost, prompt_tokens - cached, cached)
        batch = self.decode.max_sequences
        step_s = self.decode.cost.step_s([], batch, int(batch * (prompt_tokens + output_tokens / 2)))
        decode_s = step_s * output_tokens / batch
        return self.prefill.price * prefill_s / PREFILL_UTILISATION + self.decode.price * decode_s / DECODE_UTILISATION


def cost_model_bathtub(
    setting: Setting, prompt_tokens: int = 65536, output_tokens: int = 1024, hit_rates=FINE_HIT_RATES
) -> list[dict]:
    """BCR (best = 1) at each hit rate, from the cost model."""
    cost = _RequestCost(setting)
    points = [
        {
            "hit_rate": hit,
            "bcr": revenue_per_request(prompt_tokens, output_tokens, hit) / cost(hit, prompt_tokens, output_tokens),
        }
        for hit in hit_rates
    ]
    return _normalised(points)


def decode_share_of_cold_prefill(setting: Setting, prompt_tokens: int = 65536, output_tokens: int = 1024) -> float:
    """A request's decode cost over a cold prefill's, as :class:`_RequestCost` counts them."""
    cost = _RequestCost(setting)
    no_decode = cost(0.0, prompt_tokens, 0)
    return (cost(0.0, prompt_tokens, output_tokens) - no_decode) / no_decode


def simulated_bathtub(setting: Setting, sla: Sla, rate_rps: float, num_requests: int, seed: int) -> list[dict]:
    """BCR against the prefix-hit rate: at each rate every warm request hits that share, the
    deployment is re-sized for it, and BCR is the revenue of its SLA goodput per unit of cost."""
    workload = preset("agentic")
    points, start = [], None
    for hit in SIMULATED_HIT_RATES:
        plan = size(
            DESIGN,
            setting,
            preset_source(workload),
            rate_rps,
            sla,
            num_requests=num_requests,
            seed=seed,
            start=start,
            fixed_hit_rate=hit,
        )
        start = plan.counts
        revenue = plan.evaluation.summary["goodput_rps"] * revenue_per_request(
            workload.context_tokens, workload.output_tokens, hit
        )
        chips = (plan.counts.prefill + plan.counts.main_decode) * instance_chips(setting, setting.chip_a)
        points.append(
            {
                "hit_rate": hit,
                "bcr": revenue / chips,
                "prefill": plan.counts.prefill,
                "main_decode": plan.counts.main_decode,
                "meets_sla": plan.feasible,
            }
        )
    return _normalised(points)


def has_valley(points: list[dict], middle=(0.3, 0.7)) -> bool:
    """Whether BCR somewhere in ``middle`` is below both ends of the curve."""
    inside = [p["bcr"] for p in points if middle[0] <= p["hit_rate"] <= middle[1]]
    return bool(inside) and min(inside) < min(points[0]["bcr"], points[-1]["bcr"])


def tail_chunk_penalty(
    setting: Setting, prompt_tokens: int = 65536, output_tokens: int = 1024, hit_rates=FINE_HIT_RATES
) -> list[dict]:
    """At each hit rate, how much dearer a request is on an engine that prefills one request at a
    time than on one that batches chunks across requests (1.0: no dearer)."""
    batched = _RequestCost(replace(setting, max_prefill_requests=0))
    alone = _RequestCost(replace(setting, max_prefill_requests=1))
    return [
        {
            "hit_rate": hit,
            "cost_ratio": round(
                alone(hit, prompt_tokens, output_tokens) / batched(hit, prompt_tokens, output_tokens), 5
            ),
        }
        for hit in hit_rates
    ]


def dips(penalty: list[dict], threshold: float = 1.01) -> list[float]:
    """Hit rates where the one-at-a-time engine pays more than ``threshold`` times the batched one,
    each run of them reported once (at its worst)."""
    found, run = [], []
    for point in penalty + [{"hit_rate": None, "cost_ratio": 1.0}]:
        if point["cost_ratio"] > threshold:
            run.append((point["cost_ratio"], point["hit_rate"]))
        elif run:
            found.append(max(run)[1])
            run = []
    return found


def _normalised(points: list[dict]) -> list[dict]:
    top = max(p["bcr"] for p in points) or 1.0
    return [{**p, "bcr": round(p["bcr"] / top, 4)} for p in points]


def plot(by_model: dict, simulated: list[dict], simulated_model: str, penalty: list[dict], penalty_model: str, path):
    """Left: BCR against hits per model (cost model) and the simulator's re-sized points. Right:
    what prefilling one request at a time costs over batching chunks (the tail-chunk dips)."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.2))
    for name, points in by_model.items():
        left.plot([p["hit_rate"] for p in points], [p["bcr"] for p in points], label=name)
    if simulated:
        left.plot(
            [p["hit_rate"] for p in simulated],
            [p["bcr"] for p in simulated],
            "o",
            color="black",
            label=f"{simulated_model}, re-sized by the simulator",
        )
    left.set_ylabel("BCR (revenue per cost, each curve's best = 1)")
    left.set_title("BCR against prefix hits, same-DC PD")
    right.plot([p["hit_rate"] for p in penalty], [p["cost_ratio"] for p in penalty])
    for x in PAPER_DIPS:
        right.axvline(x, color="grey", ls=":", lw=1)
    right.set_ylabel("cost, one request per step / batched")
    right.set_title(f"{penalty_model}: the tail chunk's price (dotted: the paper's dips)")
    for ax in (left, right):
        ax.set_xlabel("prefix-hit rate of every request")
        ax.grid(alpha=0.3)
    left.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
