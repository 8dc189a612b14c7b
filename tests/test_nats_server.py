"""Starting the sites' nats-servers: a taken port is retried with fresh ones, errors show the log,
JetStream's storage does not depend on the free disk space."""

import os
import re
import socket
import subprocess
from pathlib import Path

import nats
import pytest

from infra.nats_server import NatsSite, NatsStartError, free_port, start_nats, start_nats_on_free_ports
from infra.streams import create_streams, stream_configs


@pytest.fixture
def taken_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


def test_taken_port_is_reported_with_the_servers_log(tmp_path, taken_port):
    site = NatsSite("site-a", taken_port, free_port(), tmp_path / "js")
    with pytest.raises(NatsStartError, match="log ends:.*"):
        start_nats(site, tmp_path)


def test_start_retries_with_fresh_ports(tmp_path, taken_port):
    ports = iter([taken_port])
    site, process = start_nats_on_free_ports(
        lambda: NatsSite("site-a", next(ports, None) or free_port(), free_port(), tmp_path / "js"), tmp_path
    )
    try:
        assert site.client_port != taken_port and process.poll() is None
    finally:
        process.terminate()
        process.wait(timeout=5)


def test_free_port_never_hands_out_the_same_port_twice(monkeypatch):
    from infra import nats_server

    offered = iter([47001, 47001, 47002])  # the kernel offers a port it just offered again

    class Probe:
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def bind(self, address):
            self.port = next(offered)

        def getsockname(self):
            return ("127.0.0.1", self.port)

    monkeypatch.setattr(nats_server.socket, "socket", Probe)
    monkeypatch.setattr(nats_server, "_HANDED_OUT", set())  # the suite may have handed out 47001
    assert [nats_server.free_port(), nats_server.free_port()] == [47001, 47002]


def test_free_port_draws_below_the_ephemeral_range_or_lets_the_kernel_pick(monkeypatch, tmp_path):
    """No client connection or listener on port 0 can take a drawn port before its server binds."""
    from infra import nats_server

    ephemeral = tmp_path / "ip_local_port_range"
    ephemeral.write_text("20000\t60999\n")
    monkeypatch.setattr(nats_server, "_EPHEMERAL_RANGE", ephemeral)
    assert all(10000 <= nats_server.free_port() < 20000 for _ in range(50))
    ephemeral.unlink()  # no such file (not Linux): the kernel picks
    assert nats_server.free_port() > 0


def test_free_port_draws_again_when_the_drawn_port_is_taken(monkeypatch, tmp_path, taken_port):
    from infra import nats_server

    ephemeral = tmp_path / "ip_local_port_range"
    ephemeral.write_text("32768\t60999\n")
    monkeypatch.setattr(nats_server, "_EPHEMERAL_RANGE", ephemeral)
    spare = nats_server.free_port()
    draws = iter([taken_port, spare])
    monkeypatch.setattr(nats_server.random, "choice", lambda _ports: next(draws))
    monkeypatch.setattr(nats_server, "_HANDED_OUT", set())
    assert nats_server.free_port() == spare


def _shipped_configs() -> dict[str, str]:
    root = Path(__file__).resolve().parent.parent
    texts = {str(p.relative_to(root)): p.read_text() for p in root.glob("infra/**/nats.conf")}
    texts |= {str(p.relative_to(root)): p.read_text() for p in root.glob("infra/nats/site-*.conf")}
    texts["generated"] = NatsSite("site-a", free_port(), free_port(), Path("/js")).config_text()
    return texts


def test_every_server_sets_its_jetstream_storage_and_the_streams_fit_in_it():
    reserved = sum(config.max_bytes for config in stream_configs("site-a"))
    configs = _shipped_configs()
    assert len(configs) == 5
    for name, text in configs.items():
        stored = re.search(r"max_file_store: (\d+)GB\b", text)
        assert stored, f"{name} leaves JetStream's storage to the free disk space"
        assert reserved <= int(stored.group(1)) << 30, name


@pytest.fixture
def small_disk(tmp_path):
    """A 16 MB filesystem: a server's default JetStream storage would be 75 % of it."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small filesystem needs root")
    mount = tmp_path / "small"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(mount)], check=True)
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=True)


async def test_a_sites_streams_are_made_on_a_nearly_full_disk(tmp_path, small_disk):
    site = NatsSite("site-a", free_port(), free_port(), small_disk / "js")
    process = start_nats(site, tmp_path)
    try:
        nc = await nats.connect(site.url)
        try:
            assert sorted(await create_streams(nc, site.site)) == sorted(c.name for c in stream_configs("site-a"))
        finally:
            await nc.close()
    finally:
        process.terminate()
        process.wait(timeout=5)
