"""``pdd sim validate DIR``: replay a ``pdd bench run``'s own requests through the simulator and
compare its predictions with what the run measured, mode by mode.

The simulated deployment is the benchmark's: one prefill, one relay and one main decoder, the
run's link and KV pool, every engine on this machine's cores (``host_cores``), timed by this
machine's profile (``pdd profile``). Each repetition's requests (their measured prompt and
output lengths, sessions in order, the run's concurrency) are replayed separately and pooled
as the benchmark pools them.
"""

import json
import os
from pathlib import Path

from loadtest.bench import MODES
from loadtest.sim.cost_model import LinearCostModel, load_linear
from loadtest.sim.deployment import Deployment, RolePool
from loadtest.sim.network import LinkSpec
from loadtest.sim.results import SimResult
from loadtest.sim.simulator import Simulator
from loadtest.sim.workload import load_bench_records
from infra.wan_link import parse_profile

BLOCK_SIZE = 16
TARGETS = {"ttft_p50_ms": ("rel", 0.25), "ttft_p90_ms": ("rel", 0.25), "wan_kv_bytes": ("rel", 0.05),
           "rld_token_share": ("abs", 0.05)}
"""What validation must meet (the issue's point 3); the other metrics are reported, not judged."""


def socket_buffer_bytes() -> int:
    """What a sender can have handed to TCP and not yet through the WAN link on this machine:
    its send buffer and the link's receive buffer at their autotuned maximum (Linux sysctls)."""
    total = 0
    for name in ("tcp_wmem", "tcp_rmem"):
        try:
            total += int(Path(f"/proc/sys/net/ipv4/{name}").read_text().split()[-1])
        except (OSError, ValueError, IndexError):
            return 0
    return total


def bench_deployment(config: dict, mode: str, cost: LinearCostModel, host_cores: int,
                     host_speed: dict | None = None, local_bytes_per_s: float | None = None) -> Deployment:
    """The deployment ``pdd bench run`` started for ``mode`` (``local_bytes_per_s``: the
    profile's measured local path; None: the simulator's default)."""
    link = parse_profile(config["bandwidth"], config["rtt"], config["jitter"], config.get("seed", 0))
    pool_blocks = config["kv_cache_mb"] * (1 << 20) // (BLOCK_SIZE * cost.kv_bytes_per_token)
    spec = MODES[mode]
    role = RolePool(1, cost, pool_blocks)
    wan = LinkSpec(link.bandwidth_bps, link.rtt_ms / 1000, link.jitter_ms / 1000, socket_buffer_bytes())
    return Deployment(role, role, role, wan,
                      BLOCK_SIZE, cost.kv_bytes_per_token, md_site=spec["md_site"],
                      pipeline_policy=spec["pipeline_policy"], md_prefix_cache=spec["md_prefix_cache"],
                      host_cores=host_cores, host_speed=host_speed, engine_thread_io=True, initial_wan_bps=link.bandwidth_bps,
                      initial_wan_rtt_s=link.rtt_ms / 1000,
                      local_bytes_per_s=local_bytes_per_s or Deployment.local_bytes_per_s)


def predict_mode(folder: Path, config: dict, mode: str, cost: LinearCostModel, host_cores: int,
                 host_speed: dict | None = None, local_bytes_per_s: float | None = None) -> dict:
    """The mode's predicted figures, pooled over its repetitions."""
    results: list[SimResult] = []
    for index, workload in enumerate(load_bench_records(folder, mode, BLOCK_SIZE)):
        deployment = bench_deployment(config, mode, cost, host_cores, host_speed, local_bytes_per_s)
        simulator = Simulator(deployment, seed=config.get("seed", 0) + index)
        results.append(simulator.run(workload))
    requests = [r for result in results for r in result.requests]
    pooled = SimResult(requests, sum(r.wan_bytes for r in results) // max(1, len(results)), None,
                       0.0, {})
    window = sum(r.summary(1, 1)["wall_s"] for r in results)
    return pooled.summary(config["ttft_slo_ms"] / 1000, config["itl_slo_ms"] / 1000, window_s=window)


def _pair(predicted, measured) -> dict:
    rel = None if not measured or predicted is None else round(predicted / measured - 1, 4)
    return {"predicted": predicted, "measured": measured, "rel_error": rel,
            "abs_error": None if predicted is None or measured is None else round(predicted - measured, 4)}


def compare(predicted: dict, measured: dict) -> dict:
    """The issue's metrics, predicted beside measured."""
    out = {f"ttft_{q}_ms": _pair(predicted["ttft_ms"][q], measured["ttft_ms"][q]) for q in ("p50", "p90", "p99")}
    link = measured.get("wan_link_kv_bytes")
    out["wan_kv_bytes"] = _pair(predicted["wan_kv_bytes"], link if link is not None else measured["wan_kv_bytes"])
    out["rld_token_share"] = _pair(predicted["rld_token_share"], measured["rld_token_share"])
    out["goodput_rps"] = _pair(predicted["goodput_rps"], measured["goodput_rps"])
    for metric, (kind, bound) in TARGETS.items():
        pair = out[metric]
        if pair["measured"] == 0 and pair["predicted"] == 0:
            pair["within_target"] = True
        elif kind == "rel":
            pair["within_target"] = pair["rel_error"] is not None and abs(pair["rel_error"]) <= bound
        else:
            pair["within_target"] = pair["abs_error"] is not None and abs(pair["abs_error"]) <= bound
    return out


def validate(folder: Path, profile_path: Path, host_cores: int | None = None) -> dict:
    """Every mode of the run in ``folder``: ``{"modes": {mode: {metric: {...}}}}``."""
    folder = Path(folder)
    results = json.loads((folder / "results.json").read_text())
    config = results["config"]
    profile = json.loads(Path(profile_path).read_text())
    cost = load_linear(profile_path)
    cores = host_cores or profile.get("host_cores") or os.cpu_count()
    local_bytes_per_s = (profile.get("local_path") or {}).get("bytes_per_s")
    modes = {}
    for mode, measured in results["modes"].items():
        if mode not in MODES:
            continue
        modes[mode] = compare(predict_mode(folder, config, mode, cost, cores, profile.get("shared_host_speed"),
                                           local_bytes_per_s), measured)
    return {"modes": modes, "profile": str(profile_path), "run": str(folder), "host_cores": cores}


def render(report: dict) -> str:
    """The comparison as a table."""
    lines = [f"run {report['run']}, profile {report['profile']}, {report['host_cores']} cores", "",
             f"{'mode':<18} {'metric':<16} {'predicted':>14} {'measured':>14} {'error':>9}  target"]
    for mode, metrics in report["modes"].items():
        for metric, pair in metrics.items():
            error = "" if pair["rel_error"] is None else f"{pair['rel_error'] * 100:+.0f}%"
            if metric == "rld_token_share" and pair["abs_error"] is not None:
                error = f"{pair['abs_error']:+.3f}"
            verdict = {True: "met", False: "MISSED"}.get(pair.get("within_target"), "")
            lines.append(f"{mode:<18} {metric:<16} {_fmt(pair['predicted']):>14} {_fmt(pair['measured']):>14} "
                         f"{error:>9}  {verdict}")
    return "\n".join(lines)


def _fmt(value) -> str:
    if value is None:
        return "–"
    return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.3f}"
