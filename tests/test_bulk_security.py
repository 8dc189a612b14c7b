"""The bulk channel's locks, on real sockets: mutual TLS with the deployment's CA on the WAN
path, FlowOpens bound to one receiver incarnation, every connection of a striped flow
authenticated on its own, and limits on peers that have not authenticated (time, size of what
they may send, how many at once)."""

import asyncio
import ssl
import time

import msgspec
import pytest

from infra.credentials import ensure_credentials
from shared import kv_wire
from shared.bulk import receiver as receiver_module
from shared.bulk.auth import new_nonce, sign, verify_key
from shared.bulk.framing import CONTROL_MAGIC, control_bytes
from shared.bulk.pool import BulkPool
from shared.bulk.receiver import BulkReceiver
from shared.bulk.sender import FlowRefused, open_flow
from shared.engine.hf_engine import HfEngine
from shared.messages import FlowJoin
from shared.tls import client_context, server_context
from tests.helpers import SAMPLING, SECRET, RecordingHandler, flow_open_for, prompt_of_length, until


@pytest.fixture
def creds(tmp_path):
    return ensure_credentials(tmp_path / "secrets")


async def start_receiver(
    tiny, creds, receiver_id="main-decode-0", incarnation="inc-1", tls=True, num_blocks=32, **limits
):
    engine = HfEngine(tiny, num_blocks=num_blocks)
    receiver = BulkReceiver(
        RecordingHandler(engine),
        engine.frame_expectation,
        verify_key(SECRET),
        path="wan",
        frame_timeout_s=5,
        receiver_id=receiver_id,
        incarnation=incarnation,
        tls=server_context(*peer_files(creds, "main-decode")) if tls else None,
        **limits,
    )
    host, port = await receiver.start()
    return receiver, f"{host}:{port}"


def peer_files(creds, peer: str) -> tuple[str, str, str]:
    """(CA, certificate, key) of one TLS peer of the deployment."""
    return str(creds.ca_file), str(creds.cert_file(peer)), str(creds.key_file(peer))


def ours(creds) -> ssl.SSLContext:
    return client_context(*peer_files(creds, "prefill"))


@pytest.mark.parametrize("posing_as", ["nats-a", "nats-b", "relay-decode", "wan-link"])
async def test_a_main_decoders_certificate_cannot_pose_as_another_server(creds, posing_as):
    """Each server has its own certificate for its own name: the one a main decoder's
    container holds is refused by a peer that dials anyone else."""
    server = await asyncio.start_server(
        lambda r, w: w.close(), "127.0.0.1", 0, ssl=server_context(*peer_files(creds, "main-decode"))
    )
    port = server.sockets[0].getsockname()[1]
    try:
        with pytest.raises(ssl.SSLCertVerificationError):
            await asyncio.open_connection("127.0.0.1", port, ssl=ours(creds), server_hostname=posing_as)
        _, writer = await asyncio.open_connection("127.0.0.1", port, ssl=ours(creds), server_hostname="main-decode")
        writer.close()
    finally:
        server.close()


def bound(request_id, prompt, receiver_id="main-decode-0", incarnation="inc-1"):
    return msgspec.structs.replace(
        flow_open_for(request_id, prompt), receiver_id=receiver_id, receiver_incarnation=incarnation
    )


async def test_a_flow_over_mutual_tls_is_accepted(tiny, creds):
    receiver, endpoint = await start_receiver(tiny, creds)
    try:
        flow = await open_flow(
            endpoint, bound("r", prompt_of_length(tiny, 40)), SECRET, path="wan", timeout_s=5, tls=ours(creds)
        )
        await flow.close()
    finally:
        await receiver.stop()


async def test_one_sender_holds_a_bounded_number_of_flows(tiny, creds):
    """Authenticated connections are bounded too: past its limit a sender's flow is refused, and
    a flow closed frees its place."""
    receiver, endpoint = await start_receiver(tiny, creds, max_flows_per_sender=2)
    prompt = prompt_of_length(tiny, 16)
    try:
        held = [
            await open_flow(endpoint, bound(f"r{i}", prompt), SECRET, path="wan", timeout_s=5, tls=ours(creds))
            for i in range(2)
        ]
        with pytest.raises(FlowRefused, match="too_many_flows"):
            await open_flow(endpoint, bound("r2", prompt), SECRET, path="wan", timeout_s=5, tls=ours(creds))
        await held.pop().cancel("done with it")
        sender = bound("r3", prompt).sender_id
        await until(lambda: receiver._flows_by_sender[sender] < 2, 5, "the receiver to drop the closed flow")
        held.append(await open_flow(endpoint, bound("r3", prompt), SECRET, path="wan", timeout_s=5, tls=ours(creds)))
        for flow in held:
            await flow.cancel("test over")
    finally:
        await receiver.stop()


async def test_plaintext_and_foreign_certificates_fail_the_handshake(tiny, creds, tmp_path):
    receiver, endpoint = await start_receiver(tiny, creds)
    host, port = endpoint.rsplit(":", 1)
    try:
        reader, writer = await asyncio.open_connection(host, int(port))  # plaintext
        writer.write(control_bytes(sign(bound("r", [1, 2, 3]), SECRET)))
        await writer.drain()
        reply = await asyncio.wait_for(reader.read(4096), 10)
        assert not reply.startswith(CONTROL_MAGIC)  # no answer in our protocol, just a TLS alert or EOF
        writer.close()
        foreign = ensure_credentials(tmp_path / "other")
        with pytest.raises((ssl.SSLError, ConnectionError, FlowRefused)):
            await open_flow(
                endpoint,
                bound("r", [1, 2, 3]),
                SECRET,
                path="wan",
                timeout_s=5,
                tls=client_context(str(creds.ca_file), *peer_files(foreign, "prefill")[1:]),
            )
        with pytest.raises((ssl.SSLError, ConnectionError)):  # a receiver we do not trust
            await open_flow(
                endpoint,
                bound("r", [1, 2, 3]),
                SECRET,
                path="wan",
                timeout_s=5,
                tls=client_context(*peer_files(foreign, "prefill")),
            )
    finally:
        await receiver.stop()


@pytest.mark.parametrize(
    "receiver_id,incarnation,why",
    [
        ("main-decode-1", "inc-1", "not this receiver"),  # replayed to another receiver
        ("main-decode-0", "inc-0", "earlier incarnation"),  # replayed after a restart
    ],
)
async def test_a_flow_open_for_another_receiver_or_incarnation_is_refused(tiny, creds, receiver_id, incarnation, why):
    receiver, endpoint = await start_receiver(tiny, creds)
    try:
        with pytest.raises(FlowRefused, match=why):
            await open_flow(
                endpoint,
                bound("r", [1, 2, 3], receiver_id, incarnation),
                SECRET,
                path="wan",
                timeout_s=5,
                tls=ours(creds),
            )
    finally:
        await receiver.stop()


async def test_a_receivers_own_key_cannot_open_a_flow_into_another_receiver(tiny, creds):
    """A decoder holds the verify key (bulk-verify.pub) and the deployment's certificate: with
    them it passes TLS, but whatever it signs with, its FlowOpen is refused (only prefill can
    sign), and nothing reaches the pool."""
    receiver, endpoint = await start_receiver(tiny, creds)
    handler = receiver._handler
    try:
        for stolen in (verify_key(SECRET), "another deployment's secret", creds.bulk_verify_key_file.read_text()):
            with pytest.raises(FlowRefused, match="bad signature"):
                await open_flow(
                    endpoint, bound("r", prompt_of_length(tiny, 40)), stolen, path="wan", timeout_s=5, tls=ours(creds)
                )
        assert handler.events == [] and handler.engine.num_sequences == 0
    finally:
        await receiver.stop()


async def raw_tls(endpoint: str, creds):
    host, port = endpoint.rsplit(":", 1)
    return await asyncio.open_connection(host, int(port), ssl=ours(creds), server_hostname=host)


async def test_an_oversized_control_frame_before_authentication_is_dropped_at_once(tiny, creds):
    receiver, endpoint = await start_receiver(tiny, creds)
    try:
        reader, writer = await raw_tls(endpoint, creds)
        writer.write(CONTROL_MAGIC + (16 << 20).to_bytes(4, "little"))  # declares 16 MiB
        await writer.drain()
        assert await asyncio.wait_for(reader.read(), 2) == b""  # closed, nothing buffered
        writer.close()
    finally:
        await receiver.stop()


async def test_a_silent_peer_is_dropped_and_peers_beyond_the_cap_are_refused(tiny, creds, monkeypatch):
    monkeypatch.setattr(receiver_module, "AUTH_TIMEOUT_S", 1.0)
    monkeypatch.setattr(receiver_module, "MAX_UNAUTHENTICATED", 3)
    receiver, endpoint = await start_receiver(tiny, creds)
    try:
        idle = [await raw_tls(endpoint, creds) for _ in range(3)]
        with pytest.raises((ConnectionError, ssl.SSLError)):  # over the cap: closed at once, before its handshake
            await asyncio.wait_for(raw_tls(endpoint, creds), 2)
        for reader, writer in idle:  # silent: closed once the authentication time is up
            assert await asyncio.wait_for(reader.read(), 5) == b""
            writer.close()
        flow = await open_flow(
            endpoint, bound("r", prompt_of_length(tiny, 40)), SECRET, path="wan", timeout_s=5, tls=ours(creds)
        )  # room again for an honest peer
        await flow.close()
    finally:
        await receiver.stop()


async def test_a_burst_of_flows_from_one_sender_waits_its_turn_to_dial_instead_of_being_refused(tiny, creds):
    """Three times as many flows at once as the receiver lets peers authenticate at once (a round
    of requests arriving together): every one is accepted, none dropped as over the cap."""
    num_flows = 3 * receiver_module.MAX_UNAUTHENTICATED
    receiver, endpoint = await start_receiver(tiny, creds, num_blocks=num_flows + 8)
    pool, tls = BulkPool(), ours(creds)
    try:
        flows = await asyncio.gather(
            *(
                open_flow(
                    endpoint,
                    bound(f"r{i}", prompt_of_length(tiny, 8)),
                    SECRET,
                    path="wan",
                    timeout_s=30,
                    tls=tls,
                    pool=pool,
                )
                for i in range(num_flows)
            )
        )
        assert len(flows) == num_flows
        for flow in flows:
            await flow.close()
    finally:
        pool.close()
        await receiver.stop()


async def test_a_peer_silent_before_its_tls_handshake_is_dropped_within_the_authentication_time(
    tiny, creds, monkeypatch
):
    """The authentication deadline covers the TLS handshake: a peer that connects and never
    says hello holds its place among the unauthenticated only that long."""
    monkeypatch.setattr(receiver_module, "AUTH_TIMEOUT_S", 0.5)
    receiver, endpoint = await start_receiver(tiny, creds)
    host, port = endpoint.rsplit(":", 1)
    try:
        reader, writer = await asyncio.open_connection(host, int(port))  # TCP only, no ClientHello
        assert await asyncio.wait_for(reader.read(), 5) == b""
        writer.close()
        await until(lambda: receiver._unauthenticated == 0, 5, "its place to be freed")
    finally:
        await receiver.stop()


class SlowToAccept(RecordingHandler):
    """Reserves the prompt's blocks only once told to (as when a full pool makes a flow wait)."""

    def __init__(self, engine):
        super().__init__(engine)
        self.waiting, self.go = asyncio.Event(), asyncio.Event()

    async def open_flow(self, flow_open, stats):
        self.waiting.set()
        await self.go.wait()
        return await super().open_flow(flow_open, stats)


async def test_a_sender_gone_while_its_flow_waited_leaves_no_reservation(tiny, creds):
    engine = HfEngine(tiny, num_blocks=32)
    handler = SlowToAccept(engine)
    receiver = BulkReceiver(
        handler,
        engine.frame_expectation,
        verify_key(SECRET),
        path="wan",
        frame_timeout_s=60,
        receiver_id="main-decode-0",
        incarnation="inc-1",
        tls=server_context(*peer_files(creds, "main-decode")),
    )
    host, port = await receiver.start()
    try:
        _reader, writer = await raw_tls(f"{host}:{port}", creds)
        writer.write(
            control_bytes(
                sign(
                    msgspec.structs.replace(bound("r", prompt_of_length(tiny, 40)), unix_s=time.time(), nonce="n1"),
                    SECRET,
                )
            )
        )
        await writer.drain()
        await asyncio.wait_for(handler.waiting.wait(), 5)
        writer.close()  # the sender was cancelled while its flow waited for room
        handler.go.set()
        await asyncio.wait_for(handler.aborted.wait(), 10)
        assert engine.num_sequences == 0 and engine.blocks.num_used_blocks == 0
    finally:
        await receiver.stop()


@pytest.mark.parametrize(
    "signing_secret,sender_id",
    [
        ("stolen verify key", "test"),  # a relay's credential: its certificate and bulk-verify.pub
        (SECRET, "prefill-1"),  # another prefill instance: the signing key, but not this flow's sender
    ],
)
async def test_another_roles_or_instances_valid_credential_cannot_join_a_flow(tiny, creds, signing_secret, sender_id):
    """A striped flow's further connections each authenticate on their own: a connection that
    passes mutual TLS with a relay decoder's certificate and names the flow (its nonce, which
    it should not even know) cannot join it, whatever it signs with; nor can one signed with
    the flow key for another sender. It is closed, nothing it sent is imported, and the flow
    ends with exactly the sender's own KV."""
    receiver, endpoint = await start_receiver(tiny, creds)
    handler, sender = receiver._handler, HfEngine(tiny, num_blocks=32)
    prompt = prompt_of_length(tiny, 48)
    sender.add_request("r", prompt, SAMPLING)
    first = sender.step()[0].token_id
    frames = sender.export_frames("r", 0, 48, max_tokens_per_frame=16)
    try:
        flow = await open_flow(
            endpoint, bound("r", prompt), SECRET, path="wan", timeout_s=5, tls=ours(creds), streams=2
        )
        [flow_nonce] = receiver._flows
        secret = verify_key(SECRET) if signing_secret == "stolen verify key" else signing_secret
        join = FlowJoin(
            request_id="r",
            flow_nonce=flow_nonce,
            stream=1,
            sender_id=sender_id,
            receiver_id="main-decode-0",
            receiver_incarnation="inc-1",
            unix_s=time.time(),
            nonce=new_nonce(),
        )
        host, port = endpoint.rsplit(":", 1)
        relay_tls = client_context(*peer_files(creds, "relay-decode"))
        reader, writer = await asyncio.open_connection(host, int(port), ssl=relay_tls, server_hostname="main-decode")
        writer.write(control_bytes(sign(join, secret)) + kv_wire.frame_bytes(frames[0]))
        try:  # closed, never answered (reset when the frame was still unread)
            assert await asyncio.wait_for(reader.read(), 5) == b""
        except (ConnectionError, ssl.SSLError):
            pass
        writer.close()
        for parts in frames:
            await flow.send_frame(parts)
        await flow.end([first])
        await asyncio.wait_for(handler.ended.wait(), 5)
        assert handler.events == [("open", "r"), ("frame", "r"), ("frame", "r"), ("frame", "r"), ("end", "r")]
    finally:
        await receiver.stop()
