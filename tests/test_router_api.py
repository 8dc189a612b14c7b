"""The router's HTTP surface: discovery endpoints and OpenAI-style errors for bad input."""

import aiohttp
import pytest

from tests.test_pipeline_e2e import post


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
    await post(stack, "/chat/completions", {"model": "tiny", "max_tokens": 3,
                                            "messages": [{"role": "user", "content": "hi"}]})
    status, body = await get(stack, "/metrics")
    assert status == 200
    assert 'pdd_requests_total{finished_on="MD",outcome="ok",pipeline="P-MD"}' in body
    assert "pdd_kv_bytes_total" in body and "pdd_ttft_seconds_bucket" in body


@pytest.mark.parametrize("body,status,code,param", [
    ("{not json", 400, None, None),
    ('["a list"]', 400, None, None),
    ({"model": "gpt-9", "messages": [{"role": "user", "content": "hi"}]}, 404, "model_not_found", "model"),
    ({"model": "tiny", "messages": []}, 400, None, "messages"),
    ({"model": "tiny", "messages": [{"role": "wizard", "content": "hi"}]}, 400, None, "messages"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, 400, None, "max_tokens"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": -3},
     400, None, "max_completion_tokens"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "temperature": 3}, 400, None, "temperature"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "top_p": 0}, 400, None, "top_p"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stop": [1]}, 400, None, "stop"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "n": 2}, 400, None, "n"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "word " * 5000}]}, 400,
     "context_length_exceeded", "messages"),
])
async def test_bad_chat_requests_get_openai_errors(stack, body, status, code, param):
    got_status, got = await post(stack, "/chat/completions", body, raw=isinstance(body, str))
    assert got_status == status
    error = got["error"]
    assert error["message"] and error["type"] == "invalid_request_error"
    assert error["code"] == code and error["param"] == param


async def test_bad_completion_prompt(stack):
    status, body = await post(stack, "/completions", {"model": "tiny", "prompt": [1, -5]})
    assert status == 400 and body["error"]["param"] == "prompt"


async def test_stop_string_is_cut_from_the_text(stack, tiny):
    from tests.test_pipeline_e2e import chat_prompt, expected_text

    content = "Count the waves."
    full = expected_text(tiny, chat_prompt(tiny, content), 30)
    stop = full[len(full) // 2:len(full) // 2 + 4]
    status, body = await post(stack, "/chat/completions", {
        "model": "tiny", "messages": [{"role": "user", "content": content}], "max_tokens": 30,
        "temperature": 0, "stop": stop, "ignore_eos": True})
    assert status == 200
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["choices"][0]["message"]["content"] == full[:full.index(stop)]
