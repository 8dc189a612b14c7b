"""``pdd sim paper``: the paper's setting at cluster scale, four designs side by side.

64K-token agent contexts with the skewed prefix-hit distribution (mean ≈ 0.9, three quarters of
requests above 95 %), outputs of about 1K tokens, 3.5 % long-input/short-output requests, on
public chip specifications (``chips.json``) through the roofline. Each design is sized by the
planner for the same rate and SLA; the figures printed beside the paper's are ours, measured
on the simulation, never fitted to theirs. ``bathtub.png`` plots BCR against the hit rate.
"""

import json
import time
from dataclasses import replace
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from loadtest.sim import bathtub
from loadtest.sim.cluster import DESIGNS, Setting, Sla, instance_chips, preset, preset_source
from loadtest.sim.planner import Plan, size

PAPER = {
    "same_dc_chips_a": 88,
    "pdd_chips_a": 43,
    "pdd_chips_b": 32,
    "cost_change_at_premium": {"0.2": -0.071, "0.3": -0.035},
    "ttft_change_vs_cross_dc_pd": -0.515,
    "goodput_change": 0.278,
    "bcr_change_up_to": 0.375,
    "rld_token_share": 0.062,
    "bathtub_dips_at_hit_rate": [0.2, 0.4, 0.7],
    "source": "the PDD technical report (Infinigence-AI, 2026), as summarised in the project brief",
}
PREMIUMS = (0.2, 0.3)
BATHTUB_MODELS = ("llama-3.1-8b-fp8kv", "llama-3.1-70b-fp8", "deepseek-v3")
PAPER_CLASS_MODEL = "deepseek-v3"
"""The model class the paper's own figures point to (docs/planning.md): its bathtub is the one
``paper.json`` reports."""


def _chips(plan: Plan, design: str, setting: Setting) -> tuple[int, int]:
    """Chips A and B the plan's instances take."""
    counts, per_a = plan.counts, instance_chips(setting, setting.chip_a)
    instances_a = counts.prefill + (counts.relay_decode if design == "pdd" else 0)
    if design == "same-dc-pd":
        return (instances_a + counts.main_decode) * per_a, 0
    return instances_a * per_a, counts.main_decode * instance_chips(setting, setting.chip_b)


def _cost(plan: Plan, design: str, premium: float, setting: Setting) -> float:
    """In GPU-A units, GPU-B at ``premium`` over GPU-A."""
    chips_a, chips_b = _chips(plan, design, setting)
    return chips_a + chips_b * (1.0 + premium)


def design_figures(plans: dict[str, Plan], setting: Setting) -> dict:
    """``paper.json``'s ``designs``."""
    base = {p: _cost(plans["same-dc-pd"], "same-dc-pd", p, setting) for p in PREMIUMS}
    out = {}
    for design, plan in plans.items():
        summary = plan.evaluation.summary
        chips_a, chips_b = _chips(plan, design, setting)
        cost = _cost(plan, design, PREMIUMS[0], setting)
        out[design] = {
            "chips_a": chips_a,
            "chips_b": chips_b,
            "prefill": plan.counts.prefill,
            "relay_decode": plan.counts.relay_decode if design == "pdd" else 0,
            "main_decode": plan.counts.main_decode,
            "meets_sla": plan.feasible,
            "cost_rel_same_dc": {str(p): round(_cost(plan, design, p, setting) / base[p], 4) for p in PREMIUMS},
            "ttft_p50_ms": summary["ttft_ms"]["p50"],
            "ttft_p99_ms": summary["ttft_ms"]["p99"],
            "ttft_mean_ms": summary["ttft_ms"]["mean"],
            "goodput_rps": summary["goodput_rps"],
            "bcr": round(summary["goodput_rps"] / cost, 5) if cost else 0.0,
            "rld_token_share": summary["rld_token_share"],
            "link_utilisation": round(plan.evaluation.link_utilisation, 3),
            "evaluations": plan.evaluations,
        }
    return out


def plot_designs(designs: dict, path: Path):
    """Cost (20 % premium) and TTFT p99 per design."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.6))
    names = list(designs)
    left.bar(names, [designs[n]["cost_rel_same_dc"]["0.2"] for n in names])
    left.set_ylabel("cost / same-DC PD (B at +20 %)")
    right.bar(names, [designs[n]["ttft_p99_ms"] / 1000 for n in names])
    right.set_ylabel("TTFT p99 (s)")
    for ax in (left, right):
        ax.tick_params(axis="x", rotation=20)
        ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def bathtub_figures(setting: Setting, sla: Sla, rate_rps: float, num_requests: int, seed: int, png: Path) -> dict:
    """``paper.json``'s bathtub keys, and the plot: the cost-model curve of every model in
    ``BATHTUB_MODELS`` (``bathtub`` is the paper-class model's), the design model re-sized by the
    simulator, and the tail chunk's price on an engine that prefills one request at a time."""
    by_model = {name: bathtub.cost_model_bathtub(replace(setting, model=name)) for name in BATHTUB_MODELS}
    simulated = bathtub.simulated_bathtub(setting, sla, rate_rps, num_requests, seed)
    paper_class = replace(setting, model=PAPER_CLASS_MODEL)
    penalty = bathtub.tail_chunk_penalty(paper_class)
    bathtub.plot(by_model, simulated, setting.model, penalty, PAPER_CLASS_MODEL, png)
    return {
        "bathtub": by_model[PAPER_CLASS_MODEL],
        "bathtub_model": PAPER_CLASS_MODEL,
        "bathtub_valley": {name: bathtub.has_valley(points) for name, points in by_model.items()},
        "decode_share_of_cold_prefill": {
            name: round(bathtub.decode_share_of_cold_prefill(replace(setting, model=name)), 4)
            for name in BATHTUB_MODELS
        },
        "bathtub_by_model": by_model,
        "bathtub_simulated": {"model": setting.model, "points": simulated},
        "tail_chunk": {
            "model": PAPER_CLASS_MODEL,
            "max_batch_tokens": setting.max_batch_tokens,
            "worst_cost_ratio": max(p["cost_ratio"] for p in penalty),
            "dips_at_hit_rate": bathtub.dips(penalty, 1.005),
            "cost_ratio": penalty[::4],
        },
    }


def run_paper(
    out: Path,
    *,
    rate_rps: float,
    num_requests: int,
    sla: Sla,
    setting: Setting | None = None,
    seed: int = 0,
    bathtub_requests: int | None = None,
) -> dict:
    """Size the four designs, run the bathtub, write ``paper.json`` and the PNGs."""
    started = time.perf_counter()
    setting = setting or Setting()
    out.mkdir(parents=True, exist_ok=True)
    source = preset_source(preset("agentic"))
    plans = {
        design: size(design, setting, source, rate_rps, sla, num_requests=num_requests, seed=seed) for design in DESIGNS
    }
    designs = design_figures(plans, setting)
    report = {
        "designs": designs,
        **bathtub_figures(setting, sla, rate_rps, bathtub_requests or num_requests // 2, seed, out / "bathtub.png"),
        "paper": PAPER,
        "setting": {
            "chip_a": setting.chip_a,
            "chip_b": setting.chip_b,
            "model": setting.model,
            "chips_per_instance": {
                "a": instance_chips(setting, setting.chip_a),
                "b": instance_chips(setting, setting.chip_b),
            },
            "link_gbit": setting.link.bandwidth_bps / 1e9,
            "link_rtt_ms": setting.link.rtt_s * 1000,
            "rate_rps": rate_rps,
            "requests": num_requests,
            "sla": sla.__dict__,
            "hit_price": bathtub.HIT_PRICE,
            "output_price": bathtub.OUTPUT_PRICE,
            "cache_tier_gb": setting.cache_tier_bytes / 1e9,
        },
        "duration_s": 0.0,
    }
    plot_designs(designs, out / "designs.png")
    report["duration_s"] = round(time.perf_counter() - started, 1)
    (out / "paper.json").write_text(json.dumps(report, indent=2) + "\n")
    return report


def render(report: dict) -> str:
    """The designs beside the paper's figures."""
    return "\n".join(_design_table(report["designs"]) + _beside_the_paper(report))


def _design_table(designs: dict) -> list[str]:
    """One line per design: chips, relative costs, TTFT, goodput, BCR, relay share, link, SLA."""
    lines = [
        (
            f"{'design':<16} {'chips A':>7} {'chips B':>7} {'cost@20%':>8} {'cost@30%':>8} {'TTFT p50':>9} "
            f"{'TTFT p99':>9} {'goodput':>8} {'BCR':>8} {'RLD share':>9} {'link':>5} SLA"
        )
    ]
    for name, f in designs.items():
        lines.append(
            f"{name:<16} {f['chips_a']:>7} {f['chips_b']:>7} {f['cost_rel_same_dc']['0.2']:>8.3f} "
            f"{f['cost_rel_same_dc']['0.3']:>8.3f} {f['ttft_p50_ms']:>9,.0f} {f['ttft_p99_ms']:>9,.0f} "
            f"{f['goodput_rps']:>8.2f} {f['bcr']:>8.4f} {f['rld_token_share']:>9.3f} "
            f"{f['link_utilisation']:>5.2f} {'met' if f['meets_sla'] else 'MISSED'}"
        )
    return lines


def _beside_the_paper(report: dict) -> list[str]:
    """Our figures with the paper's beside them, after a blank line."""
    d, paper = report["designs"], report["paper"]
    pdd, same, cross = d["pdd"], d["same-dc-pd"], d["cross-dc-pd"]
    return [
        "",
        "ours vs the paper's:",
        (
            f"  cost of PDD / same-DC PD: {pdd['cost_rel_same_dc']['0.2'] - 1:+.1%} at +20 %, "
            f"{pdd['cost_rel_same_dc']['0.3'] - 1:+.1%} at +30 % (paper: -7.1 % / -3.5 %)"
        ),
        (
            f"  chips: same-DC {same['chips_a']} A; PDD {pdd['chips_a']} A + {pdd['chips_b']} B "
            f"(paper: 88 A; 43 A + 32 B)"
        ),
        (
            f"  TTFT p50 PDD / cross-DC PD: {_change(pdd['ttft_p50_ms'], cross['ttft_p50_ms'])}, "
            f"mean {_change(pdd['ttft_mean_ms'], cross['ttft_mean_ms'])} (paper: -51.5 %)"
        ),
        f"  BCR PDD / same-DC PD: {_change(pdd['bcr'], same['bcr'])} (paper: up to +37.5 %)",
        f"  relay token share: {pdd['rld_token_share']:.3f} (paper: 0.062)",
        f"  bathtub, {report['bathtub_model']} (hit rate: BCR): "
        + ", ".join(f"{p['hit_rate']:g}: {p['bcr']:.2f}" for p in report["bathtub"][::20]),
        "  a valley (BCR lower mid-way than at both ends): "
        + ", ".join(
            f"{name} {'yes' if valley else 'no'} (decode {report['decode_share_of_cold_prefill'][name]:.0%} "
            f"of a cold prefill)"
            for name, valley in report["bathtub_valley"].items()
        ),
        f"  simulated, {report['bathtub_simulated']['model']} re-sized: "
        + ", ".join(f"{p['hit_rate']:g}: {p['bcr']:.2f}" for p in report["bathtub_simulated"]["points"]),
        (
            f"  tail chunks, one request per step: at most {report['tail_chunk']['worst_cost_ratio'] - 1:+.1%} "
            f"cost, dips at {report['tail_chunk']['dips_at_hit_rate']} (paper: dips at 0.2, 0.4, 0.7)"
        ),
        f"{report['duration_s']} s; paper figures from {paper['source']}",
    ]


def _change(value, base) -> str:
    return "–" if not base or value is None else f"{value / base - 1:+.1%}"
