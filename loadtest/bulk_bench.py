"""``pdd bench bulk``: what encryption costs the bulk channel, plaintext and mutual TLS side by
side in one run, on unshaped loopback and through the WAN link at a set rate.

Real sockets, the real sender and receiver with the deployment's kind of certificates, real KV
frames (exported once by the tiny model's engine, sent again and again on one flow). The
receiving end validates each frame and drops it, so the figure is the channel's, not an
engine's import speed.
"""

import asyncio
import statistics
import tempfile
import time
from pathlib import Path

import msgspec
import torch
import xxhash

from infra.credentials import ensure_credentials
from infra.wan_link import LinkProfile, Route, WanLink
from shared.bulk.auth import FlowAuthenticator, new_nonce, sign, verify_key
from shared.bulk.receiver import BulkReceiver
from shared.bulk.sender import open_flow
from shared.engine.backend import RequestStatus
from shared.engine.hf_engine import HfEngine
from shared.engine.sampling import SamplingParams
from shared.messages import FlowOpen
from shared.tls import client_context, server_context

SECRET = "bulk-bench"


class _Discard:
    """Receives a flow's frames (already validated by the receiver) and keeps none."""

    def __init__(self):
        self.done = asyncio.Event()

    async def open_flow(self, flow_open, stats):
        return 0

    async def import_frame(self, request_id, frame):
        pass

    async def end_flow(self, request_id, output_token_ids, stats):
        self.done.set()

    async def abort_flow(self, request_id, reason):
        self.done.set()


def _frames(loaded, num_tokens: int) -> tuple[list[int], list]:
    engine = HfEngine(loaded, num_blocks=num_tokens // 16 + 4)
    prompt = [(i * 7919) % 1000 + 10 for i in range(num_tokens)]
    engine.add_request("bench", prompt, SamplingParams(max_tokens=1))
    while engine.request("bench").status is RequestStatus.RUNNING:  # one prefill, one token
        engine.step()
    return prompt, [list(parts) for parts in engine.export_frames("bench", 0, num_tokens, max_tokens_per_frame=256)]


async def _one_flow(loaded, prompt, frames, total_bytes: int, tls: bool, rate_bps: float, creds) -> tuple[float, int]:
    """Send at least ``total_bytes`` of frames on one flow: (seconds, bytes sent)."""
    handler = _Discard()
    receiver = BulkReceiver(
        handler,
        HfEngine(loaded, num_blocks=4).frame_expectation,
        verify_key(SECRET),
        path="wan",
        frame_timeout_s=30,
        receiver_id="bench",
        tls=server_context(str(creds.ca_file), str(creds.cert_file("main-decode")), str(creds.key_file("main-decode")))
        if tls
        else None,
    )
    host, port = await receiver.start()
    link = None
    if rate_bps:
        link = WanLink(LinkProfile(bandwidth_bps=rate_bps, rtt_ms=0, jitter_ms=0))
        port = await link.add_route(Route("bench", "127.0.0.1", 0, host, port, from_site="site-a"))
    try:
        flow_open = _flow_open(prompt)
        context = (
            client_context(str(creds.ca_file), str(creds.cert_file("prefill")), str(creds.key_file("prefill")))
            if tls
            else None
        )
        started = time.perf_counter()
        flow = await open_flow(f"127.0.0.1:{port}", flow_open, SECRET, path="wan", timeout_s=30, tls=context)
        sent = 0
        while sent < total_bytes:
            for parts in frames:
                await flow.send_frame(parts)
            sent = flow.bytes_sent
        await flow.end([])
        await asyncio.wait_for(handler.done.wait(), 120)
        return time.perf_counter() - started, sent
    finally:
        await receiver.stop()
        if link is not None:
            await link.close()


async def _run(loaded, megabytes: int, rates: list[float], repeats: int) -> dict:
    creds = ensure_credentials(Path(tempfile.mkdtemp(prefix="pdd-bulk-bench-")) / "secrets")
    prompt, frames = _frames(loaded, 2048)
    results = {}
    for rate in rates:
        label = "loopback" if not rate else f"{rate / 1e9:g} Gbit/s link"
        runs = {"plaintext": [], "tls": []}
        for _ in range(repeats):  # interleaved, so both see the same machine noise
            for mode, rates_gbit in runs.items():
                seconds, sent = await _one_flow(loaded, prompt, frames, megabytes << 20, mode == "tls", rate, creds)
                rates_gbit.append(sent * 8 / seconds / 1e9)
        medians = {mode: statistics.median(v) for mode, v in runs.items()}
        results[label] = {
            "gbit_per_s": {m: [round(x, 3) for x in v] for m, v in runs.items()},
            "median_gbit_per_s": {m: round(x, 3) for m, x in medians.items()},
            "tls_over_plaintext": round(medians["tls"] / medians["plaintext"], 3),
        }
    results["receiver_checks"] = receiver_checks(frames, prompt)
    return results


def _gb_per_s(work, nbytes: int, repeats: int = 5) -> float:
    """Best of ``repeats`` timings of ``work()``, as GB/s over ``nbytes``."""
    best = min(_timed(work) for _ in range(repeats))
    return round(nbytes / best / 1e9, 2)


def _timed(work) -> float:
    started = time.perf_counter()
    work()
    return time.perf_counter() - started


def receiver_checks(frames: list, prompt: list[int], megabytes: int = 128, flows: int = 200) -> dict:
    """What each check of the receive path costs on real KV frames (repeated to ``megabytes``,
    beyond the caches), one core, beside memcpy."""
    one_pass = b"".join(bytes(parts[-1]) for parts in frames)
    bodies = one_pass * max(1, (megabytes << 20) // len(one_pass))
    nbytes = len(bodies)
    values = torch.frombuffer(bytearray(bodies), dtype=torch.float32)
    copy_into = torch.empty_like(values)
    authenticator = FlowAuthenticator(verify_key(SECRET), "bench")
    flow_open = _flow_open(prompt)
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
        "memcpy_gb_per_s": _gb_per_s(lambda: copy_into.copy_(values), nbytes),
        "xxh3_checksum_gb_per_s": _gb_per_s(lambda: xxhash.xxh3_64_intdigest(bodies), nbytes),
        "finite_check_gb_per_s": _gb_per_s(lambda: bool(torch.isfinite(values.sum(dtype=torch.float32))), nbytes),
        "flow_open_sign_us": round(sign_s * 1e6, 1),
        "flow_open_verify_us": round(verify_us, 1),
        "prompt_tokens": len(prompt),
    }


def loopback_bytes_per_s(loaded, megabytes: int = 64, repeats: int = 3, tls: bool = False) -> float:
    """The bulk channel's rate on unshaped loopback (median of ``repeats`` flows): what one
    KV flow on a deployment's local path gets when nothing else competes for the machine."""

    async def measure() -> float:
        creds = ensure_credentials(Path(tempfile.mkdtemp(prefix="pdd-bulk-bench-")) / "secrets")
        prompt, frames = _frames(loaded, 1024)
        rates = []
        for _ in range(repeats):
            seconds, sent = await _one_flow(loaded, prompt, frames, megabytes << 20, tls, 0.0, creds)
            rates.append(sent / seconds)
        return statistics.median(rates)

    return asyncio.run(measure())


def run_bulk_bench(loaded, megabytes: int = 256, rates: tuple[float, ...] = (0.0, 1e9), repeats: int = 3) -> dict:
    """Throughput per mode and link, and the TLS/plaintext ratio of the medians."""
    return asyncio.run(_run(loaded, megabytes, list(rates), repeats))


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
