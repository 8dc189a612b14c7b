"""Generated request bodies against a live deployment (``pdd up``, separate processes, tiny model).

Every body — extreme floats, NaN and Infinity, huge integers, wrong types, lone surrogates,
token ids outside the vocabulary, deep nesting — gets an answer below 500; every 4xx is an
OpenAI error object; no process restarts; a plain request works afterwards.
``PDD_FUZZ_EXAMPLES`` sets how many bodies (default 200; the long run in docs/security.md
uses thousands).
"""

import json
import math
import os
import urllib.error
import urllib.request

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.helpers import pdd

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"  # the tiny model, served under the default id
NUM_EXAMPLES = int(os.environ.get("PDD_FUZZ_EXAMPLES", "200"))
REQUEST_TIMEOUT_S = 60


@pytest.fixture
def deployment(tiny_deployment):
    run_dir, ports = tiny_deployment
    return run_dir, f"http://127.0.0.1:{ports['--http-port']}"


def post(base_url: str, path: str, raw: bytes) -> tuple[int, bytes]:
    request = urllib.request.Request(
        base_url + path, data=raw, method="POST", headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


LONE_SURROGATES = st.sampled_from(["\ud800", "a\udfffb", "\udc00" * 3, "x\ud83d"])
EXTREME_FLOATS = st.one_of(
    st.sampled_from(
        [1e-39, -1e-39, 5e-324, 1e-7, 1e308, -1e308, 0.0, -0.0, 2.0000001, 0.009999, math.nan, math.inf, -math.inf]
    ),
    st.floats(allow_nan=True, allow_infinity=True),
)
HUGE_INTS = st.one_of(
    st.sampled_from([2**64 + 1, 18446744073709551617, -(2**63) - 1, 2**31, -1, 0]),
    st.integers(min_value=-(2**70), max_value=2**70),
)
WRONG_TYPES = st.one_of(
    st.none(),
    st.booleans(),
    st.text(max_size=8),
    st.lists(st.integers(), max_size=3),
    st.dictionaries(st.text(max_size=4), st.integers(), max_size=2),
)
ANY_VALUE = st.one_of(EXTREME_FLOATS, HUGE_INTS, WRONG_TYPES, LONE_SURROGATES)
SMALL_MAX_TOKENS = st.integers(min_value=1, max_value=4)

SAMPLING_FIELDS = [
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "min_tokens",
    "repetition_penalty",
    "frequency_penalty",
    "presence_penalty",
    "n",
    "ignore_eos",
    "stop",
    "stream",
    "stream_options",
    "logprobs",
    "top_logprobs",
    "min_p",
    "logit_bias",
    "user",
    "max_completion_tokens",
    "best_of",
    "echo",
    "suffix",
    "no_such_field",
]


@st.composite
def sampling_fields(draw) -> dict:
    fields = {}
    for name in draw(st.lists(st.sampled_from(SAMPLING_FIELDS), max_size=5, unique=True)):
        fields[name] = draw(st.one_of(ANY_VALUE, st.floats(min_value=-3, max_value=3), SMALL_MAX_TOKENS))
    if "max_completion_tokens" in fields and draw(st.booleans()):
        fields["max_completion_tokens"] = draw(SMALL_MAX_TOKENS)
    return fields


@st.composite
def message_lists(draw):
    text = st.one_of(st.text(max_size=40), LONE_SURROGATES)
    content = st.one_of(
        text,
        st.none(),
        WRONG_TYPES,
        st.lists(st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url"]), "text": text}), max_size=2),
    )
    message = st.fixed_dictionaries(
        {
            "role": st.one_of(st.sampled_from(["system", "user", "assistant", "tool", "developer"]), WRONG_TYPES),
            "content": content,
        },
        optional={
            "tool_calls": st.one_of(
                WRONG_TYPES,
                st.lists(
                    st.dictionaries(
                        st.sampled_from(["id", "type", "function"]),
                        ANY_VALUE | st.dictionaries(st.sampled_from(["name", "arguments"]), ANY_VALUE, max_size=2),
                        max_size=3,
                    ),
                    max_size=2,
                ),
            ),
            "name": ANY_VALUE,
            "tool_call_id": ANY_VALUE,
        },
    )
    return draw(st.one_of(st.lists(message, min_size=1, max_size=3), WRONG_TYPES))


@st.composite
def prompts(draw):
    return draw(
        st.one_of(
            st.text(max_size=60),
            LONE_SURROGATES,
            WRONG_TYPES,
            st.lists(st.integers(min_value=0, max_value=200), min_size=1, max_size=20),
            st.lists(st.one_of(HUGE_INTS, st.integers(min_value=48_000, max_value=50_000)), min_size=1, max_size=5),
            st.lists(st.text(max_size=10), min_size=1, max_size=2),
        )
    )


def deeply_nested(depth: int) -> str:
    return "[" * depth + "]" * depth


@st.composite
def raw_bodies(draw) -> tuple[str, bytes]:
    """(path, body bytes): mostly well-formed JSON with odd values, sometimes not JSON at all."""
    chat = draw(st.booleans())
    body = {
        "model": draw(st.one_of(st.just(MODEL), st.just(MODEL), ANY_VALUE)),
        "max_tokens": draw(st.one_of(SMALL_MAX_TOKENS, SMALL_MAX_TOKENS, SMALL_MAX_TOKENS, ANY_VALUE)),
        **draw(sampling_fields()),
    }
    if chat:
        body["messages"] = draw(message_lists())
    else:
        body["prompt"] = draw(prompts())
    path = "/v1/chat/completions" if chat else "/v1/completions"
    shape = draw(st.sampled_from(["json"] * 8 + ["nested", "garbage"]))
    raw = json.dumps(body, allow_nan=True)  # NaN and Infinity as bare words, as some clients send
    if shape == "nested":
        raw = raw[:-1] + ', "extra": ' + deeply_nested(draw(st.integers(min_value=100, max_value=100_000))) + "}"
    elif shape == "garbage":
        raw = draw(st.sampled_from(["", "{", "nul", '{"model": tiny}', "[1, 2]", '"\\ud800"', '{"a": 1e999999}']))
    return path, raw.encode("utf-8", "surrogatepass")


def check_answer(status: int, body: bytes, path: str, raw: bytes):
    assert status < 500, (status, path, raw[:300], body[:300])
    if status >= 400:
        error = json.loads(body)["error"]
        assert isinstance(error["message"], str) and error["type"], error
        return
    if body.startswith(b"data: "):  # a stream: every event is JSON, and it ends with [DONE]
        events = [line[6:] for line in body.split(b"\n\n") if line.startswith(b"data: ")]
        assert events[-1] == b"[DONE]", body[-200:]
        for event in events[:-1]:
            assert "error" not in json.loads(event), event
    else:
        assert json.loads(body)["choices"], body[:300]


def restarts(run_dir) -> dict[str, int]:
    status = json.loads(pdd("status", "--json", "--run-dir", str(run_dir)).stdout)
    return {name: entry["restarts"] for name, entry in status["processes"].items()}


def test_generated_bodies_get_no_5xx_and_kill_no_process(deployment):
    run_dir, base_url = deployment
    before = restarts(run_dir)
    assert set(before) >= {"prefill-0", "main-decode-0", "main-decode-1", "relay-decode-0", "router-0"}

    @settings(
        max_examples=NUM_EXAMPLES,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(raw_bodies())
    def one_body(path_and_body):
        path, raw = path_and_body
        check_answer(*post(base_url, path, raw), path, raw)

    one_body()
    assert restarts(run_dir) == before
    status, body = post(
        base_url,
        "/v1/chat/completions",
        json.dumps(
            {
                "model": MODEL,
                "max_tokens": 4,
                "temperature": 0,
                "messages": [{"role": "user", "content": "Still there?"}],
            }
        ).encode(),
    )
    assert status == 200 and json.loads(body)["choices"][0]["finish_reason"] == "length", body
