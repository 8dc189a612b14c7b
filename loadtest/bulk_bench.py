"""``pdd bench bulk``: the bulk channel against this machine's own limits, side by side.

Each repeat measures, back to back so all of them see the same machine noise: a raw socket
pump on loopback (``loadtest.raw_pump``: the ceiling for Python on this machine), our channel
(the real ``open_flow`` sender and ``BulkReceiver``, real KV wire frames, every frame validated
by the receiver and then dropped, so the figure is the channel's, not an engine's import
speed; on TLS the receiver skips the body's xxh3, which TLS's own authentication makes
redundant), each in plaintext and in mutual TLS with the deployment's kind of certificates
(same contexts, so the same cipher suite), and memcpy on one core. Rates are Gbit/s (1e9 bits per
second), each timed from the first KV byte sent to the last received (connection and
handshake excluded, for the pump and the channel alike).

Frames: KV of a given geometry (default SmolLM2-135M's: 30 layers × 3 KV heads × 64, float32,
45 KiB per token, 11.8 MB per 256-token frame) encoded by the wire's own ``encode_frames``
from random values, as an engine's export encodes its cache.
"""

import asyncio
import contextlib
import ssl
import statistics
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import msgspec
import torch
import xxhash

from infra.credentials import Credentials, ensure_credentials
from infra.wan_link import LinkProfile, Route, WanLink
from loadtest.bulk_peer import RECEIVER_NAME, Discard, PeerSetup, ReceivingPeer
from loadtest.raw_pump import PUMP_BUFFER_BYTES, Pumped, memcpy_seconds, now_s, send_pump
from shared.bulk.auth import FlowAuthenticator, new_nonce, sign, verify_key
from shared.bulk.path_sizing import plan_path
from shared.bulk.receiver import BulkReceiver
from shared.bulk.sender import open_flow
from shared.engine.backend import RequestStatus
from shared.engine.hf_engine import HfEngine
from shared.engine.sampling import SamplingParams
from shared.kv_layout import DEFAULT_BLOCK_SIZE, KvLayout
from shared.kv_wire import FrameExpectation, body_checks, encode_frames, values_are_finite
from shared.messages import FlowOpen
from shared.tls import client_context, server_context

SECRET = "bulk-bench"
TLS_NAME = RECEIVER_NAME
SMOLLM2_GEOMETRY = (30, 3, 64)
"""SmolLM2-135M's KV: layers, KV heads, head dim (its config.json)."""
TIMEOUT_S = 120.0
"""Longest one measured flow may take."""


@dataclass(frozen=True)
class BenchKv:
    """What the benchmark sends: one prompt's frames and what the receiver accepts."""

    prompt: list[int]
    frames: list[list]
    expectation: FrameExpectation

    @property
    def frame_bytes(self) -> int:
        """Size of the first (largest) frame on the wire."""
        return sum(memoryview(part).nbytes for part in self.frames[0])


@dataclass(frozen=True)
class Contexts:
    """One deployment's TLS contexts: the receiver's (server) and the sender's (client)."""

    server: ssl.SSLContext
    client: ssl.SSLContext


def synthetic_kv(
    geometry: tuple[int, int, int] = SMOLLM2_GEOMETRY,
    dtype: str = "float32",
    prompt_tokens: int = 2048,
    frame_tokens: int = 256,
) -> BenchKv:
    """Frames of random KV in ``geometry`` (layers, KV heads, head dim), ``frame_tokens`` per frame."""
    num_layers, num_kv_heads, head_dim = geometry
    layout = KvLayout(num_layers, num_kv_heads, head_dim, DEFAULT_BLOCK_SIZE, getattr(torch, dtype))
    kv = torch.randn(num_layers, 2, prompt_tokens, num_kv_heads, head_dim).to(layout.dtype)
    prompt = _prompt(prompt_tokens)
    frames = encode_frames(
        lambda start, end: kv[:, :, start:end],
        prompt,
        0,
        prompt_tokens,
        block_size=layout.block_size,
        model_fingerprint="bulk-bench",
        request_id="bench",
        max_tokens_per_frame=frame_tokens,
    )
    return BenchKv(prompt, frames, FrameExpectation("bulk-bench", layout))


def engine_kv(loaded, prompt_tokens: int) -> BenchKv:
    """Frames ``loaded``'s engine exports after prefilling a prompt (the deployment's 256 tokens each)."""
    engine = HfEngine(loaded, num_blocks=prompt_tokens // 16 + 4)
    prompt = _prompt(prompt_tokens)
    engine.add_request("bench", prompt, SamplingParams(max_tokens=1))
    while engine.request("bench").status is RequestStatus.RUNNING:  # one prefill, one token
        engine.step()
    frames = [list(parts) for parts in engine.export_frames("bench", 0, prompt_tokens, max_tokens_per_frame=256)]
    return BenchKv(prompt, frames, HfEngine(loaded, num_blocks=4).frame_expectation)


def _prompt(num_tokens: int) -> list[int]:
    return [(i * 7919) % 1000 + 10 for i in range(num_tokens)]


@dataclass(frozen=True)
class Sent:
    """One measured flow: bytes, seconds from the first KV byte to the last frame validated,
    and the TLS cipher suite (None: plaintext)."""

    nbytes: int
    seconds: float
    cipher: str | None


async def _one_flow(
    kv: BenchKv,
    nbytes: int,
    tls: Contexts | None,
    profile: LinkProfile | None = None,
    streams: int = 1,
    buffer_bytes: int = 0,
) -> Sent:
    """Send at least ``nbytes`` of ``kv``'s frames on one flow striped over ``streams``
    connections (socket buffers of ``buffer_bytes``, 0: autotuned), through a WAN link with ``profile`` if given (the time runs to the receiver's
    end of the flow)."""
    handler = Discard()
    receiver = BulkReceiver(
        handler,
        kv.expectation,
        verify_key(SECRET),
        path="wan",
        frame_timeout_s=TIMEOUT_S,
        receiver_id="bench",
        tls=tls.server if tls else None,
    )
    host, port = await receiver.start()
    link = None
    if profile is not None:
        link = WanLink(replace(profile))
        port = await link.add_route(Route("bench", "127.0.0.1", 0, host, port, from_site="site-a"))
    try:
        nbytes_sent, started, cipher = await _send(port, kv, nbytes, tls, streams, buffer_bytes)
        await asyncio.wait_for(handler.done.wait(), TIMEOUT_S)
        if handler.aborted:
            raise RuntimeError(f"the benchmark's flow was aborted: {handler.aborted}")
        return Sent(nbytes_sent, now_s() - started, cipher)
    finally:
        await receiver.stop()
        if link is not None:
            await link.close()


@contextlib.contextmanager
def _credentials() -> Iterator[Credentials]:
    """A fresh deployment's credentials, in a folder removed afterwards."""
    with tempfile.TemporaryDirectory(prefix="pdd-bulk-bench-") as folder:
        yield ensure_credentials(Path(folder) / "secrets")


def _contexts(creds: Credentials) -> Contexts:
    """The receiver's and the sender's TLS contexts, from ``creds``."""
    return Contexts(
        server_context(str(creds.ca_file), str(creds.cert_file(TLS_NAME)), str(creds.key_file(TLS_NAME))),
        client_context(str(creds.ca_file), str(creds.cert_file("prefill")), str(creds.key_file("prefill"))),
    )


async def _flow_to_peer(peer: ReceivingPeer, kv: BenchKv, nbytes: int, tls: Contexts | None, streams: int = 1) -> Sent:
    """Our channel on loopback: this process sends at least ``nbytes`` of ``kv``'s frames on one
    flow (over ``streams`` connections) to a ``BulkReceiver`` in ``peer``'s process; the time
    runs from the first KV byte sent to the receiver's end of the flow."""
    nbytes_sent, started, cipher = await _send(peer.listen("ours", tls is not None), kv, nbytes, tls, streams)
    finished = await asyncio.to_thread(peer.finished_s)
    return Sent(nbytes_sent, finished - started, cipher)


async def _send(
    port: int, kv: BenchKv, nbytes: int, tls: Contexts | None, streams: int = 1, buffer_bytes: int = 0
) -> tuple[int, float, str | None]:
    """Open one flow to 127.0.0.1:``port`` and send at least ``nbytes`` of ``kv``'s frames, then
    its end. Returns the bytes sent, when the first KV byte left (``now_s``) and the TLS cipher
    suite (None: plaintext)."""
    flow = await open_flow(
        f"127.0.0.1:{port}",
        _flow_open(kv.prompt),
        SECRET,
        path="wan",
        timeout_s=30,
        tls=tls.client if tls else None,
        tls_name=TLS_NAME,
        streams=streams,
        buffer_bytes=buffer_bytes,
    )
    cipher, started = flow.tls_cipher, now_s()
    while flow.bytes_sent < nbytes:
        for parts in kv.frames:
            await flow.send_frame(parts)
    await flow.end([])
    return flow.bytes_sent, started, cipher


def _pump_to_peer(peer: ReceivingPeer, nbytes: int, tls: Contexts | None) -> Pumped:
    """The raw pump on loopback, its receiving side in ``peer``'s process."""
    total = -(-nbytes // PUMP_BUFFER_BYTES) * PUMP_BUFFER_BYTES
    port = peer.listen("pump", tls is not None, total)
    return send_pump(port, total, peer.finished_s, tls.client if tls else None, TLS_NAME)


def _gbps(nbytes: int, seconds: float) -> float:
    return round(nbytes * 8 / seconds / 1e9, 2)


LOOPBACK_RATES = ("raw_plain", "ours_plain", "raw_tls", "ours_tls", "ours_tls_two_streams", "memcpy")


def measure_loopback(kv: BenchKv, megabytes: int, repeats: int, creds: Credentials) -> dict:
    """Per repeat, back to back: raw pump and our channel, plaintext then TLS (then our TLS
    flow striped over two connections, whose encryption runs on two threads), then memcpy.
    Each transfer's receiving side runs in a process of its own (``bulk_peer``), as in a
    deployment, which first takes one untimed flow. Returns the runs (Gbit/s) and the TLS
    cipher suites each side negotiated."""
    nbytes = megabytes << 20
    tls = _contexts(creds)
    runs: dict[str, list[float]] = {k: [] for k in LOOPBACK_RATES}
    ciphers = {}
    with ReceivingPeer(PeerSetup(kv.expectation, SECRET, creds, TIMEOUT_S)) as peer:
        asyncio.run(_flow_to_peer(peer, kv, nbytes, None))  # untimed: a long-running receiver's heap is warm
        for _ in range(repeats):
            for mode, contexts in (("plain", None), ("tls", tls)):
                pumped = _pump_to_peer(peer, nbytes, contexts)
                runs[f"raw_{mode}"].append(_gbps(pumped.nbytes, pumped.seconds))
                sent = asyncio.run(_flow_to_peer(peer, kv, nbytes, contexts))
                runs[f"ours_{mode}"].append(_gbps(sent.nbytes, sent.seconds))
                if contexts:
                    ciphers = {"raw": pumped.cipher, "ours": sent.cipher}
            striped = asyncio.run(_flow_to_peer(peer, kv, nbytes, tls, streams=2))
            runs["ours_tls_two_streams"].append(_gbps(striped.nbytes, striped.seconds))
            runs["memcpy"].append(_gbps(PUMP_BUFFER_BYTES, memcpy_seconds()))
    return {"runs": runs, "tls_ciphers": ciphers}


def measure_link(kv: BenchKv, megabytes: int, repeats: int, tls: Contexts, profile: LinkProfile) -> dict:
    """Through the WAN link with ``profile`` (its window caps one connection at window / RTT):
    our channel (mutual TLS, as on the WAN path) with one stream and with the default stream
    count (``path_sizing.plan_path`` for the link's rate, RTT and window: what prefill
    uses), and the emulator's own ceiling, a raw sender with one and with four streams, runs
    interleaved. Medians in Gbit/s; ``window_cap_gbps`` is window × 8 / RTT."""
    from infra.wan_link_probe import measure_streams

    plan = plan_path(profile.bandwidth_bps, profile.rtt_ms, profile.window_bytes)
    runs: dict[str, list[float]] = {k: [] for k in ("ours_one_stream", "ours_default", "raw_one_stream")}
    runs["raw_four_streams"] = []
    for _ in range(repeats):
        sent = asyncio.run(_one_flow(kv, megabytes << 20, tls, profile))
        runs["ours_one_stream"].append(_gbps(sent.nbytes, sent.seconds))
        sent = asyncio.run(_one_flow(kv, megabytes << 20, tls, profile, plan.streams, plan.buffer_bytes))
        runs["ours_default"].append(_gbps(sent.nbytes, sent.seconds))
        runs["raw_one_stream"].append(round(asyncio.run(measure_streams(profile, 1, megabytes)), 2))
        runs["raw_four_streams"].append(round(asyncio.run(measure_streams(profile, 4, megabytes)), 2))
    medians = {name: statistics.median(rates) for name, rates in runs.items()}
    rtt_s = profile.rtt_ms / 1000
    return {
        "rate_gbps": profile.bandwidth_bps / 1e9,
        "rtt_ms": profile.rtt_ms,
        "window_bytes": profile.window_bytes,
        "window_cap_gbps": round(profile.window_bytes * 8 / rtt_s / 1e9, 3) if profile.window_bytes and rtt_s else None,
        "one_stream_gbps": medians["ours_one_stream"],
        "default_streams": plan.streams,
        "default_buffer_bytes": plan.buffer_bytes,
        "default_gbps": medians["ours_default"],
        "raw_one_stream_gbps": medians["raw_one_stream"],
        "raw_four_streams_gbps": medians["raw_four_streams"],
        "megabytes_per_run": megabytes,
        "runs_gbps": runs,
    }


def run_bulk_bench(
    megabytes: int = 256,
    repeats: int = 3,
    *,
    geometry: tuple[int, int, int] = SMOLLM2_GEOMETRY,
    dtype: str = "float32",
    frame_tokens: int = 256,
    prompt_tokens: int = 2048,
    link: LinkProfile | None = None,
    link_megabytes: int = 200,
    checks_megabytes: int = 128,
) -> dict:
    """The comparison as one dict: medians (``*_gbps``), the ratios of ours to the raw pump
    (``ours_over_raw_*``: median over repeats of the two measured back to back), every run,
    the setup, ``link`` (through a WAN link with that profile; None without) and the receiver's
    checks one by one."""
    kv = synthetic_kv(geometry, dtype, prompt_tokens, frame_tokens)
    with _credentials() as creds:
        loopback = measure_loopback(kv, megabytes, repeats, creds)
        tls = _contexts(creds)
    runs = loopback["runs"]
    report = {f"{name}_gbps": statistics.median(rates) for name, rates in runs.items()}
    for mode in ("plain", "tls"):
        ratios = [ours / raw for ours, raw in zip(runs[f"ours_{mode}"], runs[f"raw_{mode}"], strict=True)]
        report[f"ours_over_raw_{mode}"] = round(statistics.median(ratios), 3)
    report.update(
        units="*_gbps: Gbit/s (1e9 bits per second), memcpy included; receiver_checks: GB/s and µs",
        runs_gbps=runs,
        setup={
            "megabytes_per_run": megabytes,
            "repeats": repeats,
            "kv_geometry": "x".join(map(str, geometry)),
            "dtype": dtype,
            "frame_tokens": frame_tokens,
            "frame_bytes": kv.frame_bytes,
            "raw_pump_buffer_bytes": PUMP_BUFFER_BYTES,
            "loopback_receiver": "its own process, for the pump and our channel alike",
            "tls_ciphers": loopback["tls_ciphers"],
        },
        link=measure_link(_kv_for(link_megabytes, geometry, dtype, frame_tokens), link_megabytes, repeats, tls, link)
        if link is not None
        else None,
        receiver_checks=receiver_checks(kv, checks_megabytes),
    )
    return report


def _kv_for(megabytes: int, geometry: tuple[int, int, int], dtype: str, frame_tokens: int) -> BenchKv:
    """Frames of one prompt long enough that a flow of ``megabytes`` sends each frame once, in
    the prompt's order (so a striped flow's receiver reorders real positions, never a repeat)."""
    probe = synthetic_kv(geometry, dtype, frame_tokens, frame_tokens)
    frames = -(-(megabytes << 20) // probe.frame_bytes)
    return synthetic_kv(geometry, dtype, frames * frame_tokens, frame_tokens)


def format_report(report: dict) -> str:
    """The comparison as a table for a terminal."""
    runs, setup = report["runs_gbps"], report["setup"]

    def cell(name: str) -> str:
        return f"{report[name + '_gbps']:7.2f}  ({', '.join(f'{x:.2f}' for x in runs[name])})"

    title = (
        f"bulk channel on loopback, Gbit/s: median (runs), {setup['repeats']} × {setup['megabytes_per_run']} MiB, "
        f"frames of {setup['frame_bytes'] / 1e6:.1f} MB ({setup['kv_geometry']} {setup['dtype']}, "
        f"{setup['frame_tokens']} tokens)"
    )
    lines = [
        title,
        f"{'':12}{'raw socket pump':34}{'our channel':34}ours / raw",
        f"{'plaintext':12}{cell('raw_plain'):34}{cell('ours_plain'):34}{report['ours_over_raw_plain']:.2f}",
        f"{'mutual TLS':12}{cell('raw_tls'):34}{cell('ours_tls'):34}{report['ours_over_raw_tls']:.2f}",
        f"{'':12}{'':34}{cell('ours_tls_two_streams'):34}(one flow striped over two connections)",
        f"{'memcpy':12}{cell('memcpy')}  (one core)",
        f"TLS cipher suites: {setup['tls_ciphers']}",
    ]
    if report["link"]:
        link = report["link"]
        head = (
            f"through the WAN link at {link['rate_gbps']:g} Gbit/s, {link['rtt_ms']:g} ms RTT, a window of "
            f"{link['window_bytes']} bytes (cap {link['window_cap_gbps']} Gbit/s per stream), "
            f"{link['megabytes_per_run']} MiB per run, Gbit/s:"
        )
        ours = (
            f"  our channel (TLS): one stream {link['one_stream_gbps']:.2f}, default "
            f"({link['default_streams']} streams, from the link's bandwidth-delay product) {link['default_gbps']:.2f}"
        )
        raw = (
            f"  the emulator with a raw sender: one stream {link['raw_one_stream_gbps']:.2f}, "
            f"four streams {link['raw_four_streams_gbps']:.2f}"
        )
        lines += [head, ours, raw]
    checks = report["receiver_checks"]
    lines.append(
        f"receiver checks, one core, GB/s: xxh3 {checks['xxh3_checksum_gb_per_s']}, finiteness "
        f"{checks['finite_check_gb_per_s']}, both in one pass (as the receiver runs them) "
        f"{checks['both_checks_gb_per_s']}; FlowOpen sign {checks['flow_open_sign_us']} µs, verify "
        f"{checks['flow_open_verify_us']} µs"
    )
    return "\n".join(lines)


def _gb_per_s(work, nbytes: int, repeats: int = 5) -> float:
    """Best of ``repeats`` timings of ``work()``, as GB/s over ``nbytes``."""
    best = min(_timed(work) for _ in range(repeats))
    return round(nbytes / best / 1e9, 2)


def _timed(work) -> float:
    started = time.perf_counter()
    work()
    return time.perf_counter() - started


def receiver_checks(kv: BenchKv, megabytes: int = 128, flows: int = 200) -> dict:
    """What each check of the receive path costs on ``kv``'s frame bodies (repeated to
    ``megabytes``, beyond the caches), on one core: each alone, and both in the one pass the
    receiver runs (``kv_wire.body_checks``, plaintext: with the xxh3)."""
    one_pass = b"".join(bytes(parts[-1]) for parts in kv.frames)
    bodies = memoryview(one_pass * max(1, (megabytes << 20) // len(one_pass)))
    nbytes = len(bodies)
    dtype = str(kv.expectation.layout.dtype).removeprefix("torch.")
    authenticator = FlowAuthenticator(verify_key(SECRET), "bench")
    flow_open = _flow_open(kv.prompt)
    opens = [
        sign(msgspec.structs.replace(flow_open, unix_s=time.time(), nonce=new_nonce()), SECRET) for _ in range(flows)
    ]
    started = time.perf_counter()
    problems = [authenticator.verify(signed) for signed in opens]
    verify_us = (time.perf_counter() - started) / flows * 1e6
    assert not any(problems), problems[:1]
    sign_s = _timed(lambda: sign(flow_open, SECRET))
    return {
        "bytes": nbytes,
        "xxh3_checksum_gb_per_s": _gb_per_s(lambda: xxhash.xxh3_64_intdigest(bodies), nbytes),
        "finite_check_gb_per_s": _gb_per_s(lambda: values_are_finite(bodies, dtype), nbytes),
        "both_checks_gb_per_s": _gb_per_s(lambda: body_checks(bodies, dtype, True), nbytes),
        "flow_open_sign_us": round(sign_s * 1e6, 1),
        "flow_open_verify_us": round(verify_us, 1),
        "prompt_tokens": len(kv.prompt),
    }


def loopback_bytes_per_s(loaded, megabytes: int = 64, repeats: int = 3, tls: bool = False) -> float:
    """The bulk channel's rate on unshaped loopback (median of ``repeats`` flows of the frames
    ``loaded``'s engine exports): what one KV flow on a deployment's local path gets when
    nothing else competes for the machine."""
    kv = engine_kv(loaded, 1024)
    contexts = None
    if tls:
        with _credentials() as creds:
            contexts = _contexts(creds)
    rates = []
    for _ in range(repeats):
        sent = asyncio.run(_one_flow(kv, megabytes << 20, contexts))
        rates.append(sent.nbytes / sent.seconds)
    return statistics.median(rates)


def _flow_open(prompt: list[int]) -> FlowOpen:
    """The benchmark's one flow, opened for main decode (signed by the caller)."""
    return FlowOpen(
        request_id="bench",
        role="main_decode",
        token_ids=prompt,
        sampling=SamplingParams(max_tokens=1),
        seed=0,
        sender_id="bench",
        receiver_id="bench",
        unix_s=0.0,
        nonce="",
    )
