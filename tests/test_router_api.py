"""The router's HTTP surface: discovery endpoints and OpenAI-style errors for bad input."""

import asyncio
import json
import time

import aiohttp
import pytest

from tests.helpers import post


@pytest.fixture
async def stack(make_stack):
    return await make_stack(router_settings={"pipeline_policy": "P-MD"})


async def get(stack, path: str):
    async with aiohttp.ClientSession() as session:
        async with session.get(stack.base_url.removesuffix("/v1") + path) as response:
            return response.status, await response.text()


async def test_models_health_and_metrics(stack):
    status, body = await get(stack, "/v1/models")
    assert status == 200 and '"id": "tiny"' in body
    status, body = await get(stack, "/health")
    assert status == 200 and "main-decode-0" in body and "relay-decode-0" in body
    await post(
        stack, "/chat/completions", {"model": "tiny", "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]}
    )
    status, body = await get(stack, "/metrics")
    assert status == 200
    assert (
        'pdd_requests_total{finish_reason="length",finished_on="MD",model_name="tiny",outcome="ok",pipeline="P-MD"}'
        in body
    )
    assert "pdd_kv_bytes_total" in body and "pdd_ttft_seconds_bucket" in body


BAD_CHAT_REQUESTS = [
    ("{not json", 400, None, None),
    ('["a list"]', 400, None, None),
    ({"model": "gpt-9", "messages": [{"role": "user", "content": "hi"}]}, 404, "model_not_found", "model"),
    ({"model": "tiny", "messages": []}, 400, None, "messages"),
    ({"model": "tiny", "messages": [{"role": "wizard", "content": "hi"}]}, 400, None, "messages"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, 400, None, "max_tokens"),
    (
        {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": -3},
        400,
        None,
        "max_completion_tokens",
    ),
    ({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "temperature": 3}, 400, None, "temperature"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "top_p": 0}, 400, None, "top_p"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stop": [1]}, 400, None, "stop"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "n": 2}, 400, None, "n"),
    (
        {"model": "tiny", "messages": [{"role": "user", "content": "word " * 5000}]},
        400,
        "context_length_exceeded",
        "messages",
    ),
    ({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "seed": 2**70}, 400, None, "seed"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "seed": -(2**64)}, 400, None, "seed"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stop": "x" * 600}, 400, None, "stop"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "top_p": 1.5}, 400, None, "top_p"),
]


async def test_bad_chat_requests_get_openai_errors(stack):
    """One server for every case (each is independent: a refused request leaves nothing behind)."""
    for body, status, code, param in BAD_CHAT_REQUESTS:
        got_status, got = await post(stack, "/chat/completions", body, raw=isinstance(body, str))
        assert got_status == status, (body, got)
        error = got["error"]
        assert error["message"] and error["type"] == "invalid_request_error", body
        assert error["code"] == code and error["param"] == param, (body, error)


async def test_bad_completion_prompt(stack):
    status, body = await post(stack, "/completions", {"model": "tiny", "prompt": [1, -5]})
    assert status == 400 and body["error"]["param"] == "prompt"


async def test_stop_string_is_cut_from_the_text(stack, tiny):
    from tests.helpers import chat_prompt, expected_text

    content = "Count the waves."
    full = expected_text(tiny, chat_prompt(tiny, content), 30)
    stop = full[len(full) // 2 : len(full) // 2 + 4]
    status, body = await post(
        stack,
        "/chat/completions",
        {
            "model": "tiny",
            "messages": [{"role": "user", "content": content}],
            "max_tokens": 30,
            "temperature": 0,
            "stop": stop,
            "ignore_eos": True,
        },
    )
    assert status == 200
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["choices"][0]["message"]["content"] == full[: full.index(stop)]


async def raw_post(stack, path: str, data: bytes, headers: dict) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as session:
        async with session.post(stack.base_url + path, data=data, headers=headers) as response:
            return response.status, await response.json()


@pytest.mark.parametrize("path,method", [("/v1/nowhere", "GET"), ("/v1/chat/completions", "GET")])
async def test_unknown_paths_and_methods_get_openai_errors(stack, path, method):
    async with aiohttp.ClientSession() as session:
        async with session.request(method, stack.base_url.removesuffix("/v1") + path) as response:
            assert response.status in (404, 405)
            assert response.content_type == "application/json"
            assert (await response.json())["error"]["message"]


async def test_an_oversized_body_gets_413_and_a_wrong_content_type_415(stack):
    status, body = await raw_post(stack, "/chat/completions", b"x" * (17 << 20), {"Content-Type": "application/json"})
    assert status == 413 and body["error"]["code"] == "request_too_large"
    status, body = await raw_post(
        stack, "/chat/completions", b"model=tiny", {"Content-Type": "application/x-www-form-urlencoded"}
    )
    assert status == 415 and body["error"]["code"] == "unsupported_media_type"


async def test_an_agent_transcript_with_tool_calls_and_null_content_is_served(stack):
    call = {"id": "call_1", "type": "function", "function": {"name": "lookup", "arguments": "{}"}}
    status, body = await post(
        stack,
        "/chat/completions",
        {
            "model": "tiny",
            "max_tokens": 3,
            "messages": [
                {"role": "user", "content": "look it up"},
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "42"},
            ],
        },
    )
    assert status == 200, body
    assert body["usage"]["completion_tokens"] == 3


async def test_a_huge_prompt_is_refused_before_tokenizing_while_health_answers(stack):
    huge = {"model": "tiny", "messages": [{"role": "user", "content": "word " * ((8 << 20) // 5)}]}
    refused = asyncio.create_task(post(stack, "/chat/completions", huge))
    started = time.monotonic()
    status, _ = await get(stack, "/health")
    health_s = time.monotonic() - started
    status_huge, body = await asyncio.wait_for(refused, 10)
    assert status == 200 and health_s < 2
    assert status_huge == 400 and body["error"]["code"] == "context_length_exceeded"


async def test_the_default_max_tokens_is_clamped_to_the_remaining_context(make_stack, tiny):
    # A prompt near the 4,096-token context: the default of 4,090 would not fit; what is left does.
    stack = await make_stack(router_settings={"pipeline_policy": "P-MD", "default_max_tokens": 4090})
    status, body = await post(
        stack,
        "/chat/completions",
        {"model": "tiny", "messages": [{"role": "user", "content": "hi " * 3950}], "ignore_eos": True},
    )
    assert status == 200, body
    usage = body["usage"]
    assert usage["prompt_tokens"] + usage["completion_tokens"] == tiny.model.config.max_position_embeddings


async def test_api_keys_are_required_when_set(make_stack):
    stack = await make_stack(router_settings={"api_keys": "k1,k2"})
    chat = {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    status, body = await raw_post(
        stack, "/chat/completions", json.dumps(chat).encode(), {"Content-Type": "application/json"}
    )
    assert status == 401 and body["error"]["code"] == "invalid_api_key"
    status, _ = await raw_post(
        stack,
        "/chat/completions",
        json.dumps(chat).encode(),
        {"Content-Type": "application/json", "Authorization": "Bearer nope"},
    )
    assert status == 401
    status, body = await raw_post(
        stack,
        "/chat/completions",
        json.dumps(chat).encode(),
        {"Content-Type": "application/json", "Authorization": "Bearer k2"},
    )
    assert status == 200 and body["usage"]["completion_tokens"] == 2
    assert (await get(stack, "/health"))[0] == 200  # probes need no key
    assert (await get(stack, "/metrics"))[0] == 401


def _dechunk(body: bytes) -> bytes:
    """An HTTP/1.1 chunked body, checked chunk by chunk; it must end with the last chunk."""
    data, rest = b"", body
    while True:
        size_line, _, rest = rest.partition(b"\r\n")
        size = int(size_line, 16)
        if size == 0:
            assert rest == b"\r\n", rest[:80]
            return data
        assert rest[size : size + 2] == b"\r\n", rest[: size + 2][-80:]
        data, rest = data + rest[:size], rest[size + 2 :]


@pytest.mark.parametrize("version", ["1.1", "1.0"])
async def test_a_streamed_answer_is_well_framed_on_the_wire_for_http_1_1_and_1_0(stack, tiny, version):
    from tests.helpers import expected_text, prompt_of_length

    prompt = prompt_of_length(tiny, 12)
    body = json.dumps(
        {"model": "tiny", "prompt": prompt, "max_tokens": 24, "temperature": 0, "ignore_eos": True, "stream": True}
    ).encode()
    address = stack.base_url.removeprefix("http://").removesuffix("/v1")
    host, port = address.rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(
        f"POST /v1/completions HTTP/{version}\r\nHost: {address}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
        + body
    )
    await writer.drain()
    answer = await asyncio.wait_for(reader.read(), 60)  # the server closes: Connection: close
    writer.close()
    head, _, payload = answer.partition(b"\r\n\r\n")
    assert head.startswith(f"HTTP/{version} 200".encode()), head
    chunked = b"transfer-encoding: chunked" in head.lower()
    assert chunked == (version == "1.1")
    events = (_dechunk(payload) if chunked else payload).decode().split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""]
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-2]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == expected_text(tiny, prompt, 24)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
