"""Which request fields the API takes: every field is implemented, refused, or unknown.

A field a client sends is either one this server implements, one of OpenAI's (or vLLM's)
that it does not (answered 400 naming it unless it carries its "off" value, as clients
that fill every field send), or unknown (400 naming it). Nothing is silently ignored.
"""

from typing import Any

from services.router.api_error import ApiError

COMMON = frozenset(
    {
        "model",
        "max_tokens",
        "temperature",
        "top_p",
        "top_k",
        "seed",
        "stop",
        "stream",
        "stream_options",
        "n",
        "ignore_eos",
        "logprobs",
        "frequency_penalty",
        "presence_penalty",
        "repetition_penalty",
        "min_tokens",
        "user",
    }
)
"""Implemented by both endpoints (``user`` is an opaque end-user id with no effect, as in OpenAI)."""
CHAT = COMMON | {"messages", "max_completion_tokens", "top_logprobs"}
COMPLETIONS = COMMON | {"prompt"}

_OFF: dict[str, tuple[Any, ...]] = {
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "parallel_tool_calls": (None,),
    "functions": (None, []),
    "function_call": (None, "none"),
    "response_format": (None, {"type": "text"}),
    "logit_bias": (None, {}),
    "echo": (None, False),
    "best_of": (None, 1),
    "suffix": (None, ""),
    "audio": (None,),
    "modalities": (None, ["text"]),
    "prediction": (None,),
    "web_search_options": (None,),
    "store": (None, False),
    "metadata": (None, {}),
    "reasoning_effort": (None,),
    "service_tier": (None, "auto", "default"),
    "min_p": (None, 0, 0.0),
    "stop_token_ids": (None, []),
    "bad_words": (None, []),
    "guided_json": (None,),
    "guided_regex": (None,),
    "guided_choice": (None,),
    "guided_grammar": (None,),
    "structured_outputs": (None,),
}
"""Fields of OpenAI's or vLLM's API that this server does not implement, with the values that
mean "not used"."""


def check_fields(body: dict, chat: bool):
    """Raise ApiError(400) naming the first field this endpoint does not implement."""
    allowed = CHAT if chat else COMPLETIONS
    for name, value in body.items():
        if name in allowed:
            continue
        if name in _OFF:
            if any(value == off and type(value) is type(off) for off in _OFF[name]):
                continue
            raise ApiError(400, f"'{name}' is not supported by this server", param=name, code="unsupported_parameter")
        raise ApiError(400, f"unknown field '{name}'", param=name, code="unknown_parameter")
