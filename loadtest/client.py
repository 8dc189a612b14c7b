"""Drives the OpenAI streaming API and records what a user sees of every request."""

import json
import os
import time
from dataclasses import dataclass, field

import aiohttp


@dataclass
class RequestRecord:
    """One request as the client saw it.

    Attributes:
        session: Trace session.
        turn: Turn in the session.
        kind: Trace kind (cold, warm, odd).
        ttft_ms: First content token's arrival after the request was sent.
        itl_ms: Every gap between consecutive content chunks.
        e2e_ms: Until the stream ended.
        output_tokens: Completion tokens (usage).
        prompt_tokens: Prompt tokens (usage).
        text: The answer.
        pdd: The response's ``pdd`` object.
        error: The error message, if the request failed.
        repetition: Which repetition of ``pdd bench run --repeat`` it belongs to (from 0).
        request_id: The router's id for it (the stream chunks' ``id``), which the services'
            logs and the engine-call log name it by.
        sent_unix_s: When it was sent (Unix seconds; the calibration times its path to the
            prefill engine from it).
    """

    session: int
    turn: int
    kind: str
    ttft_ms: float | None = None
    itl_ms: list[float] = field(default_factory=list)
    e2e_ms: float | None = None
    output_tokens: int = 0
    prompt_tokens: int = 0
    text: str = ""
    pdd: dict = field(default_factory=dict)
    error: str | None = None
    repetition: int = 0
    request_id: str = ""
    sent_unix_s: float | None = None


def auth_headers() -> dict[str, str]:
    """``Authorization`` for a router that requires API keys (``$PDD_API_KEY``), else none."""
    key = os.environ.get("PDD_API_KEY", "")
    return {"Authorization": f"Bearer {key}"} if key else {}


def _chat_body(model: str, messages: list[dict], max_tokens: int) -> dict:
    """A greedy streaming chat completion request whose last chunk carries the usage."""
    return {
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


async def stream_chat(
    session: aiohttp.ClientSession,
    base_url: str,
    model: str,
    messages: list[dict],
    max_tokens: int,
    record: RequestRecord,
    timeout_s: float = 600,
) -> RequestRecord:
    """Send one streaming chat request and fill ``record``."""
    started = last = time.perf_counter()
    record.sent_unix_s = time.time()
    parts = []
    try:
        async with session.post(
            base_url + "/chat/completions",
            json=_chat_body(model, messages, max_tokens),
            headers=auth_headers(),
            timeout=aiohttp.ClientTimeout(total=timeout_s),
        ) as response:
            if response.status != 200:
                record.error = f"HTTP {response.status}: {(await response.text())[:200]}"
                return record
            async for line in response.content:
                if not line.startswith(b"data: {"):
                    continue
                chunk = json.loads(line[6:])
                record.request_id = chunk.get("id") or record.request_id
                if "error" in chunk:
                    record.error = chunk["error"]["message"]
                    continue
                now = time.perf_counter()
                content = chunk["choices"][0]["delta"].get("content") if chunk["choices"] else None
                if content:
                    if record.ttft_ms is None:
                        record.ttft_ms = (now - started) * 1000
                    else:
                        record.itl_ms.append((now - last) * 1000)
                    last = now
                    parts.append(content)
                record.pdd = chunk.get("pdd", record.pdd)
                if chunk.get("usage"):
                    record.output_tokens = chunk["usage"]["completion_tokens"]
                    record.prompt_tokens = chunk["usage"]["prompt_tokens"]
    except (aiohttp.ClientError, TimeoutError) as exc:
        record.error = f"{type(exc).__name__}: {exc}"
    record.e2e_ms = (time.perf_counter() - started) * 1000
    record.text = "".join(parts)
    return record
