"""The OpenAI surface as eval harnesses and agents use it: log-probabilities equal to
transformers' through both pipelines and a handoff, penalties and ``min_tokens`` exact across
the handoff, every field we do not implement refused by name, and vLLM's helper endpoints."""

import aiohttp
import pytest
import torch

from tests.helpers import SLOW_WAN, chat_body, chat_prompt, post, reference_greedy, reference_logprobs, stream

TOP = 3
TOLERANCE = 1e-3
"""The tiny random model's logits are ~30 (SmolLM2's ~10 times smaller): a main decoder's one-pass
extend over handed-over tokens sums in another order than transformers' step-by-step decode and
lands up to ~2e-4 away. SmolLM2 holds 1e-4 through a handoff (test_pipeline_real)."""


@pytest.fixture
async def stack(make_stack):
    return await make_stack(router_settings={"pipeline_policy": "P-MD"})


def assert_logprobs_match(tiny, prompt: list[int], output: list[int], content: list[dict]):
    reference = reference_logprobs(tiny, prompt, len(output))
    assert len(content) == len(output)
    for i, (token_id, entry) in enumerate(zip(output, content)):
        assert entry["token"] == tiny.tokenizer.decode([token_id])
        assert abs(entry["logprob"] - float(reference[i, token_id])) < TOLERANCE, i
        top = entry["top_logprobs"]
        assert len(top) == TOP and top[0]["token"] == entry["token"]  # greedy: the chosen one is the likeliest
        values, ids = torch.topk(reference[i], TOP)
        assert [t["token"] for t in top] == [tiny.tokenizer.decode([t]) for t in ids.tolist()]
        assert all(abs(t["logprob"] - float(v)) < TOLERANCE for t, v in zip(top, values)), (i, top, values)


@pytest.mark.parametrize("policy", ["P-MD", "P-RLD-MD"])
async def test_chat_logprobs_equal_transformers_through_each_pipeline(make_stack, tiny, policy):
    # One-shot handoff: the relay's backlog when the KV lands (~60 tokens) is near the catch-up
    # threshold, and a catch-up chasing a fast tiny-model relay may not end before 200 tokens
    # (catch-up's exactness is test_decode_requests').
    stack = await make_stack(
        profile=SLOW_WAN,
        router_settings={"pipeline_policy": policy},
        relay_settings={"catch_up_threshold_tokens": 10_000},
    )
    content = "Name the planets and one fact about each. " * 12
    # Enough tokens that the relay is still decoding when main decode takes over (with 60 it made
    # them all before the KV crossed), few enough that the logits stay within TOLERANCE of
    # transformers' step-by-step decode (at 400 the lean step was 1.2e-3 away at token 351).
    body = chat_body(content, 200, logprobs=True, top_logprobs=TOP)
    status, answer = await post(stack, "/chat/completions", body)
    assert status == 200, answer
    prompt = chat_prompt(tiny, content)
    output = reference_greedy(tiny, prompt, 200)
    if policy == "P-RLD-MD":
        assert answer["pdd"]["eager_tokens"] >= 1 and answer["pdd"]["finished_on"] == "MD", answer["pdd"]
    assert_logprobs_match(tiny, prompt, output, answer["choices"][0]["logprobs"]["content"])
    chunks = await stream(stack, "/chat/completions", body)
    streamed = [
        e
        for c in chunks
        if c["choices"] and c["choices"][0]["logprobs"]
        for e in c["choices"][0]["logprobs"]["content"]
    ]
    assert_logprobs_match(tiny, prompt, output, streamed)


async def test_completion_logprobs_have_offsets_into_the_text(stack, tiny):
    prompt_text = "The capital of France is"
    status, answer = await post(
        stack,
        "/completions",
        {"model": "tiny", "prompt": prompt_text, "max_tokens": 12, "temperature": 0, "logprobs": 2, "ignore_eos": True},
    )
    assert status == 200, answer
    choice = answer["choices"][0]
    logprobs = choice["logprobs"]
    prompt = tiny.tokenizer.encode(prompt_text, add_special_tokens=False)
    output = reference_greedy(tiny, prompt, 12)
    reference = reference_logprobs(tiny, prompt, 12)
    assert logprobs["token_logprobs"] == pytest.approx(
        [float(reference[i, t]) for i, t in enumerate(output)], abs=TOLERANCE
    )
    assert "".join(logprobs["tokens"]) == choice["text"]
    assert logprobs["text_offset"] == [len("".join(logprobs["tokens"][:i])) for i in range(12)]
    assert all(len(top) == 2 for top in logprobs["top_logprobs"])


async def test_seeded_top_k_sampling_is_the_same_with_and_without_a_relay(make_stack):
    content = "Tell me a story about a lighthouse. " * 10
    body = chat_body(content, 40, temperature=1.0, top_k=5, seed=11)
    answers = []
    for policy in ("P-MD", "P-RLD-MD"):
        stack = await make_stack(profile=SLOW_WAN, router_settings={"pipeline_policy": policy})
        status, answer = await post(stack, "/chat/completions", body)
        assert status == 200 and answer["pdd"]["pipeline"] == policy, answer
        answers.append(answer["choices"][0]["message"]["content"])
    assert answers[0] == answers[1]


UNSUPPORTED = [
    ("tools", [{"type": "function", "function": {"name": "f", "parameters": {}}}]),
    ("tool_choice", "auto"),
    ("response_format", {"type": "json_object"}),
    ("logit_bias", {"5": 10}),
    ("parallel_tool_calls", True),
    ("reasoning_effort", "high"),
]


async def test_fields_we_do_not_implement_get_400_naming_them(stack):
    for name, value in UNSUPPORTED:
        status, answer = await post(stack, "/chat/completions", chat_body("hi", 3, **{name: value}))
        assert status == 400 and answer["error"]["param"] == name and name in answer["error"]["message"], answer
        assert answer["error"]["code"] == "unsupported_parameter"
    for name, value in [("echo", True), ("best_of", 2), ("suffix", "end"), ("top_logprobs", 2)]:
        status, answer = await post(
            stack, "/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 2, name: value}
        )
        assert status == 400 and answer["error"]["param"] == name, answer


async def test_unknown_fields_get_400_and_off_values_pass(stack):
    status, answer = await post(stack, "/chat/completions", chat_body("hi", 3, temprature=0.5))
    assert status == 400 and answer["error"]["param"] == "temprature" and answer["error"]["code"] == "unknown_parameter"
    status, answer = await post(
        stack,
        "/chat/completions",
        chat_body("hi", 3, tools=[], response_format={"type": "text"}, logit_bias=None, user="u-1", n=1),
    )
    assert status == 200, answer
    assert answer["system_fingerprint"].startswith("pdd-")


async def test_tokenize_detokenize_version_and_models(stack, tiny):
    base = stack.base_url.removesuffix("/v1")
    async with aiohttp.ClientSession() as session:
        async with session.post(base + "/tokenize", json={"model": "tiny", "prompt": "Hello there"}) as r:
            tokens = await r.json()
        async with session.post(
            base + "/tokenize", json={"model": "tiny", "messages": [{"role": "user", "content": "Hello"}]}
        ) as r:
            chat_tokens = await r.json()
        async with session.post(base + "/detokenize", json={"model": "tiny", "tokens": tokens["tokens"]}) as r:
            text = await r.json()
        async with session.post(base + "/detokenize", json={"model": "tiny", "tokens": [-1]}) as r:
            bad = r.status, await r.json()
        async with session.get(base + "/version") as r:
            version = await r.json()
        async with session.get(base + "/v1/models") as r:
            models = await r.json()
    assert tokens["tokens"] == tiny.tokenizer.encode("Hello there", add_special_tokens=False)
    assert tokens["count"] == len(tokens["tokens"]) and tokens["max_model_len"] == models["data"][0]["max_model_len"]
    assert chat_tokens["tokens"] == chat_prompt(tiny, "Hello")
    assert text == {"prompt": "Hello there"}
    assert bad[0] == 400 and bad[1]["error"]["param"] == "tokens"
    assert version["version"]
    model = models["data"][0]
    assert model["id"] == "tiny" and model["root"] == "tiny"
    assert model["max_model_len"] == tiny.model.config.max_position_embeddings
