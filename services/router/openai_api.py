"""The OpenAI-compatible surface: request validation and response shapes.

Implements what ``request_fields`` lists (sampling, penalties, ``min_tokens``, ``logprobs``,
streaming with usage) and refuses the rest by name. Errors use OpenAI's error object with a
fitting HTTP status.
"""

import json
import math
import time
from dataclasses import dataclass, field
from typing import Any

from services.router.api_error import ApiError
from services.router.request_fields import check_fields
from shared.engine.sampling import (
    MAX_ABS_PENALTY,
    MAX_LOGPROBS,
    MAX_REPETITION_PENALTY,
    MAX_STOP_STRINGS,
    MAX_TEMPERATURE,
    MAX_TOP_K,
    MIN_REPETITION_PENALTY,
    SamplingParams,
)
from shared.errors import InvalidSampling

SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1
"""Seeds are 64-bit signed integers, as in vLLM (they travel as msgpack integers)."""
MAX_STOP_CHARS = 512
MAX_JSON_DEPTH = 64
"""Deepest nesting of arrays and objects a request body may have."""


def parse_json_body(text: str) -> dict:
    """A request body as a JSON object: strict JSON (no ``NaN``/``Infinity``), at most
    ``MAX_JSON_DEPTH`` deep, every string valid Unicode; else ApiError(400)."""
    try:
        body = json.loads(text, parse_constant=_refuse_constant)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise ApiError(400, "request body is not valid JSON") from None
    except RecursionError:
        raise ApiError(400, f"request body is nested deeper than {MAX_JSON_DEPTH} levels") from None
    if not isinstance(body, dict):
        raise ApiError(400, "request body must be a JSON object")
    _check_json_value(body, "", 0)
    return body


def _refuse_constant(name: str):
    raise ApiError(400, f"request body is not valid JSON: {name} is not a JSON number")


def _check_json_value(value, path: str, depth: int):
    if depth > MAX_JSON_DEPTH:
        raise ApiError(400, f"request body is nested deeper than {MAX_JSON_DEPTH} levels")
    if isinstance(value, str):
        _check_unicode(value, path)
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_unicode(key, path)
            _check_json_value(item, f"{path}.{key}" if path else key, depth + 1)
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _check_json_value(item, f"{path}[{i}]", depth + 1)


def _check_unicode(text: str, path: str):
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            raise ApiError(
                400,
                f"'{path or 'body'}' holds a lone surrogate (not valid Unicode)",
                param=path.split(".")[0].split("[")[0] or None,
            ) from None


@dataclass
class ParsedRequest:
    """A validated completion or chat request.

    Attributes:
        chat: True for ``/v1/chat/completions``.
        model: The model name the client asked for.
        prompt_token_ids: The tokenized prompt (chat template applied for chat).
        sampling: Sampling and stopping parameters.
        stream: Server-sent events instead of one JSON body.
        include_usage: Send a usage chunk at the end of a stream.
        system_fingerprint: Names the serving configuration (version and model weights).
    """

    chat: bool
    model: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    stream: bool = False
    include_usage: bool = False
    system_fingerprint: str = ""
    created: int = field(default_factory=lambda: int(time.time()))


def _number(body: dict, name: str, kind, default, low=None, high=None, low_open=False):
    value = body.get(name, default)
    if value is None:
        return default
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float) if kind is float else int)
        or (isinstance(value, float) and not math.isfinite(value))
    ):
        raise ApiError(400, f"'{name}' must be {'a finite number' if kind is float else 'an integer'}", param=name)
    if (low is not None and (value <= low if low_open else value < low)) or (high is not None and value > high):
        bounds = f"{'>' if low_open else '>='} {low}" + (f" and <= {high}" if high is not None else "")
        raise ApiError(400, f"'{name}' must be {bounds}, got {value}", param=name)
    return kind(value)


def parse_sampling(body: dict, default_max_tokens: int, chat: bool) -> SamplingParams:
    """Sampling parameters from an OpenAI request body, validated (every field checked first)."""
    check_fields(body, chat)
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    name = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
    max_tokens = _number({name: max_tokens}, name, int, default_max_tokens, low=1)
    if body.get("n", 1) not in (1, None):
        raise ApiError(400, "only n=1 is supported", param="n")
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=_number(body, "temperature", float, 1.0, low=0, high=MAX_TEMPERATURE),
        top_p=_number(body, "top_p", float, 1.0, low=0, high=1, low_open=True),
        top_k=_top_k(body),
        seed=_seed(body),
        stop=_stop(body),
        ignore_eos=_flag(body, "ignore_eos"),
        min_tokens=_number(body, "min_tokens", int, 0, low=0, high=max_tokens),
        repetition_penalty=_number(
            body, "repetition_penalty", float, 1.0, low=MIN_REPETITION_PENALTY, high=MAX_REPETITION_PENALTY
        ),
        frequency_penalty=_number(body, "frequency_penalty", float, 0.0, low=-MAX_ABS_PENALTY, high=MAX_ABS_PENALTY),
        presence_penalty=_number(body, "presence_penalty", float, 0.0, low=-MAX_ABS_PENALTY, high=MAX_ABS_PENALTY),
        logprobs=_logprobs(body, chat),
    )
    return checked(params)


def checked(params: SamplingParams) -> SamplingParams:
    """``params`` after the engines' own range check, so router and engines never disagree."""
    try:
        params.validate()
    except InvalidSampling as exc:
        raise ApiError(400, str(exc), param=exc.field) from None
    return params


def _top_k(body: dict) -> int:
    top_k = _number(body, "top_k", int, 0, low=-1, high=MAX_TOP_K)
    return 0 if top_k == -1 else top_k  # vLLM spells "off" -1


def _seed(body: dict) -> int | None:
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not SEED_MIN <= seed <= SEED_MAX):
        raise ApiError(400, f"'seed' must be an integer in [{SEED_MIN}, {SEED_MAX}]", param="seed")
    return seed


def _stop(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        stop = ()
    elif isinstance(stop, str):
        stop = (stop,)
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        stop = tuple(stop)
    else:
        raise ApiError(400, "'stop' must be a string or a list of strings", param="stop")
    if len(stop) > MAX_STOP_STRINGS or any(not s or len(s) > MAX_STOP_CHARS for s in stop):
        raise ApiError(
            400,
            f"'stop' takes up to {MAX_STOP_STRINGS} non-empty strings of at most {MAX_STOP_CHARS} characters",
            param="stop",
        )
    return stop


def _flag(body: dict, name: str) -> bool:
    value = body.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise ApiError(400, f"'{name}' must be a boolean", param=name)
    return value


def _logprobs(body: dict, chat: bool) -> int | None:
    """How many alternatives per token: chat's ``logprobs`` + ``top_logprobs``, completions' ``logprobs``."""
    if not chat:
        value = _number(body, "logprobs", int, None, low=0, high=MAX_LOGPROBS)
        return value
    top = _number(body, "top_logprobs", int, None, low=0, high=MAX_LOGPROBS)
    if not _flag(body, "logprobs"):
        if top:
            raise ApiError(400, "'top_logprobs' needs 'logprobs': true", param="top_logprobs")
        return None
    return top or 0


def chat_messages(body: dict) -> list[dict]:
    """The ``messages`` array, validated and flattened to text content.

    An assistant turn may have ``content: null`` (it called tools); its ``tool_calls``, and a
    tool turn's ``tool_call_id`` and ``name``, pass on to the chat template.
    """
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' must be a non-empty array", param="messages")
    flat = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in (
            "system",
            "user",
            "assistant",
            "tool",
            "developer",
        ):
            raise ApiError(
                400, f"messages[{i}] needs a role of system, user, assistant, tool or developer", param="messages"
            )
        content = message.get("content", "")
        if content is None and message["role"] == "assistant":
            content = ""
        if isinstance(content, list):
            parts = [p.get("text") for p in content if isinstance(p, dict) and p.get("type") == "text"]
            if len(parts) != len(content) or not all(isinstance(p, str) for p in parts):
                raise ApiError(400, f"messages[{i}].content: only text parts are supported", param="messages")
            content = "".join(parts)
        if not isinstance(content, str):
            raise ApiError(400, f"messages[{i}].content must be a string", param="messages")
        role = "system" if message["role"] == "developer" else message["role"]
        flat.append({"role": role, "content": content, **_tool_fields(message, i)})
    return flat


def _tool_fields(message: dict, index: int) -> dict:
    fields = {}
    if message.get("tool_calls") is not None:
        if not isinstance(message["tool_calls"], list) or not all(isinstance(c, dict) for c in message["tool_calls"]):
            raise ApiError(400, f"messages[{index}].tool_calls must be an array of objects", param="messages")
        fields["tool_calls"] = message["tool_calls"]
    for name in ("tool_call_id", "name"):
        if message.get(name) is not None:
            if not isinstance(message[name], str):
                raise ApiError(400, f"messages[{index}].{name} must be a string", param="messages")
            fields[name] = message[name]
    return fields


def stream_flags(body: dict) -> tuple[bool, bool]:
    """``stream`` and ``stream_options.include_usage``."""
    stream = _flag(body, "stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise ApiError(400, "'stream_options' must be an object", param="stream_options")
    return stream, bool(options.get("include_usage", False)) and stream


def completion_body(
    req: ParsedRequest,
    request_id: str,
    text: str,
    finish_reason: str,
    num_output_tokens: int,
    pdd: dict[str, Any],
    cached_tokens: int = 0,
    logprobs: dict | None = None,
) -> dict:
    """The non-streaming response (``logprobs``: the choice's, already in its endpoint's shape)."""
    usage = usage_of(req, num_output_tokens, cached_tokens)
    if req.chat:
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "logprobs": logprobs,
            "finish_reason": finish_reason,
        }
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
        obj = "text_completion"
    return {
        "id": request_id,
        "object": obj,
        "created": req.created,
        "model": req.model,
        "system_fingerprint": req.system_fingerprint,
        "choices": [choice],
        "usage": usage,
        "pdd": pdd,
    }


def chunk_body(
    req: ParsedRequest,
    request_id: str,
    delta_text: str | None,
    finish_reason: str | None = None,
    *,
    first: bool = False,
    pdd: dict | None = None,
    logprobs: dict | None = None,
) -> dict:
    """One streaming chunk (``delta_text`` None with a finish reason for the last one)."""
    if req.chat:
        delta: dict[str, Any] = {}
        if first:
            delta["role"] = "assistant"
        if delta_text:
            delta["content"] = delta_text
        choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": delta_text or "", "logprobs": logprobs, "finish_reason": finish_reason}
        obj = "text_completion"
    body = {
        "id": request_id,
        "object": obj,
        "created": req.created,
        "model": req.model,
        "system_fingerprint": req.system_fingerprint,
        "choices": [choice],
    }
    if pdd is not None:
        body["pdd"] = pdd
    return body


def usage_chunk(req: ParsedRequest, request_id: str, num_output_tokens: int, cached_tokens: int = 0) -> dict:
    """The final ``include_usage`` chunk (no choices)."""
    obj = "chat.completion.chunk" if req.chat else "text_completion"
    return {
        "id": request_id,
        "object": obj,
        "created": req.created,
        "model": req.model,
        "system_fingerprint": req.system_fingerprint,
        "choices": [],
        "usage": usage_of(req, num_output_tokens, cached_tokens),
    }


def usage_of(req: ParsedRequest, num_output_tokens: int, cached_tokens: int = 0) -> dict:
    """OpenAI usage counts; ``cached_tokens``: prompt tokens prefill took from its prefix cache."""
    prompt = len(req.prompt_token_ids)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": num_output_tokens,
        "total_tokens": prompt + num_output_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def gen_ai_request_attributes(req: ParsedRequest) -> dict[str, Any]:
    """OpenTelemetry's ``gen_ai.*`` request attributes of the request span."""
    sampling = req.sampling
    attributes: dict[str, Any] = {
        "gen_ai.operation.name": "chat" if req.chat else "text_completion",
        "gen_ai.provider.name": "pdd",
        "gen_ai.request.model": req.model,
        "gen_ai.request.max_tokens": sampling.max_tokens,
        "gen_ai.request.temperature": sampling.temperature,
        "gen_ai.request.top_p": sampling.top_p,
        "gen_ai.request.frequency_penalty": sampling.frequency_penalty,
        "gen_ai.request.presence_penalty": sampling.presence_penalty,
    }
    if sampling.top_k:
        attributes["gen_ai.request.top_k"] = sampling.top_k
    if sampling.seed is not None:
        attributes["gen_ai.request.seed"] = sampling.seed
    if sampling.stop:
        attributes["gen_ai.request.stop_sequences"] = list(sampling.stop)
    return attributes
