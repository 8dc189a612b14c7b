"""``pdd up``/``status``/``wan``/``down`` as a user runs them: separate processes, real ports.

Uses the tiny model so the processes start quickly; one test kills a main decoder process
mid-request and checks the client gets a clear error instead of hanging.
"""

import asyncio
import json
import os
import signal
import time

import pytest
from openai import AsyncOpenAI, OpenAI

from infra.http_probe import http_ok
from infra.launcher import load_state
from tests.helpers import chat_prompt_ids, pdd, reference_greedy


@pytest.fixture
def deployment(tiny_deployment):
    return tiny_deployment


def client(ports) -> AsyncOpenAI:
    return AsyncOpenAI(
        base_url=f"http://127.0.0.1:{ports['--http-port']}/v1", api_key="none", max_retries=0, timeout=60
    )


async def test_openai_client_gets_exact_answers_from_both_decoders(deployment, tiny):
    _, ports = deployment
    api = client(ports)
    models = await api.models.list()
    assert [m.id for m in models.data] == ["HuggingFaceTB/SmolLM2-135M-Instruct"]
    # Own system prompts: no two requests share a cached block, so however the six arrive
    # (together, or one after another on a starved machine) the idle decoders take turns.
    conversations = [
        [{"role": "system", "content": f"Case {i}."}, {"role": "user", "content": f"What is {i} plus {i}?"}]
        for i in range(6)
    ]
    answers = await asyncio.gather(
        *(
            api.chat.completions.create(
                model="HuggingFaceTB/SmolLM2-135M-Instruct",
                messages=messages,
                max_tokens=20,
                temperature=0,
                extra_body={"ignore_eos": True},
            )
            for messages in conversations
        )
    )
    for messages, answer in zip(conversations, answers):
        prompt = list(
            tiny.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        )
        expected = tiny.tokenizer.decode(reference_greedy(tiny, prompt, 20), skip_special_tokens=True)
        assert answer.choices[0].message.content == expected
    used = {a.model_extra["pdd"]["instances"]["main_decode"] for a in answers}
    assert used == {"main-decode-0", "main-decode-1"}


def test_status_and_wan_control(deployment):
    run_dir, ports = deployment
    status = json.loads(pdd("status", "--run-dir", str(run_dir)).stdout)
    assert set(status["processes"].values()) == {"running"}
    assert len(status["health"]["instances"]["main_decode"]) == 2
    control = f"http://127.0.0.1:{ports['--wan-control-port']}"
    keyless = pdd("wan", "--control-url", control, "--control-key-file", os.devnull, "set", "--rtt", "900ms")
    assert keyless.returncode != 0 and "control key" in keyless.stderr + keyless.stdout
    key = ["--control-key-file", str(run_dir / "secrets" / "control.key")]
    changed = pdd("wan", "--control-url", control, *key, "set", "--bandwidth", "1gbit", "--rtt", "10ms")
    assert changed.returncode == 0, changed.stderr
    profile = json.loads(changed.stdout)["profile"]
    assert profile["bandwidth_bps"] == 1e9 and profile["rtt_ms"] == 10
    shown = json.loads(pdd("wan", "--control-url", control, *key, "show").stdout)
    assert shown["routes"]["leafnode"]["bytes_forward"] > 0
    assert shown["profile"]["window_bytes"] == 4 << 20  # pdd up --window 4MiB
    assert shown["routes"]["leafnode"]["traffic"] == "control"
    bad = pdd("wan", "--control-url", control, *key, "set", "--bandwidth", "fast")
    assert bad.returncode == 2 and "bandwidth 'fast'" in bad.stderr


async def test_restarting_the_cache_index_while_requests_run(deployment):
    run_dir, ports = deployment
    api = client(ports)
    content = "A report on canal locks and barges. " * 30

    async def ask():
        reply = await api.chat.completions.create(
            model="HuggingFaceTB/SmolLM2-135M-Instruct",
            messages=[{"role": "user", "content": content}],
            max_tokens=60,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        return reply.model_extra["pdd"]

    first = await ask()
    running = [asyncio.create_task(ask()) for _ in range(3)]
    restarted = await asyncio.to_thread(pdd, "restart", "cache-index-0", "--run-dir", str(run_dir))
    assert restarted.returncode == 0, restarted.stderr
    assert all(p["finished_on"] == "MD" for p in await asyncio.gather(*running))
    deadline = time.monotonic() + 60
    while True:  # the new index replays the KV event streams, then hits show again
        again = await ask()
        if again["cached_blocks_md"] >= first["prompt_tokens"] // 16 - 1 or time.monotonic() > deadline:
            break
    assert again["cached_blocks_md"] >= first["prompt_tokens"] // 16 - 1, again


def active_sequences(metrics_url: str) -> int:
    import urllib.request

    text = urllib.request.urlopen(metrics_url, timeout=5).read().decode()
    return sum(
        int(float(line.rsplit(" ", 1)[1])) for line in text.splitlines() if line.startswith("pdd_active_sequences{")
    )


def kv_blocks_used(metrics_urls: dict[str, str]) -> int:
    """KV blocks the engines' requests hold now (their gauges, refreshed each heartbeat)."""
    import urllib.request

    total = 0
    for name, url in metrics_urls.items():
        if name.startswith(("prefill", "relay-decode", "main-decode")):
            text = urllib.request.urlopen(url, timeout=5).read().decode()
            total += sum(
                int(float(line.rsplit(" ", 1)[1]))
                for line in text.splitlines()
                if line.startswith("pdd_kv_blocks_used{")
            )
    return total


async def test_two_routers_serve_behind_one_address_and_killing_one_leaves_new_requests_served(deployment, tiny):
    """``--routers 2``: both routers answer exactly on the one port; SIGKILL one while it
    streams: a new request is served within 2 s, and the engines hold nothing 10 s later."""
    import aiohttp

    run_dir, ports = deployment
    url = f"http://127.0.0.1:{ports['--http-port']}/v1/chat/completions"
    model = "HuggingFaceTB/SmolLM2-135M-Instruct"

    def body(content: str, max_tokens: int, **extra) -> dict:
        messages = [{"role": "user", "content": content}]
        return {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, **extra}

    # A fresh connection per request: the kernel picks a router for each (SO_REUSEPORT).
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as session:
        answered_by = set()
        for i in range(16):
            content = f"Router check {i}: name a river."
            async with session.post(url, json=body(content, 12)) as response:
                reply = await response.json()
            assert reply["choices"][0]["message"]["content"] == tiny.tokenizer.decode(
                reference_greedy(tiny, chat_prompt_ids(tiny, [{"role": "user", "content": content}]), 12),
                skip_special_tokens=True,
            ), reply
            answered_by.add(reply["id"].rsplit("-", 1)[0])
            if len(answered_by) == 2 and i >= 3:
                break
        assert answered_by == {"router-0", "router-1"}

        # A long stream on router-1, then SIGKILL router-1 while it streams.
        state = load_state(run_dir)
        victim = "router-1"
        for _ in range(32):
            response = await session.post(url, json=body("Tell a long story.", 1000, stream=True, ignore_eos=True))
            first = json.loads((await response.content.readline()).decode().removeprefix("data: "))
            if first["id"].startswith(victim + "-"):
                break
            response.close()
        else:
            pytest.fail("no stream landed on router-1 in 32 connections")
        os.kill(state.processes[victim], signal.SIGKILL)
        killed = time.monotonic()
        with pytest.raises(aiohttp.ClientError):
            await response.content.read()  # the dead router's client loses its stream
        # A connection the kernel had already queued on the killed router's socket is reset (see
        # docs/control-plane.md): the client retries it, as OpenAI's client does.
        for attempt in range(3):
            try:
                async with session.post(url, json=body("After the kill: name a hill.", 8)) as after:
                    assert after.status == 200 and (await after.json())["choices"][0]["message"]["content"]
                break
            except aiohttp.ClientConnectionError:
                assert attempt < 2, "three connections after the kill were reset"
        assert time.monotonic() - killed < 2.0
    while kv_blocks_used(state.metrics_urls) and time.monotonic() - killed < 10.0:
        await asyncio.sleep(0.25)
    assert kv_blocks_used(state.metrics_urls) == 0
    # Leave it serving: the supervisor brings router-1 back (a new incarnation, on the same port).
    deadline = time.monotonic() + 60
    while load_state(run_dir).restarts.get(victim, 0) < 1 or not http_ok(
        load_state(run_dir).metrics_urls[victim].removesuffix("/metrics") + "/health"
    ):
        assert time.monotonic() < deadline, "router-1 did not come back"
        await asyncio.sleep(0.25)


async def test_killing_the_busiest_main_decoder_loses_no_request(deployment, tiny):
    run_dir, ports = deployment
    api = client(ports)
    state = load_state(run_dir)
    streams, max_tokens = 6, 1600  # each stream outlasts a few heartbeats (the gauges follow them)
    conversations = [
        [{"role": "system", "content": f"Teller {i}."}, {"role": "user", "content": "A story"}] for i in range(streams)
    ]
    decoding = [asyncio.Event() for _ in range(streams)]

    async def long_request(i):
        stream = await api.chat.completions.create(
            model="HuggingFaceTB/SmolLM2-135M-Instruct",
            max_tokens=max_tokens,
            temperature=0,
            stream=True,
            messages=conversations[i],
            extra_body={"ignore_eos": True},
        )
        text, pdd = [], None
        async for chunk in stream:
            decoding[i].set()
            if chunk.choices and chunk.choices[0].delta.content:
                text.append(chunk.choices[0].delta.content)
            pdd = (chunk.model_extra or {}).get("pdd", pdd)
        return "".join(text), pdd

    requests = [asyncio.create_task(long_request(i)) for i in range(streams)]
    await asyncio.wait_for(asyncio.gather(*(e.wait() for e in decoding)), 60)
    # Which decoder runs what is the router's business; ask the decoders (their gauges
    # follow heartbeats, so wait until the streams are counted).
    decoders = ["main-decode-0", "main-decode-1"]
    deadline = time.monotonic() + 30
    while True:
        active = {name: await asyncio.to_thread(active_sequences, state.metrics_urls[name]) for name in decoders}
        if sum(active.values()) == streams or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.1)
    victim = max(decoders, key=active.get)
    os.kill(state.processes[victim], signal.SIGKILL)
    results = await asyncio.wait_for(asyncio.gather(*requests), 120)
    for messages, (text, _) in zip(conversations, results):
        prompt = list(
            tiny.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        )
        assert text == tiny.tokenizer.decode(reference_greedy(tiny, prompt, max_tokens), skip_special_tokens=True)
    recovered = [pdd["recoveries"] for _, pdd in results if pdd["recoveries"]]
    # The gauges follow heartbeats: a stream counted on the victim may have ended before the kill.
    assert sum(active.values()) == streams and 1 <= len(recovered) <= active[victim], (active, recovered)
    assert all(r[0]["from"] == victim and r[0]["to"] != victim for r in recovered)
    # The next request succeeds, and the supervisor brings the killed decoder back.
    reply = await api.chat.completions.create(
        model="HuggingFaceTB/SmolLM2-135M-Instruct",
        messages=[{"role": "user", "content": "And now?"}],
        max_tokens=8,
        temperature=0,
    )
    assert reply.choices[0].finish_reason == "length"
    deadline = time.monotonic() + 60
    while True:
        status = json.loads(pdd("status", "--json", "--run-dir", str(run_dir)).stdout)
        entry = status["processes"][victim]
        if (
            entry["state"] == "running"
            and entry["restarts"] == 1
            and victim in status["health"]["instances"]["main_decode"]
        ) or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.2)
    assert entry["pid"] != state.processes[victim] and entry["restarts"] == 1, entry
    assert victim in status["health"]["instances"]["main_decode"] and status["supervisor"] == "running"


def test_pdd_restart_covers_the_nats_servers_and_the_wan_link(deployment):
    run_dir, ports = deployment
    for name in ("nats-b", "wan-link"):
        before = load_state(run_dir).processes[name]
        restarted = pdd("restart", name, "--run-dir", str(run_dir))
        assert restarted.returncode == 0, restarted.stderr
        assert load_state(run_dir).processes[name] != before
    api = OpenAI(base_url=f"http://127.0.0.1:{ports['--http-port']}/v1", api_key="none", max_retries=0, timeout=60)
    deadline = time.monotonic() + 60
    while True:  # main decode is back in view once the leafnode and its heartbeats return
        reply = api.chat.completions.create(
            model="HuggingFaceTB/SmolLM2-135M-Instruct",
            max_tokens=4,
            temperature=0,
            messages=[{"role": "user", "content": "Still there?"}],
        )
        if reply.model_extra["pdd"]["pipeline"] != "P-RLD" or time.monotonic() > deadline:
            break
    assert reply.model_extra["pdd"]["pipeline"] in ("P-MD", "P-RLD-MD"), reply.model_extra["pdd"]


POINT_3_FAMILIES = {
    "router-0": [
        "pdd_ttft_seconds",
        "pdd_inter_token_latency_seconds",
        "pdd_e2e_request_latency_seconds",
        "pdd_queue_seconds",
        "pdd_prompt_tokens",
        "pdd_generation_tokens",
        "pdd_requests",
        "pdd_requests_running",
        "pdd_requests_waiting",
    ],
    "prefill-0": [
        "pdd_prefill_seconds",
        "pdd_engine_step_seconds",
        "pdd_kv_transfer_seconds",
        "pdd_kv_transfer_bytes",
        "pdd_kv_cache_usage_ratio",
    ],
    "main-decode": [
        "pdd_engine_step_seconds",
        "pdd_kv_cache_usage_ratio",
        "pdd_kv_imports_waiting",
        "pdd_active_sequences",
    ],
    "relay-decode-0": ["pdd_engine_step_seconds", "pdd_kv_cache_usage_ratio", "pdd_active_sequences"],
    "wan-link": [
        "pdd_wan_bytes",
        "pdd_wan_queue_bytes",
        "pdd_wan_partitioned",
        "pdd_wan_shaped_rate_bps",
        "pdd_wan_route_bytes",
    ],
}
"""Families with samples on each process once requests have run (a family is named without
``_total``, as prometheus_client's parser names it)."""


def test_every_service_exposes_its_metrics(deployment):
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    run_dir, _ = deployment
    status = json.loads(pdd("status", "--json", "--run-dir", str(run_dir)).stdout)
    urls = status["metrics_urls"]
    # One that served requests since it started (the supervisor restarted a killed one).
    main_decode = next(
        name
        for name, entry in sorted(status["processes"].items())
        if name.startswith("main-decode") and entry["state"] == "running" and entry["restarts"] == 0
    )
    expected = {
        "router-0": [
            "pdd_pipeline_choices_total",
            "pdd_ttft_seconds_bucket",
            "pdd_wan_estimate_bandwidth_bps",
            'model_name="HuggingFaceTB/SmolLM2-135M-Instruct"',
        ],
        "prefill-0": [
            'pdd_kv_bytes_total{direction="sent",path="wan"}',
            "pdd_kv_transfer_seconds_bucket",
            'pdd_prefix_cache_lookup_blocks_total{service="prefill"}',
        ],
        main_decode: [
            'pdd_kv_bytes_total{direction="received",path="wan"}',
            "pdd_active_sequences",
            'pdd_prefix_cache_hit_blocks_total{service="main_decode"}',
        ],
        "relay-decode-0": ["pdd_eager_tokens_total", "pdd_active_sequences"],
        "cache-index-0": ['pdd_cache_index_events_total{outcome="applied"}'],
    }
    for name, metrics in expected.items():
        with urllib.request.urlopen(urls[name], timeout=5) as response:
            text = response.read().decode()
        for metric in metrics:
            assert metric in text, f"{name} lacks {metric}"
    for name, families in POINT_3_FAMILIES.items():
        url = urls[main_decode if name == "main-decode" else name]
        with urllib.request.urlopen(url, timeout=5) as response:
            parsed = {f.name: f for f in text_string_to_metric_families(response.read().decode())}
        for family in families:
            assert family in parsed and parsed[family].samples, f"{name} has no samples of {family}"


async def test_200_concurrent_streams_complete_or_get_429_and_no_engine_exceeds_max_sequences(deployment):
    """Against separate processes with default limits (16 sequences per engine): every stream
    completes or is told to come back later; no 5xx; /health keeps answering within 2 s."""
    import aiohttp

    run_dir, ports = deployment
    base = f"http://127.0.0.1:{ports['--http-port']}"
    engines = {
        name: url
        for name, url in load_state(run_dir).metrics_urls.items()
        if name.startswith(("prefill", "relay-decode", "main-decode"))
    }
    most_active: dict[str, float] = {}
    health_s: list[float] = []
    done = asyncio.Event()

    async def watch(session):
        while not done.is_set():
            started = time.monotonic()
            async with session.get(base + "/health") as response:
                await response.read()
            health_s.append(time.monotonic() - started)
            for name, url in engines.items():
                async with session.get(url) as response:
                    for line in (await response.text()).splitlines():
                        if line.startswith("pdd_active_sequences{"):
                            most_active[name] = max(most_active.get(name, 0.0), float(line.rsplit(" ", 1)[1]))

    async def one(session, i):
        body = {
            "model": "HuggingFaceTB/SmolLM2-135M-Instruct",
            "max_tokens": 12,
            "temperature": 0,
            "stream": True,
            "messages": [{"role": "user", "content": f"Stream {i}: name a colour."}],
        }
        async with session.post(base + "/v1/chat/completions", json=body) as response:
            text = await response.text()
            if response.status == 200:
                assert text.rstrip().endswith("data: [DONE]") and '"error"' not in text, text[-300:]
            elif response.status == 429:
                assert int(response.headers["Retry-After"]) >= 1
            return response.status

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=180)) as session:
        watcher = asyncio.create_task(watch(session))
        statuses = await asyncio.gather(*(one(session, i) for i in range(200)))
        done.set()
        await watcher
    assert set(statuses) <= {200, 429}, sorted(set(statuses))
    assert statuses.count(200) >= 32  # at least what two main decoders hold at once
    assert max(health_s) < 2.0, max(health_s)
    assert most_active and max(most_active.values()) <= 16, most_active


async def test_pdd_ups_nats_refuses_anonymous_and_plaintext_clients(deployment):
    import nats

    run_dir, _ = deployment
    state = load_state(run_dir)
    secrets = run_dir / "secrets"
    assert oct(secrets.stat().st_mode & 0o777) == "0o700"
    assert all(oct(f.stat().st_mode & 0o777) == "0o600" for f in secrets.iterdir())
    for url in state.nats_urls.values():
        assert url.startswith("tls://")
        with pytest.raises((nats.errors.Error, OSError, asyncio.TimeoutError)):
            await nats.connect(
                url.replace("tls://", "nats://"), allow_reconnect=False, connect_timeout=3, max_reconnect_attempts=0
            )
    assert '"PDD_BULK_SECRET"' not in json.dumps(state.commands)  # secrets travel as files


def test_every_line_every_service_logs_is_one_json_object(deployment):
    run_dir, _ = deployment
    logs = [p for p in (run_dir / "logs").glob("*.log") if not p.name.startswith("nats-")]
    assert {"router-0.log", "prefill-0.log", "main-decode-0.log", "wan-link.log"} <= {p.name for p in logs}
    for path in logs:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if line.strip():
                assert isinstance(json.loads(line), dict), f"{path.name}:{number}: {line[:200]}"


def test_bench_run_url_benchmarks_a_running_endpoint_in_the_usual_shape(deployment, tmp_path):
    _run_dir, ports = deployment
    url = f"http://127.0.0.1:{ports['--http-port']}/v1"
    result = pdd(
        "bench",
        "run",
        "--url",
        url,
        "--label",
        "pdd-running",
        "--out",
        str(tmp_path),
        "--sessions",
        "2",
        "--turns",
        "2",
        "--cold-lines",
        "8",
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    results = json.loads((tmp_path / "results.json").read_text())
    assert list(results["modes"]) == ["pdd-running"]
    figures = results["modes"]["pdd-running"]
    assert figures["requests"] == 4 and figures["errors"] == 0
    assert set(figures["ttft_ms"]) == {"p50", "p90", "p99", "mean"} and figures["ttft_ms"]["p50"] > 0
    assert {"itl_ms", "e2e_ms", "goodput_rps", "wan_kv_bytes", "rld_token_share", "pipelines"} <= set(figures)
    assert sum(figures["pipelines"].values()) == 4  # the PDD extension fields come back from a PDD server
    assert "| pdd-running |" in (tmp_path / "report.md").read_text()


def test_pdd_up_refuses_a_link_setting_it_cannot_read_before_starting_anything(tmp_path):
    result = pdd("up", "--detach", "--model", "tiny", "--run-dir", str(tmp_path), "--window", "lots")
    assert result.returncode != 0 and "size 'lots'" in result.stderr + result.stdout
    assert load_state(tmp_path) is None


def test_bench_trace_exports_the_agentic_trace_for_aiperf(tmp_path):
    out = tmp_path / "trace.mooncake.jsonl"
    result = pdd("bench", "trace", "--format", "mooncake", "--quick", "--out", str(out))
    assert result.returncode == 0, result.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    ours = tmp_path / "trace.jsonl"
    assert pdd("bench", "trace", "--format", "jsonl", "--quick", "--out", str(ours)).returncode == 0
    turns = [json.loads(line) for line in ours.read_text().splitlines()]
    assert len(rows) == len(turns) >= 20
    by_session = {}
    for row in rows:
        assert set(row) in (
            {"session_id", "text_input", "output_length", "timestamp"},
            {"session_id", "text_input", "output_length", "delay"},
        )
        by_session.setdefault(row["session_id"], []).append(row)
    assert all("timestamp" in turns_[0] for turns_ in by_session.values())
    assert sorted(r["text_input"] for r in rows) == sorted(t["content"] for t in turns)
