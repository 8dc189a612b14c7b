"""docker-compose.yml for real: a private Docker engine, the images built offline, two main
decoders behind one routed WAN-link port, two relays and two routers behind router-lb, greedy text
equal to transformers', main decode scaled down and up again, a router killed while the other
serves on, and nothing left at the end (containers, networks, volumes, engine).

Marked ``docker`` (``make test-docker``; ``make test`` leaves it out: building the images takes
minutes). It needs root and ``dockerd`` (Debian's docker.io) and skips with the reason otherwise.
"""

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from openai import OpenAI

from infra.compose import ComposeStack, let_containers_read
from infra.nats_server import free_port
from loadtest.chaos import prompt_ids, references
from loadtest.compose_demo import new_secrets
from loadtest.demo_conversation import long_tool_output, stream_turn

pytestmark = [pytest.mark.docker, pytest.mark.real_model, pytest.mark.timeout(3600)]
ROOT = Path(__file__).resolve().parent.parent
ENGINE_START_S = 60.0
MAX_TOKENS = 24


def why_no_private_engine() -> str | None:
    """None if this process can start a Docker engine of its own, else why not."""
    if shutil.which("dockerd") is None:
        return "no dockerd (apt-get install docker.io docker-compose debootstrap)"
    if os.geteuid() != 0:
        return "a private Docker engine needs root"
    if shutil.which("docker") is None:
        return "no docker client"
    return None


@pytest.fixture(scope="module")
def docker_engine():
    """A Docker engine with its own data root and socket, stopped by its pid at the end."""
    reason = why_no_private_engine()
    if reason:
        pytest.skip(reason)
    # Short paths: the engine's unix sockets live under its exec root.
    folder = Path(tempfile.mkdtemp(prefix="pdd-dockerd-", dir="/var/tmp"))
    host = f"unix://{folder}/docker.sock"
    with open(folder / "dockerd.log", "wb") as log:  # the engine keeps its own copy
        engine = subprocess.Popen(
            [
                "dockerd",
                "--storage-driver",
                "vfs",
                "--iptables=false",
                "--bridge=none",
                "--data-root",
                str(folder / "data"),
                "--exec-root",
                str(folder / "exec"),
                "-H",
                host,
                "--pidfile",
                str(folder / "docker.pid"),
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("DOCKER_HOST", host)
        try:
            _wait_for_engine(engine, folder)
            yield host
        finally:
            engine.terminate()
            try:
                engine.wait(60)
            except subprocess.TimeoutExpired:
                engine.kill()
                engine.wait(10)
            left = subprocess.run(["pgrep", "-f", str(folder)], capture_output=True, text=True).stdout.split()
            shutil.rmtree(folder, ignore_errors=True)
            assert not left, f"engine processes left: {left}"


def _wait_for_engine(engine: subprocess.Popen, folder: Path):
    deadline = time.monotonic() + ENGINE_START_S
    while subprocess.run(["docker", "version"], capture_output=True).returncode != 0:
        if engine.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"dockerd did not start: {(folder / 'dockerd.log').read_text()[-2000:]}")
        time.sleep(0.5)


class Conversation:
    """A chat whose every answer is checked against transformers' greedy output."""

    def __init__(self, client: OpenAI, loaded, name: str):
        self.client, self.loaded = client, loaded
        self.served = client.models.list().data[0].id
        self.messages = [{"role": "system", "content": f"You are {name}, a careful coding agent. Answer briefly."}]

    def turn(self, text: str) -> dict:
        """Send one user message; return the ``pdd`` fields (the answer must be exact)."""
        self.messages.append({"role": "user", "content": text})
        expected = references(self.loaded, [prompt_ids(self.loaded, self.messages)], MAX_TOKENS)[0]
        answer, _, pdd = stream_turn(self.client, self.served, self.messages, MAX_TOKENS)
        self.messages.append({"role": "assistant", "content": answer})
        assert answer == expected, pdd
        return pdd


def test_compose_runs_exact_on_two_main_decoders_and_scales_main_decode(docker_engine, smollm2):
    build = subprocess.run([sys.executable, "-m", "infra.cli", "images"], cwd=ROOT)
    assert build.returncode == 0, "make images failed"
    secrets = new_secrets()
    stack = ComposeStack("pdd-test", secrets, free_port(), free_port(), env=let_containers_read(secrets))
    want = {"prefill": 1, "relay_decode": 2, "main_decode": 2, "cache_index": 1, "router": 1}
    try:
        stack.up(main_decoders=2, relays=2)
        stack.wait_ready(want)
        client = OpenAI(base_url=stack.router_url, api_key="not-needed", timeout=300)
        # Two conversations with nothing in common: a long cold first turn each (relayed while
        # its KV crosses the 100 Mbit/s link), then a follow-up the main decoder's cache covers.
        runs = [Conversation(client, smollm2, name) for name in ("Ada", "Brian")]
        fields = [
            c.turn(f"Here is a tool output:\n\n{long_tool_output()}\n\nSummarise it in one sentence.") for c in runs
        ]
        fields += [c.turn("Name the first file it lists.") for c in runs]
        assert {f["pipeline"] for f in fields} == {"P-RLD-MD", "P-MD"}, fields
        served_by = {f["instances"]["main_decode"] for f in fields}
        assert len(served_by) == 2, fields  # both replicas, through one routed link port
        relayed_by = {f["instances"]["relay_decode"] for f in fields if f["pipeline"] == "P-RLD-MD"}
        assert len(relayed_by) == 2, fields  # relays scale the same way (their own addresses)
        targets = _link_targets(stack)
        assert len(targets) == 2 and all(n > 0 for n in targets.values()), targets

        stack.scale_main_decode(1)
        stack.wait_ready({**want, "main_decode": 1})
        remaining = set(stack.health()["instances"]["main_decode"])
        assert runs[0].turn("And the last one?")["instances"]["main_decode"] in remaining

        stack.scale_main_decode(2)
        stack.wait_ready(want)
        added = set(stack.health()["instances"]["main_decode"]) - remaining
        fresh = Conversation(client, smollm2, "Chen").turn("Write a haiku about a relay race.")
        assert fresh["instances"]["main_decode"] in added, fresh  # the new replica is reachable at once

        # Routers scale behind router-lb (one router until here: each keeps its own rotation
        # among idle instances, so with two, turns one after the other may share a decoder).
        stack.scale("router", 2)
        stack.wait_ready({**want, "router": 2})
        _both_routers_answer_then_one_is_killed(stack, client, smollm2)
        stack.wait_ready(want)
    finally:
        stack.down()
        left = stack.leftovers()
        shutil.rmtree(secrets.parent, ignore_errors=True)
    assert left == {"containers": [], "networks": [], "volumes": []}, left
    assert subprocess.run(["docker", "ps", "-a", "-q"], capture_output=True, text=True).stdout.split() == []


def _both_routers_answer_then_one_is_killed(stack: ComposeStack, client: OpenAI, loaded):
    """Through router-lb both routers answer (a request id names its router); SIGKILL one: a
    new request's first token comes within 2 s, exact, from the other."""
    routers = set(stack.health()["instances"]["router"])
    answered_by, served = set(), client.models.list().data[0].id
    deadline = time.monotonic() + 60  # router-lb learns a new replica from Docker's DNS, then checks it
    while answered_by != routers and time.monotonic() < deadline:
        fresh = OpenAI(base_url=stack.router_url, api_key="not-needed", timeout=60)  # a connection of its own
        reply = fresh.chat.completions.create(
            model=served, messages=[{"role": "user", "content": "Router check: name a river."}], max_tokens=4
        )
        answered_by.add(reply.id.rsplit("-", 1)[0])
    assert answered_by == routers and len(routers) == 2, (answered_by, routers)
    messages = [{"role": "user", "content": "Name a hill."}]
    expected = references(loaded, [prompt_ids(loaded, messages)], MAX_TOKENS)[0]
    served = client.models.list().data[0].id
    fresh = OpenAI(base_url=stack.router_url, api_key="not-needed", timeout=60)  # new connections
    stack.kill(stack.containers("router")[0])
    answer, ttft_ms, pdd = stream_turn(fresh, served, messages, MAX_TOKENS)  # ttft counted from its own start
    first_token_s = ttft_ms / 1000  # the stream starts right at the kill
    assert answer == expected, pdd
    print(f"first token {first_token_s:.2f} s after a router was killed", flush=True)
    assert first_token_s < 2.0, pdd


def _link_targets(stack: ComposeStack) -> dict[str, int]:
    from infra.wan_control import call

    return call(stack.wan_control_url, None, stack.control_key)["routes"]["bulk-main-decode"]["targets"]
