"""Control and ops surfaces: the WAN link's control API changes the link only for holders of the
deployment's control key, a service's /metrics answers only the metrics key, and neither
listens beyond loopback without its key."""

import asyncio
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from aiohttp import web

from infra.credentials import ensure_credentials
from infra.http_probe import http_ok
from infra.nats_server import free_port, wait_until
from infra.wan_control import WanControlError, call
from infra.wan_link import LinkProfile, WanLink, control_app
from shared.ops_server import start_ops_server

PDD = str(Path(sys.executable).parent / "pdd")
KEY = "k" * 64


@pytest.fixture
async def control_url():
    link = WanLink(LinkProfile(bandwidth_bps=1e8, rtt_ms=40, jitter_ms=0))
    runner = web.AppRunner(control_app(link, KEY), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    yield f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
    await runner.cleanup()
    await link.close()


def get(url: str, headers: dict | None = None) -> int:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=5) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code


async def test_only_the_control_key_changes_or_reads_the_link(control_url):
    # The client blocks: run it beside the event loop that serves the link.
    for key in ("", "wrong", KEY[:-1]):
        with pytest.raises(WanControlError, match="control key"):
            await asyncio.to_thread(call, control_url, {"partitioned": True}, key)
        with pytest.raises(WanControlError, match="control key"):
            await asyncio.to_thread(call, control_url, None, key)
    assert (await asyncio.to_thread(call, control_url, None, KEY))["profile"]["partitioned"] is False
    assert (await asyncio.to_thread(call, control_url, {"rtt_ms": 80}, KEY))["profile"]["rtt_ms"] == 80
    for open_path in ("/health", "/metrics"):  # probes and scrapers need no key
        assert await asyncio.to_thread(get, control_url + open_path) == 200


def test_the_link_refuses_a_public_control_port_without_a_key(tmp_path):
    result = subprocess.run(
        [PDD, "serve", "wan_link", "--control-host", "0.0.0.0", "--control-port", str(free_port())],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode != 0 and "--control-key-file" in result.stderr + result.stdout, result
    key_file = tmp_path / "control.key"
    key_file.write_text(KEY)
    port = free_port()
    served = subprocess.Popen(
        [
            PDD,
            "serve",
            "wan_link",
            "--control-host",
            "0.0.0.0",
            "--control-port",
            str(port),
            "--control-key-file",
            str(key_file),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        wait_until(lambda: http_ok(f"http://127.0.0.1:{port}/health"), 30, "the link to serve")
        assert get(f"http://127.0.0.1:{port}/link") == 401
        assert call(f"http://127.0.0.1:{port}", None, KEY)["profile"]["bandwidth_bps"] == 1e8
    finally:
        served.terminate()
        served.wait(10)


def test_a_service_refuses_a_public_metrics_port_without_the_metrics_key():
    result = subprocess.run(
        [PDD, "serve", "cache_index", "--metrics-host", "0.0.0.0", "--metrics-port", str(free_port())],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode != 0 and "--metrics-key-sha256-file" in result.stderr + result.stdout, result


async def test_metrics_answer_only_the_metrics_key_and_health_answers_anyone(tmp_path):
    creds = ensure_credentials(tmp_path / "secrets")
    key = creds.metrics_key_file.read_text().strip()
    server = await start_ops_server(
        "127.0.0.1", 0, lambda: (True, {}), creds.metrics_key_sha256_file.read_text().strip()
    )
    url = f"http://127.0.0.1:{server.port}"
    try:
        for header in (
            {},
            {"Authorization": "Bearer wrong"},
            {"Authorization": "Bearer " + key[:-1]},
            {"Authorization": "Basic " + key},
        ):
            assert await asyncio.to_thread(get, url + "/metrics", header) == 401
        assert await asyncio.to_thread(get, url + "/metrics", {"Authorization": "Bearer " + key}) == 200
        assert await asyncio.to_thread(get, url + "/health") == 200
    finally:
        await server.stop()
