"""Starting the sites' nats-servers: a taken port is retried with fresh ones, errors show the log."""

import socket

import pytest

from infra.nats_server import NatsSite, NatsStartError, free_port, start_nats, start_nats_on_free_ports


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
    assert [nats_server.free_port(), nats_server.free_port()] == [47001, 47002]
