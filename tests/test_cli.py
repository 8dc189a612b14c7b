"""The ``pdd`` console script as a user runs it: a real subprocess."""

import json
import subprocess
import sys
from pathlib import Path

from tests.helpers import reference_greedy

PDD = [str(Path(sys.executable).parent / "pdd")]


def run_pdd(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(PDD + list(args), capture_output=True, text=True, timeout=240)


def test_generate_prints_the_greedy_answer(tiny):
    result = run_pdd("generate", "Tell me about the sea.", "--model", "tiny", "--max-tokens", "12")
    assert result.returncode == 0, result.stderr
    prompt = list(
        tiny.tokenizer.apply_chat_template(
            [{"role": "user", "content": "Tell me about the sea."}],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
        )
    )
    expected = tiny.tokenizer.decode(reference_greedy(tiny, prompt, 12), skip_special_tokens=True)
    assert result.stdout.rstrip("\n") == expected
    stats = json.loads(result.stderr.strip().splitlines()[-1])
    assert stats["prompt_tokens"] == len(prompt) and stats["output_tokens"] == 12


def test_generate_reports_bad_model_clearly():
    result = run_pdd("generate", "hi", "--model", "/no/such/model")
    assert result.returncode == 2
    assert "not 'smollm2', 'tiny' or an HF folder" in result.stderr


def test_generate_rejects_bad_sampling():
    result = run_pdd("generate", "hi", "--model", "tiny", "--max-tokens", "0")
    assert result.returncode == 2
    assert "max_tokens must be >= 1" in result.stderr


def test_bench_engine_quick_prints_every_figure():
    result = run_pdd("bench", "engine", "--quick", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)["hf"]
    assert set(report["prefill_tok_s"]) == {"256", "1024"}
    assert set(report["decode_ms_per_step"]) == {"batch_1", "batch_4", "batch_8", "batch_16"}
    assert set(report["extend_cost_in_decode_steps"]) == {"16", "64", "100"}
    figures = ("decode_b1_ms", "decode_b4_ms", "decode_b8_ms", "decode_b16_ms", "extend_16_ms", "extend_64_ms")
    assert all(report[name] > 0 for name in (*figures, "extend_100_ms", "prefill_256_tok_s", "prefill_1k_tok_s"))
    assert report["kv_transfer"]["export_gb_s"] > 0 and report["kv_transfer"]["import_gb_s"] > 0
    assert report["decode_throughput_ratio_batch4_vs_batch1"] > 0
    # The floors are this machine's, measured in the run, and every figure has its fraction.
    assert report["machine_limits"]["peak_gflop_s"] > 0 and report["machine_limits"]["read_gb_s"] > 0
    assert all(report["limit_fraction"][name] > 0 for name in figures)


def test_bench_handoff_reports_both_modes():
    result = run_pdd("bench", "handoff", "--model", "tiny", "--context", "128")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    for mode in ("one_shot", "catch_up"):
        assert report[mode]["worst_gap_ms"] > 0 and report[mode]["stall_vs_baseline"] > 0
    assert report["handoff_tokens"] == 100 and report["catch_up_chunk_tokens"] == 32


def test_bench_handoff_micro_compares_ids_with_kv():
    result = run_pdd(
        "bench",
        "handoff-micro",
        "--model",
        "tiny",
        "--trials",
        "3",
        "--context",
        "128",
        "--rtt",
        "4ms",
        "--jitter",
        "1ms",
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    ids, kv = report["token_ids"], report["incremental_kv"]
    assert ids["payload_bytes"] < 1536 < kv["payload_bytes"]
    assert report["payload_ratio"] == round(kv["payload_bytes"] / ids["payload_bytes"], 1)
    assert ids["latency_ms"]["max"] >= ids["latency_ms"]["mean"] > 0
    for row in (ids, kv):  # each latency splits into the receiver's compute and the link
        parts = row["receiver_compute_ms"]["mean"] + row["link_ms"]["mean"]
        assert abs(parts - row["latency_ms"]["mean"]) <= 0.2
        assert row["link_ms"]["mean"] >= 4  # at least the link's round trip


def test_version_names_the_installed_package():
    import subprocess
    import sys
    from importlib.metadata import version

    result = subprocess.run([sys.executable, "-m", "infra.cli", "--version"], capture_output=True, text=True)
    assert result.returncode == 0 and result.stdout.strip() == f"pdd {version('pdd')}"


def _parsers(parser, path="pdd"):
    import argparse

    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _parsers(sub, f"{path} {name}")


def test_every_flag_of_every_command_has_help_and_states_its_default():
    import argparse

    from infra.cli import build_parser

    missing, parsers = [], list(_parsers(build_parser()))
    assert len(parsers) > 20
    for path, parser in parsers:
        for action in parser._actions:
            if isinstance(action, (argparse._HelpAction, argparse._VersionAction, argparse._SubParsersAction)):
                continue
            if not action.help:
                missing.append(f"{path} {'/'.join(action.option_strings) or action.dest}")
    assert not missing, missing
    up_help = dict(parsers)["pdd up"].format_help()
    assert "(default: 8000)" in up_help and "(default: smollm2)" in up_help


LOADTEST_COMMANDS = {"bench", "chaos", "demo", "compose-demo", "profile", "sim", "plan"}
"""The commands ``loadtest`` registers under the ``pdd.commands`` entry points (pyproject.toml)."""


def test_help_lists_the_commands_loadtest_registers():
    result = run_pdd("--help")
    assert result.returncode == 0, result.stderr
    listed = set(result.stdout.split("{", 1)[1].split("}", 1)[0].split(","))
    assert LOADTEST_COMMANDS <= listed, sorted(LOADTEST_COMMANDS - listed)
    assert {"up", "down", "status", "serve", "wan", "generate"} <= listed


def test_every_command_names_its_handler():
    import argparse

    from infra.cli import build_parser

    leaves = [
        (path, parser)
        for path, parser in _parsers(build_parser())
        if not any(isinstance(a, argparse._SubParsersAction) for a in parser._actions)
    ]
    assert len(leaves) > 25
    assert [path for path, parser in leaves if not callable(parser.get_default("handler"))] == []


def test_every_flag_of_pdd_up_is_a_field_of_the_spec_with_its_default():
    from dataclasses import fields

    from infra.cli import build_parser
    from infra.deployment_spec import DeploymentSpec

    parser = build_parser()
    up = dict(_parsers(parser))["pdd up"]
    dests = {a.dest for a in up._actions if a.option_strings and a.dest not in ("help", "detach")}
    assert dests == {f.name for f in fields(DeploymentSpec)} - {"progress"}
    assert DeploymentSpec.from_args(parser.parse_args(["up"])) == DeploymentSpec()
    given = parser.parse_args(["up", "--md", "2", "--timeout", "60", "--service-log-level", "debug", "--insecure"])
    spec = DeploymentSpec.from_args(given)
    assert (spec.md, spec.timeout_s, spec.service_log_level, spec.insecure) == (2, 60.0, "debug", True)


def test_the_recorded_spec_reads_back_and_so_do_older_up_options(tmp_path):
    from dataclasses import replace

    from infra.deployment_spec import DeploymentSpec
    from infra.launcher import load_state

    spec = replace(DeploymentSpec(), run_dir=str(tmp_path), md=2, md_site="site-a", timeout_s=60.0, api_key="k")
    assert DeploymentSpec.from_dict(json.loads(json.dumps(spec.to_dict()))) == spec
    # state.json as pdd up wrote it before the spec: its argparse options, under up_args
    older = {"command": "up", "detach": True, "md": 2, "md_site": "site-a", "log_level": "debug", "timeout": 60.0}
    state = {"run_dir": str(tmp_path), "router_url": "", "wan_control_url": "", "up_args": older}
    (tmp_path / "state.json").write_text(json.dumps(state))
    recorded = load_state(tmp_path).spec
    assert recorded == replace(DeploymentSpec(), md=2, md_site="site-a", service_log_level="debug", timeout_s=60.0)
