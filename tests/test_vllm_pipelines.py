"""``pdd up --engine vllm`` as a user runs it: vLLM behind prefill, relay and main decode in
separate processes, and the mixed deployments (prefill on vLLM with our decoders, and the
reverse). The official openai client gets transformers' greedy answers on both pipelines, with
eager tokens, a handoff and decode-side cache hits in the ``pdd`` fields; a long prompt's KV
leaves a vLLM prefill chunk by chunk while the prompt computes (the engines' call log shows
it); ``pdd down`` leaves no process behind.

Runs in the vLLM venv (``make test-vllm``); ``make test`` deselects it.
"""

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from openai import OpenAI

from infra import wan_control
from infra.launcher import load_state, process_alive
from infra.nats_server import free_port
from loadtest.demo_conversation import long_tool_output
from shared.kv_layout import KvLayout
from tests.helpers import reference_chat_answer

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]  # several vLLM engines and transformers references on 2 cores
PDD = str(Path(sys.executable).parent / "pdd")
BLOCK_SIZE = 32
DEPLOYMENTS = {
    "all-vllm": ["--engine", "vllm"],
    "prefill-vllm": ["--prefill-engine", "vllm"],
    "decoders-vllm": ["--relay-engine", "vllm", "--main-engine", "vllm"],
}
CATCH_UP = {"decoders-vllm": "8"}
"""Deployments whose relay hands over in catch-up chunks (a backlog above 8 tokens), so main
decode on vLLM absorbs chunks before the final handoff; the others hand over as they choose."""
BANDWIDTH = {"decoders-vllm": "40mbit"}
"""The link of each deployment (100mbit unless named). The catch-up deployment's is slower: KV
ships while the prompt computes, so at 100 Mbit/s the cold turn's 62 MB landed 0.3 s after the
relay's first token (5 tokens decoded, below the threshold); at 40 Mbit/s they take ~12 s."""


def link_bps(name: str) -> float:
    """The link rate deployment ``name`` was started with, in bit/s."""
    return float(BANDWIDTH.get(name, "100mbit").removesuffix("mbit")) * 1e6


def believed_link_mbit(deployment: "Deployment") -> float:
    """The router's estimate of the WAN link's rate (its health endpoint)."""
    url = str(deployment.client.base_url).rstrip("/").removesuffix("/v1") + "/health"
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.load(response)["wan_estimate"]["bandwidth_mbit"]


@dataclass
class Deployment:
    name: str
    run_dir: Path
    client: OpenAI
    catch_up: bool


@pytest.fixture(params=list(DEPLOYMENTS), scope="module")
def deployment(request, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp(request.param)
    http_port = free_port()
    env = {**os.environ, "PDD_ENGINE_CALL_LOG": str(run_dir / "engine-calls.jsonl")}
    if request.param in CATCH_UP:  # the services read their settings from PDD_* variables
        env["PDD_CATCH_UP_THRESHOLD_TOKENS"] = CATCH_UP[request.param]
    # A slow link: the cold turn's KV takes seconds to cross, so the relay has tokens to hand
    # over; slow enough for that, fast enough that a fast relay has not finished the answer by then.
    up = subprocess.run(
        [
            PDD,
            "up",
            "--detach",
            "--run-dir",
            str(run_dir),
            "--http-port",
            str(http_port),
            "--nats-a-port",
            str(free_port()),
            "--nats-b-port",
            str(free_port()),
            "--wan-control-port",
            str(free_port()),
            "--bandwidth",
            BANDWIDTH.get(request.param, "100mbit"),
            "--kv-cache-mb",
            "512",
            "--timeout",
            "600",
            *DEPLOYMENTS[request.param],
        ],
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
    )
    assert up.returncode == 0, up.stderr[-3000:] + up.stdout[-2000:]
    pids = dict(load_state(run_dir).processes)
    client = OpenAI(base_url=f"http://127.0.0.1:{http_port}/v1", api_key="none", max_retries=0, timeout=600)
    yield Deployment(request.param, run_dir, client, request.param in CATCH_UP)
    down = subprocess.run([PDD, "down", "--run-dir", str(run_dir)], capture_output=True, text=True, timeout=300)
    assert down.returncode == 0, down.stderr
    assert load_state(run_dir) is None
    assert [name for name, pid in pids.items() if process_alive(pid)] == []


def test_both_pipelines_are_exact_with_a_handoff_and_decode_side_cache_hits(deployment, smollm2):
    client = deployment.client
    model = client.models.list().data[0].id
    messages = [
        {"role": "system", "content": "You are a careful coding agent. Answer in detail."},
        {
            "role": "user",
            "content": "Tool output:\n" + long_tool_output(30) + "\nExplain what the project does, file by file.",
        },
    ]
    # The link crawls while the relay starts decoding and opens up once it has streamed 24
    # tokens, so the KV lands while the relay still decodes (EOS ignored) with a backlog past
    # the catch-up threshold, on a slow machine or a fast one. (At a fixed 40 Mbit/s a fast
    # relay finished the answer before the KV had crossed.) 200 Mbit/s, not more: the router
    # learns the link's rate from this flow, and the later tests' long prompts must still be
    # predicted to cross too slowly for P-MD.
    state = load_state(deployment.run_dir)
    wan_control.call(state.wan_control_url, {"bandwidth_bps": 10e6}, state.control_key())
    try:
        stream = client.chat.completions.create(
            model=model,
            messages=messages,
            max_tokens=320,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        text, pdd = [], None
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                text.append(chunk.choices[0].delta.content)
                if len(text) == 24:
                    wan_control.call(state.wan_control_url, {"bandwidth_bps": 200e6}, state.control_key())
            pdd = (chunk.model_extra or {}).get("pdd", pdd)
    finally:
        wan_control.call(state.wan_control_url, {"bandwidth_bps": link_bps(deployment.name)}, state.control_key())
    expected, prompt_len = reference_chat_answer(smollm2, messages, 320, ignore_eos=True)
    assert "".join(text) == expected
    cold_pdd = pdd
    assert pdd["pipeline"] == "P-RLD-MD" and pdd["eager_tokens"] >= 1, pdd
    assert pdd["handoff_mode"] in ("one-shot", "catch-up") and pdd["finished_on"] == "MD", pdd
    if deployment.catch_up:
        assert pdd["handoff_mode"] == "catch-up" and pdd["handoff_chunks"] >= 2, pdd

    messages += [
        {"role": "assistant", "content": "".join(text)},
        {"role": "user", "content": "Name one risk of that design."},
    ]
    warm = client.chat.completions.create(model=model, messages=messages, max_tokens=32, temperature=0)
    expected, _ = reference_chat_answer(smollm2, messages, 32)
    assert warm.choices[0].message.content == expected
    pdd = warm.model_extra["pdd"]
    assert pdd["pipeline"] == "P-MD" and pdd["cached_blocks_md"] >= prompt_len // BLOCK_SIZE - 1, pdd
    assert pdd["wan_kv_bytes"] < 0.2 * cold_pdd["wan_kv_bytes"], pdd


def test_a_relay_on_vllm_killed_mid_stream_hands_the_stream_to_main_decode_on_vllm(deployment, smollm2):
    if deployment.name != "decoders-vllm":
        pytest.skip("killed once, in the deployment whose relay and main decode both run vLLM")
    client = deployment.client
    model = client.models.list().data[0].id
    messages = [
        {
            "role": "user",
            "content": "Service log:\n" + long_tool_output(32) + "\nWrite a long essay about what this project does.",
        }
    ]
    # A cold prompt: the first test's "Tool output:" turns left their blocks at main decode, and a
    # prompt that began the same way would miss only its last lines, which can be predicted to
    # cross within the target (then nothing is relayed). KV ships while the prompt computes, so at 100 Mbit/s it lands soon after the prefill and
    # the relay hands over within a few tokens; at 30 Mbit/s it still crosses (~10 s) when the
    # relay, streaming eager tokens, is killed.
    state = load_state(deployment.run_dir)
    wan_control.call(state.wan_control_url, {"bandwidth_bps": 30e6}, state.control_key())
    try:
        # The router must believe the slower link before the request is placed: believing the
        # first test's 200 Mbit/s, a slow prefill on a loaded machine can hide the whole
        # crossing in the prediction and send the request P→MD. One cold prompt teaches it, if
        # its transfer completes: with room for 64 tokens it is not odd traffic (with 1, a router
        # believing ~100 Mbit/s took it for odd and cancelled the transfer it was to learn from).
        teach = [{"role": "user", "content": "Build output:\n" + long_tool_output(8) + "\nOne word: ok?"}]
        client.chat.completions.create(model=model, messages=teach, max_tokens=64, temperature=0)
        deadline_s = time.monotonic() + 120
        while believed_link_mbit(deployment) > 60:
            assert time.monotonic() < deadline_s, "the router did not learn the slower link"
            time.sleep(0.1)
        stream = client.chat.completions.create(
            model=model, messages=messages, max_tokens=200, temperature=0, stream=True, extra_body={"ignore_eos": True}
        )
        text, pdd, killed = [], None, False
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                text.append(chunk.choices[0].delta.content)
            pdd = (chunk.model_extra or {}).get("pdd", pdd)
            if len(text) == 12 and not killed:  # the relay is streaming eager tokens
                os.kill(state.processes["relay-decode-0"], signal.SIGKILL)
                killed = True
    finally:
        wan_control.call(state.wan_control_url, {"bandwidth_bps": link_bps(deployment.name)}, state.control_key())
    assert "".join(text) == reference_chat_answer(smollm2, messages, 200, ignore_eos=True)[0]
    assert killed and pdd["finished_on"] == "MD", pdd
    assert [(r["from"], r["to"]) for r in pdd["recoveries"]] == [("relay-decode-0", "main-decode-0")], pdd


def test_a_long_prompt_with_a_short_answer_finishes_on_the_relay_with_its_wan_transfer_cancelled(deployment, smollm2):
    if deployment.name != "all-vllm":
        pytest.skip("the odd-traffic filter once, in the deployment where every engine runs vLLM")
    client = deployment.client
    messages = [{"role": "user", "content": "Tool output:\n" + long_tool_output(34) + "\nOne word: done?"}]
    reply = client.chat.completions.create(
        model=client.models.list().data[0].id, messages=messages, max_tokens=4, temperature=0
    )
    expected, prompt_len = reference_chat_answer(smollm2, messages, 4)
    assert reply.choices[0].message.content == expected
    pdd = reply.model_extra["pdd"]
    assert pdd["odd_traffic"] is True and pdd["pipeline"] == "P-RLD-MD" and pdd["finished_on"] == "RLD", pdd
    assert pdd["wan_kv_bytes"] < 0.5 * prompt_len * KvLayout.from_model(smollm2.model).kv_bytes_per_token, pdd


def test_a_long_prompt_on_a_vllm_prefill_ships_kv_to_main_decode_while_it_computes(deployment, smollm2):
    if deployment.name != "prefill-vllm":
        pytest.skip("once, in the deployment with prefill on vLLM and our decoders")
    client = deployment.client
    messages = [  # shares no block with the other tests' prompts (no prefix cache hit)
        {"role": "system", "content": "You review build logs line by line."},
        {"role": "user", "content": "Build log:\n" + long_tool_output(40) + "\nWhich steps were checked last?"},
    ]
    since_s = time.time()
    reply = client.chat.completions.create(
        model=client.models.list().data[0].id,
        messages=messages,
        max_tokens=48,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    expected, prompt_len = reference_chat_answer(smollm2, messages, 48, ignore_eos=True)
    assert reply.choices[0].message.content == expected
    assert prompt_len > 4 * 256  # prefill computes it in chunks of --max-batch-tokens (256)
    calls = [c for c in engine_calls(deployment.run_dir) if c["queued_s"] >= since_s]
    steps = [c for c in calls if c["instance"] == "prefill-0" and c["call"] == "step"]
    exports = [c for c in calls if c["instance"] == "prefill-0" and c["call"] == "export_frames"]
    imports = [c for c in calls if c["instance"] == "main-decode-0" and c["call"].startswith("import_frame")]
    # The prompt's last chunk: the step after which the rest of the prompt was exported.
    last_chunk = max((s for s in steps if s["end_s"] <= exports[-1]["queued_s"]), key=lambda s: s["start_s"])
    assert len(exports) >= 3, exports
    assert imports and imports[0]["start_s"] < last_chunk["start_s"], (imports[:1], last_chunk)


def engine_calls(run_dir: Path) -> list[dict]:
    """Every engine-thread call the deployment's services recorded (``PDD_ENGINE_CALL_LOG``)."""
    return [json.loads(line) for line in (run_dir / "engine-calls.jsonl").read_text().splitlines()]
