"""One routed WAN-link port for any number of main decoders, on real sockets: each connection
names its receiver in a signed LinkRoute; TLS runs end to end through the link; routes that
are unsigned, forged, replayed or aimed at another port are refused before anything is
forwarded."""

import asyncio
import time

import pytest

from infra.credentials import ensure_credentials
from infra.wan_link import LinkProfile, Route, WanLink, parse_route
from shared.bulk.auth import verify_key
from shared.bulk.framing import control_bytes
from shared.bulk.link_route import RouteAuthenticator, route_key, sign_route
from shared.bulk.receiver import BulkReceiver
from shared.bulk.sender import open_flow
from shared.engine.hf_engine import HfEngine
from shared.messages import FlowOpen
from shared.tls import client_context, server_context
from tests.helpers import SAMPLING, RecordingHandler, prompt_of_length

SECRET = "routing-secret"


@pytest.fixture
def creds(tmp_path):
    return ensure_credentials(tmp_path / "secrets")


@pytest.fixture
async def two_receivers_behind_one_port(tiny, creds):
    """Two TLS receivers ("main-decode-0/1") and a link with one routed port to both."""
    tls = server_context(str(creds.ca_file), str(creds.cert_file("main-decode")), str(creds.key_file("main-decode")))
    receivers, handlers, endpoints = [], [], []
    for i in range(2):
        engine = HfEngine(tiny, num_blocks=32)
        handler = RecordingHandler(engine)
        receiver = BulkReceiver(
            handler,
            engine.frame_expectation,
            verify_key(SECRET),
            path="wan",
            frame_timeout_s=5,
            receiver_id=f"main-decode-{i}",
            tls=tls,
        )
        host, port = await receiver.start()
        receivers.append(receiver), handlers.append(handler), endpoints.append(f"{host}:{port}")
    link = WanLink(LinkProfile(bandwidth_bps=0, rtt_ms=2, jitter_ms=0), route_key=route_key(SECRET))
    port = await link.add_route(Route("bulk-main-decode", "127.0.0.1", 0, "*", 0, from_site="site-a"))
    yield link, f"127.0.0.1:{port}", handlers, endpoints
    await link.close()
    for receiver in receivers:
        await receiver.stop()


def flow_open_for(request_id: str, prompt: list[int], receiver_id: str) -> FlowOpen:
    return FlowOpen(
        request_id=request_id,
        role="main_decode",
        token_ids=prompt,
        sampling=SAMPLING,
        seed=1,
        sender_id="prefill-0",
        receiver_id=receiver_id,
        unix_s=0.0,
        nonce="",
    )


async def test_each_flow_reaches_the_receiver_it_names_with_tls_end_to_end(two_receivers_behind_one_port, tiny, creds):
    link, link_address, handlers, endpoints = two_receivers_behind_one_port
    client_tls = client_context(str(creds.ca_file), str(creds.cert_file("prefill")), str(creds.key_file("prefill")))
    sender = HfEngine(tiny, num_blocks=64)
    prompt = prompt_of_length(tiny, 40)
    for i, endpoint in enumerate(endpoints):
        rid = f"r{i}"
        sender.add_request(rid, prompt, SAMPLING)
        first = sender.step()[0].token_id
        flow = await open_flow(
            endpoint,
            flow_open_for(rid, prompt, f"main-decode-{i}"),
            SECRET,
            path="wan",
            timeout_s=5,
            tls=client_tls,
            link=link_address,
        )
        for parts in sender.export_frames(rid, flow.first_token_index, len(prompt), max_tokens_per_frame=16):
            await flow.send_frame(parts)
        await flow.end([first])
        await asyncio.wait_for(handlers[i].ended.wait(), 5)
        assert handlers[i].engine.get(rid).num_imported_tokens == 40
    assert [h.events[0] for h in handlers] == [("open", "r0"), ("open", "r1")]
    stats = link.snapshot()["routes"]["bulk-main-decode"]
    assert stats["targets"] == {endpoints[0]: 1, endpoints[1]: 1} and stats["refused"] == 0
    assert stats["bytes_forward"] > 2 * 40 * sender.layout.kv_bytes_per_token


async def _refused(link_address: str, opening: bytes) -> bytes:
    """What the link answers a connection that starts with ``opening`` (b"": it closed it)."""
    host, _, port = link_address.rpartition(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(opening)
    await writer.drain()
    try:
        return await asyncio.wait_for(reader.read(), 10)
    finally:
        writer.close()


@pytest.mark.parametrize("case", ["wrong key", "replayed", "stale", "not a route"])
async def test_a_route_without_the_key_or_replayed_is_refused_before_anything_is_forwarded(
    two_receivers_behind_one_port, case, monkeypatch
):
    import shared.bulk.receiver

    link, link_address, handlers, endpoints = two_receivers_behind_one_port
    good = sign_route(endpoints[0], route_key(SECRET))
    if case == "replayed":
        # The first use reaches the receiver, which closes it when no handshake comes in time.
        monkeypatch.setattr(shared.bulk.receiver, "AUTH_TIMEOUT_S", 0.5)
        assert await _refused(link_address, control_bytes(good)) == b""  # used once (then nothing follows)
        opening = control_bytes(good)
    elif case == "wrong key":
        opening = control_bytes(sign_route(endpoints[0], route_key("another-deployment")))
    elif case == "stale":
        opening = control_bytes(sign_route(endpoints[0], route_key(SECRET), now=time.time() - 3600))
    else:
        opening = b"\x16\x03\x01\x02\x00" + b"\x00" * 64  # a TLS ClientHello straight away
    before = link.snapshot()["routes"]["bulk-main-decode"]
    assert await _refused(link_address, opening) == b""
    after = link.snapshot()["routes"]["bulk-main-decode"]
    assert after["refused"] == before["refused"] + 1
    assert after["targets"] == before["targets"] and all(h.events == [] for h in handlers)


def test_the_route_key_is_a_one_way_function_of_the_bulk_secret_and_the_port_is_enforced():
    key = route_key(SECRET)
    assert key != SECRET and key == route_key(SECRET) and key != route_key(SECRET + "x")
    check = RouteAuthenticator(key)
    assert check.verify(sign_route("10.0.0.7:9100", key), allowed_port=9100) is None
    assert "routed port" in check.verify(sign_route("10.0.0.7:22", key), allowed_port=9100)
    assert "host:port" in check.verify(sign_route("10.0.0.7", key))
    with pytest.raises(ValueError, match="route key"):
        RouteAuthenticator("")


async def test_a_routed_port_needs_the_route_key():
    link = WanLink(LinkProfile())
    with pytest.raises(ValueError, match="route key"):
        await link.add_route(parse_route("bulk=127.0.0.1:0>*:9100@site-a"))
    assert parse_route("bulk=0.0.0.0:19100>*@site-a").routed
    assert parse_route("bulk=0.0.0.0:19100>*:9100@site-a").target_port == 9100
    assert not parse_route("leafnode=127.0.0.1:1>127.0.0.1:2@site-b").routed


async def test_a_peer_that_never_names_its_target_is_dropped_after_the_route_timeout(
    two_receivers_behind_one_port, monkeypatch
):
    import infra.wan_link

    monkeypatch.setattr(infra.wan_link, "ROUTE_TIMEOUT_S", 0.2)
    link, link_address, handlers, _ = two_receivers_behind_one_port
    host, _, port = link_address.rpartition(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        assert await asyncio.wait_for(reader.read(), 5) == b""  # closed by the link, not by us
    finally:
        writer.close()
    stats = link.snapshot()["routes"]["bulk-main-decode"]
    assert stats["targets"] == {} and all(h.events == [] for h in handlers)
