"""``pdd plan`` and the cluster-scale designs: sizing by simulation on public chip specifications."""

import itertools
import json
import subprocess
import sys
from pathlib import Path

import pytest

from loadtest.sim import bathtub
from loadtest.sim.cluster import Counts, Setting, Sla, build, evaluate, instance_chips, preset_source
from loadtest.sim.commands import PlanInputError, parse_link, parse_sla
from loadtest.sim.cost_model import chip, model
from loadtest.sim.simulator import Simulator
from loadtest.sim.workload import PRESETS, synthetic

PDD = str(Path(sys.executable).parent / "pdd")


def test_roofline_prefill_is_compute_bound_and_decode_memory_bound():
    setting = Setting()
    prefill = build("pdd", Counts(1, 1, 1), setting).prefill.cost
    spec, llama = chip("H100-SXM"), model("llama-3.1-8b-fp8kv")
    flops = 2 * llama.params * 8192 + 4 * llama.num_layers * llama.attention_dim * 8192 * (8192 / 2)
    assert prefill.step_s([(8192, 0)]) == pytest.approx(flops / (spec.peak_flops * 0.5) + 0.003)
    decode = build("pdd", Counts(1, 1, 1), setting).main_decode.cost
    h200 = chip("H200-SXM")
    moved = llama.weight_bytes + llama.kv_bytes_per_token * (16 * 65536 + 16)
    assert decode.step_s([], 16, 16 * 65536) == pytest.approx(moved / (h200.hbm_bytes_per_s * 0.7) + 0.003)
    # the H200's larger memory holds about twice the 64K-token requests an H100 does
    assert decode.kv_capacity_tokens > 1.9 * prefill.kv_capacity_tokens


def test_the_agentic_preset_has_the_papers_skewed_hits():
    workload = synthetic(PRESETS["agentic"], rate_rps=5, num_requests=2000, block_size=256)
    warm = [r for r in workload.requests if r.kind != "odd"]
    hits = [r.history_blocks * 256 / r.prompt_tokens for r in warm]
    assert 0.85 <= sum(hits) / len(hits) <= 0.95
    assert 0.65 <= sum(h > 0.95 for h in hits) / len(hits) <= 0.85
    assert 0.025 <= sum(r.kind == "odd" for r in workload.requests) / len(workload.requests) <= 0.05
    assert 60_000 <= sum(r.prompt_tokens for r in warm) / len(warm) <= 70_000


def test_more_main_decoders_do_not_make_an_overloaded_cluster_worse():
    setting, source, sla = Setting(link=parse_link("25gbit,20ms")), preset_source(PRESETS["agentic"]), Sla()
    small = evaluate("pdd", Counts(3, 1, 2), setting, source, 3.0, sla, num_requests=240)
    large = evaluate("pdd", Counts(3, 1, 8), setting, source, 3.0, sla, num_requests=240)
    assert large.summary["ttft_quantile_s"] <= small.summary["ttft_quantile_s"]
    assert large.busy_share["main_decode"] < small.busy_share["main_decode"]


def test_plan_sizes_a_preset_and_one_instance_fewer_of_the_bottleneck_misses_the_sla():
    result = subprocess.run(
        [PDD, "plan", "--workload", "agentic", "--link", "25gbit,20ms", "--json"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    plan = json.loads(result.stdout)
    assert {"prefill", "relay_decode", "main_decode", "link_utilisation", "rld_token_share", "meets_sla"} <= set(plan)
    assert plan["meets_sla"] is True
    assert plan["ttft_q_ms"] <= 10_000 and plan["itl_q_ms"] <= 100
    assert 0 < plan["link_utilisation"] < 1 and 0 <= plan["rld_token_share"] <= 0.1
    # the search stops where removing any instance breaks the SLA
    assert all(ok is False for ok in plan["one_fewer_meets_sla"].values() if ok is not None)


@pytest.mark.parametrize(
    "args, named",
    [
        (["--link", "25gbit"], "--link"),
        (["--sla", "latency=3s"], "--sla"),
        (["--sla", "ttft_p99=fast"], "fast"),
        (["--chips", "H100-SXM,TPU9"], "TPU9"),
        (["--workload", "no-such-file.jsonl"], "--workload"),
    ],
)
def test_plan_rejects_bad_input_naming_the_setting(args, named):
    argv = {"--workload": "agentic"}
    argv.update(dict(zip(args[::2], args[1::2])))
    result = subprocess.run(
        [PDD, "plan", *[x for kv in argv.items() for x in kv]], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 2 and named in result.stderr


def test_sla_and_link_spellings():
    sla = parse_sla("ttft_p90=2s,itl_p90=50ms")
    assert (sla.ttft_s, sla.itl_s, sla.quantile) == (2.0, 0.05, 0.9)
    link = parse_link("10gbit,30ms,3ms")
    assert (link.bandwidth_bps, link.rtt_s, link.jitter_s) == (10e9, 0.03, 0.003)
    with pytest.raises(PlanInputError, match="same percentile"):
        parse_sla("ttft_p99=2s,itl_p90=50ms")


def test_an_instance_spans_the_chips_its_model_needs_and_reads_only_the_experts_its_tokens_pick():
    deepseek = Setting(model="deepseek-v3")
    # 671 GB of fp8 weights: two 8-GPU H100 nodes, one H200 node; an 8B model, one chip
    assert instance_chips(deepseek, "H100-SXM") == 16 and instance_chips(deepseek, "H200-SXM") == 8
    assert instance_chips(Setting(), "H100-SXM") == 1
    pool = build("same-dc-pd", Counts(1, 0, 1), deepseek).prefill
    assert pool.chips == 16 and pool.price == 16 * chip("H100-SXM").price
    assert pool.max_sequences >= 8
    spec = model("deepseek-v3")
    dense = spec.weight_bytes - spec.expert_weight_bytes
    assert spec.weight_bytes_read(1) == pytest.approx(dense + spec.expert_weight_bytes * 8 / 256)
    assert spec.weight_bytes_read(4096) == pytest.approx(spec.weight_bytes, rel=1e-6)
    # a decode step attends over the latent in its absorbed form (4 x 69,632 FLOPs per pair and
    # layer, against a prompt chunk's 4 x 20,480), over 16 chips' compute and bandwidth
    h100, batch, context = chip("H100-SXM"), 64, 65536
    flops = 2 * spec.params * batch + 4 * spec.num_layers * 69632 * batch * context
    moved = spec.weight_bytes_read(batch) + spec.kv_bytes_per_token * (batch * context + batch)
    expected = max(flops / (16 * h100.peak_flops * 0.5), moved / (16 * h100.hbm_bytes_per_s * 0.7)) + 0.003
    assert pool.cost.step_s([], batch, batch * context) == pytest.approx(expected)


def test_warm_64k_conversations_are_prefilled_where_their_prefix_is_cached():
    """The router's prefill placement at cluster scale: with blocks held as its load, half of
    these requests left the prefill that cached them to recompute 64K tokens elsewhere."""
    setting = Setting(link=parse_link("25gbit,20ms"))
    deployment = build("same-dc-pd", Counts(6, 0, 6), setting)
    workload = synthetic(PRESETS["agentic"], rate_rps=3, num_requests=150, block_size=256, fixed_hit_rate=0.98)
    result = Simulator(deployment).run(workload)
    warm = [r for r in result.requests if r.kind == "warm"]
    hit = sum(r.prefill_cached_tokens for r in warm) / sum(r.prompt_tokens for r in warm)
    assert len(warm) > 100 and hit > 0.9


def test_the_bathtub_has_its_valley_where_decode_is_cheap_beside_a_cold_prefill():
    deepseek, llama = Setting(model="deepseek-v3"), Setting(model="llama-3.1-8b-fp8kv")
    # the MLA/MoE model: BCR lower mid-way than at both ends
    curve = bathtub.cost_model_bathtub(deepseek)
    assert bathtub.has_valley(curve)
    assert bathtub.decode_share_of_cold_prefill(deepseek) < 0.15
    # the 8B dense model's decode reads 64 KiB per context token: BCR only falls
    flat = bathtub.cost_model_bathtub(llama)
    assert not bathtub.has_valley(flat)
    assert all(a["bcr"] >= b["bcr"] for a, b in itertools.pairwise(flat))


def test_an_engine_that_prefills_one_request_at_a_time_pays_for_small_tail_chunks():
    setting = Setting(model="deepseek-v3")
    budget, prompt = setting.max_batch_tokens, 65536
    # hit rates leaving k full chunks, and k full chunks plus a 256-token tail
    exact = [(prompt - k * budget) / prompt for k in (1, 3, 6)]
    with_tail = [(prompt - k * budget - 256) / prompt for k in (1, 3, 6)]
    penalty = {
        p["hit_rate"]: p["cost_ratio"] for p in bathtub.tail_chunk_penalty(setting, prompt, 1024, exact + with_tail)
    }
    assert all(penalty[h] == pytest.approx(1.0, abs=1e-4) for h in exact)
    assert all(penalty[h] > 1.001 for h in with_tail)
    assert bathtub.dips(
        [
            {"hit_rate": 0.1, "cost_ratio": 1.0},
            {"hit_rate": 0.2, "cost_ratio": 1.02},
            {"hit_rate": 0.3, "cost_ratio": 1.03},
            {"hit_rate": 0.4, "cost_ratio": 1.0},
        ]
    ) == [0.3]
