"""A streaming client that stops reading is dropped within ``--sse-write-timeout-s`` and every
engine frees its request; other clients are served meanwhile."""

import asyncio
import json
import socket
import time
from urllib.parse import urlparse

import aiohttp

from shared.metrics import SLOW_CLIENTS
from tests.helpers import engines_idle, until

WRITE_TIMEOUT_S = 1.0


async def open_stream_and_never_read(base_url: str, body: dict) -> socket.socket:
    """Send a streaming request on a socket with a tiny receive window, and read nothing."""
    url = urlparse(base_url)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, (url.hostname, url.port))
    payload = json.dumps(body).encode()
    request = (
        f"POST {url.path}/chat/completions HTTP/1.1\r\nHost: {url.netloc}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n"
    ).encode() + payload
    await asyncio.get_running_loop().sock_sendall(sock, request)
    return sock


async def test_a_client_that_stops_reading_is_dropped_and_its_kv_freed(make_stack):
    stack = await make_stack(router_settings={"sse_write_timeout_s": WRITE_TIMEOUT_S, "pipeline_policy": "P-MD"})
    dropped_before = SLOW_CLIENTS._value.get()
    # Log-probabilities make every event ~2 KB, so the socket buffers fill within ~100 tokens.
    sock = await open_stream_and_never_read(
        stack.base_url,
        {
            "model": "tiny",
            "stream": True,
            "max_tokens": 3000,
            "ignore_eos": True,
            "logprobs": True,
            "top_logprobs": 20,
            "messages": [{"role": "user", "content": "Talk for a long time."}],
        },
    )
    try:
        await until(lambda: stack.mains[0].engine.num_sequences == 1, 15, "main decode to start")
        started = time.monotonic()
        await until(lambda: SLOW_CLIENTS._value.get() == dropped_before + 1, 30, "the router to drop the client")
        await until(lambda: engines_idle(stack), 15, "every engine to free the request")
        assert time.monotonic() - started < 30
        async with (
            aiohttp.ClientSession() as session,
            session.post(
                stack.base_url + "/chat/completions",
                json={"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]},
            ) as reply,
        ):
            assert reply.status == 200 and (await reply.json())["usage"]["completion_tokens"] == 4
    finally:
        sock.close()


async def test_a_client_that_read_plain_events_then_stopped_is_dropped(make_stack):
    """Plain content events go out straight from the router's mailbox callback while the client
    keeps up; once it stops reading they wait, with the timeout, like any other write. The
    stand-in engine steps every 2 ms, so ~250-byte events fill the socket buffers in seconds."""
    stack = await make_stack(
        router_settings={"sse_write_timeout_s": WRITE_TIMEOUT_S, "pipeline_policy": "P-MD"},
        engines=dict.fromkeys(("prefill", "relay_decode", "main_decode"), "standin"),
        engine_settings={"standin_step_ms": 2},
    )
    dropped_before = SLOW_CLIENTS._value.get()
    body = {
        "model": "tiny",
        "stream": True,
        "max_tokens": 3000,
        "ignore_eos": True,
        "messages": [{"role": "user", "content": "Talk on."}],
    }
    sock = await open_stream_and_never_read(stack.base_url, body)
    try:
        received, loop = 0, asyncio.get_running_loop()
        while received < 16_000:  # the stream flows: well past the first event
            received += len(await asyncio.wait_for(loop.sock_recv(sock, 4096), 15))
        # A fixed send buffer on the router's side of the connection: loopback's autotuned one
        # (up to 4 MiB) would hold the whole answer.
        [handler] = stack.router.api._runner.server.connections
        handler.transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 8192)
        started = time.monotonic()
        await until(lambda: SLOW_CLIENTS._value.get() == dropped_before + 1, 30, "the router to drop the client")
        await until(
            lambda: not any(e.engine.request_ids() for e in [stack.prefill, *stack.mains]), 15, "the engines to free it"
        )
        assert time.monotonic() - started < 30
    finally:
        sock.close()
