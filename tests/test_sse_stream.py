"""The control-plane bench's lean streaming client on real sockets: HTTP/1.1 framing however the
bytes are cut, each event stamped when its bytes arrived, errors as the server sent them, and
one kept-alive connection for a client's requests."""

import asyncio
import json
import time

import pytest

from loadtest.sse_stream import HttpStreamError, SseConnection


def chunked(payload: bytes) -> bytes:
    return b"%x\r\n%b\r\n" % (len(payload), payload)


def event(body: dict) -> bytes:
    return b"data: " + json.dumps(body).encode() + b"\n\n"


class RawServer:
    """An HTTP/1.1 server on a free port that answers each request with ``respond(writer)``,
    counting the connections it accepted."""

    def __init__(self, respond):
        self.respond, self.connections, self.requests = respond, 0, []
        self.server = None

    async def __aenter__(self):
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return self

    async def __aexit__(self, *exc):
        self.server.close()
        await self.server.wait_closed()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}/v1/completions"

    async def _serve(self, reader, writer):
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(
                    next(h for h in head.split(b"\r\n") if h.lower().startswith(b"content-length")).split(b":")[1]
                )
                self.requests.append((head, await reader.readexactly(length)))
                await self.respond(writer)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


async def test_events_split_anywhere_by_the_network_arrive_whole_and_in_order():
    events = [event({"choices": [{"text": f"tok{i} \u00e9", "finish_reason": None}]}) for i in range(5)]
    body = b"".join(chunked(e) for e in events) + b"0\r\n\r\n"
    head = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"

    async def respond(writer):
        wire = head + body
        for start in range(0, len(wire), 7):  # cuts through headers, chunk sizes and events
            writer.write(wire[start : start + 7])
            await writer.drain()

    async with RawServer(respond) as server:
        connection = SseConnection(server.url, {"Authorization": "Bearer k"})
        response = await connection.post(b'{"prompt": "x"}', timeout_s=10)
        connection.close()
    assert response.status == 200
    assert [json.loads(e) for e in response.events] == [json.loads(e[6:]) for e in events]
    assert response.times_s == sorted(response.times_s)
    request_head, request_body = server.requests[0]
    assert request_head.startswith(b"POST /v1/completions HTTP/1.1\r\n") and b"Authorization: Bearer k" in request_head
    assert request_body == b'{"prompt": "x"}'


async def test_each_event_is_stamped_when_its_bytes_arrived_not_when_the_response_ended():
    written_first, go_on = asyncio.Event(), asyncio.Event()

    async def respond(writer):
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + chunked(event({"n": 1})))
        await writer.drain()
        written_first.set()
        await go_on.wait()
        writer.write(chunked(event({"n": 2})) + b"0\r\n\r\n")
        await writer.drain()

    async with RawServer(respond) as server:
        connection = SseConnection(server.url)
        answer = asyncio.create_task(connection.post(b"{}", timeout_s=10))
        await written_first.wait()
        marked_s = time.perf_counter()
        go_on.set()
        response = await answer
        connection.close()
    assert [json.loads(e) for e in response.events] == [{"n": 1}, {"n": 2}]
    assert response.times_s[0] < response.times_s[1] and response.times_s[1] >= marked_s


async def test_an_error_response_comes_back_with_its_status_and_body_on_the_same_connection():
    answers = [
        b'HTTP/1.1 429 Too Many Requests\r\nContent-Type: application/json\r\nContent-Length: 24\r\n\r\n{"error": {"code": 429}}',
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + chunked(event({"n": 1})) + b"0\r\n\r\n",
    ]

    async def respond(writer):
        writer.write(answers.pop(0))
        await writer.drain()

    async with RawServer(respond) as server:
        connection = SseConnection(server.url)
        refused = await connection.post(b"{}", timeout_s=10)
        served = await connection.post(b"{}", timeout_s=10)
        connection.close()
    assert refused.status == 429 and json.loads(refused.body) == {"error": {"code": 429}} and refused.events == []
    assert served.status == 200 and served.events == [b'{"n": 1}']
    assert server.connections == 1  # kept alive across the client's requests


async def test_a_connection_closed_mid_response_is_an_error_and_the_next_request_reconnects():
    answers = [
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + chunked(event({"n": 1})),  # then closed
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + chunked(event({"n": 2})) + b"0\r\n\r\n",
    ]

    async def respond(writer):
        last = len(answers) == 2
        writer.write(answers.pop(0))
        await writer.drain()
        if last:
            raise ConnectionError("server gives up")

    async with RawServer(respond) as server:
        connection = SseConnection(server.url)
        with pytest.raises(HttpStreamError, match="closed mid-response"):
            await connection.post(b"{}", timeout_s=10)
        served = await connection.post(b"{}", timeout_s=10)
        connection.close()
    assert served.events == [b'{"n": 2}'] and server.connections == 2


def test_only_plain_http_urls_are_taken():
    with pytest.raises(ValueError, match="https://"):
        SseConnection("https://127.0.0.1:8000/v1/completions")
