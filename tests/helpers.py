"""Helpers the tests share: the transformers reference, real-text prompts, the ``pdd`` CLI,
HTTP calls against a stack, KV shipping between engines, a recording bulk handler, fault
injection into in-process services."""

import asyncio
import json
import subprocess
import sys
from functools import partial
from pathlib import Path

import aiohttp
import torch

from infra.wan_link import LinkProfile
from shared.engine.hf_engine import HfEngine
from shared.engine.sampling import SamplingParams
from shared.errors import InvalidRequestState
from shared.kv_wire import decode_frame, frame_bytes
from shared.messages import FlowOpen
from shared.model_loader import LoadedModel

_TOPICS = ["the sea", "mountains", "a city at night", "rivers", "old libraries", "trains"]


def reference_greedy(
    loaded: LoadedModel, prompt_ids: list[int], max_new_tokens: int, stop_at_eos: bool = False
) -> list[int]:
    """What transformers itself produces with ``generate(do_sample=False)``.

    With ``stop_at_eos`` False, generation runs past end-of-sequence tokens (the engine's
    ``ignore_eos``), so long outputs can be compared token by token.
    """
    inputs = torch.tensor([prompt_ids], device=loaded.device)
    config = loaded.model.generation_config
    saved_eos = config.eos_token_id
    if not stop_at_eos:
        config.eos_token_id = None
    try:
        with torch.inference_mode():
            output = loaded.model.generate(
                inputs,
                attention_mask=torch.ones_like(inputs),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=loaded.tokenizer.pad_token_id,
            )
    finally:
        config.eos_token_id = saved_eos
    return output[0, len(prompt_ids) :].tolist()


def chat_prompt_ids(loaded: LoadedModel, messages: list[dict]) -> list[int]:
    """The token ids the router sends for ``messages``: the chat template with the generation prompt."""
    return list(
        loaded.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    )


def reference_chat_answer(
    loaded: LoadedModel, messages: list[dict], max_tokens: int, *, ignore_eos: bool = False
) -> tuple[str, int]:
    """Transformers' greedy answer to ``messages`` as the API returns its text, and the prompt's
    length in tokens. It stops at end-of-sequence unless ``ignore_eos``, like the request."""
    prompt = chat_prompt_ids(loaded, messages)
    tokens = reference_greedy(loaded, prompt, max_tokens, stop_at_eos=not ignore_eos)
    return loaded.tokenizer.decode(tokens, skip_special_tokens=True), len(prompt)


def prompt_of_length(loaded: LoadedModel, num_tokens: int, seed: int = 0) -> list[int]:
    """A chat-formatted prompt of exactly ``num_tokens`` tokens of real text.

    The user message is cut to fit between the template's head and its
    ``<|im_end|>…<|im_start|>assistant`` tail; prompts shorter than the template are plain text.
    """
    tokenizer = loaded.tokenizer
    body = " ".join(
        f"Paragraph {i}: describe {_TOPICS[(i + seed) % len(_TOPICS)]} in vivid detail, "
        f"then list three facts about it and explain why they matter."
        for i in range(num_tokens // 8 + 4)
    )
    body_ids = tokenizer.encode(body, add_special_tokens=False)
    empty = list(
        tokenizer.apply_chat_template(
            [{"role": "user", "content": ""}], add_generation_prompt=True, tokenize=True, return_dict=False
        )
    )
    tail = tokenizer.encode("<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
    if num_tokens <= len(empty):
        return body_ids[:num_tokens]
    head = empty[: len(empty) - len(tail)]
    return head + body_ids[: num_tokens - len(empty)] + tail


async def until(predicate, timeout_s: float = 10.0, what: str = "condition"):
    """Await a condition on state other tasks change (polled; fails after ``timeout_s``)."""
    import asyncio

    deadline = asyncio.get_running_loop().time() + timeout_s
    while not predicate():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


def reference_logprobs(loaded: LoadedModel, prompt_ids: list[int], max_new_tokens: int) -> torch.Tensor:
    """transformers' log-softmax of the next-token logits at each step of its own greedy
    ``generate`` (past end-of-sequence tokens), ``[max_new_tokens, vocab]``."""
    return reference_greedy_with_logprobs(loaded, prompt_ids, max_new_tokens)[1]


def reference_greedy_with_logprobs(
    loaded: LoadedModel, prompt_ids: list[int], max_new_tokens: int
) -> tuple[list[int], torch.Tensor]:
    """One greedy ``generate`` (past end-of-sequence tokens): its tokens and the log-softmax
    of the logits each was chosen from."""
    inputs = torch.tensor([prompt_ids], device=loaded.device)
    config = loaded.model.generation_config
    saved_eos, config.eos_token_id = config.eos_token_id, None
    try:
        with torch.inference_mode():
            output = loaded.model.generate(
                inputs,
                attention_mask=torch.ones_like(inputs),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=loaded.tokenizer.pad_token_id,
                output_logits=True,
                return_dict_in_generate=True,
            )
    finally:
        config.eos_token_id = saved_eos
    return (
        output.sequences[0, len(prompt_ids) :].tolist(),
        torch.log_softmax(torch.stack(output.logits)[:, 0].float(), dim=-1),
    )


class _VllmPenalties:
    """vLLM's penalties and ``min_tokens`` as a transformers logits processor (the reference)."""

    def __init__(
        self, num_prompt_tokens: int, eos_ids, repetition: float, frequency: float, presence: float, min_tokens: int
    ):
        self.num_prompt_tokens, self.eos_ids = num_prompt_tokens, list(eos_ids)
        self.repetition, self.frequency, self.presence, self.min_tokens = repetition, frequency, presence, min_tokens

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        scores = scores.clone()
        for row, ids in enumerate(input_ids):
            seen = torch.unique(ids)
            values = scores[row, seen]
            scores[row, seen] = torch.where(values > 0, values / self.repetition, values * self.repetition)
            outputs = ids[self.num_prompt_tokens :]
            counts = torch.bincount(outputs, minlength=scores.shape[1]).float()
            scores[row] -= self.frequency * counts + self.presence * (counts > 0).float()
            if len(outputs) < self.min_tokens:
                scores[row, self.eos_ids] = float("-inf")
        return scores


def reference_penalised(
    loaded: LoadedModel,
    prompt_ids: list[int],
    max_new_tokens: int,
    *,
    repetition: float = 1.0,
    frequency: float = 0.0,
    presence: float = 0.0,
    min_tokens: int = 0,
) -> list[int]:
    """transformers' greedy output under vLLM's penalties, stopping at end-of-sequence."""
    from transformers import LogitsProcessorList

    inputs = torch.tensor([prompt_ids], device=loaded.device)
    processor = _VllmPenalties(len(prompt_ids), loaded.eos_token_ids, repetition, frequency, presence, min_tokens)
    with torch.inference_mode():
        output = loaded.model.generate(
            inputs,
            attention_mask=torch.ones_like(inputs),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=loaded.tokenizer.pad_token_id,
            logits_processor=LogitsProcessorList([processor]),
        )
    return output[0, len(prompt_ids) :].tolist()


PDD = str(Path(sys.executable).parent / "pdd")
"""The ``pdd`` command of the environment running the tests."""


def pdd(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    """Run ``pdd`` as a user would (its own process); output captured as text."""
    return subprocess.run([PDD, *args], capture_output=True, text=True, timeout=timeout)


def engines_idle(stack) -> bool:
    """Every engine of the stack holds no sequence and no block."""
    engines = [s.engine for s in [stack.prefill, *stack.relays, *stack.mains]]
    return all(e.num_sequences == 0 and e.blocks.num_used_blocks == 0 for e in engines)


async def crash(service):
    """Kill a service actor without a goodbye: engine loop and thread, heartbeats, bulk port and
    NATS gone."""
    await service.nc.close()  # first: a crashed process publishes nothing on its way out
    loop = getattr(service, "loop", None) or getattr(service, "_loop", None)
    if loop is not None:
        await loop.stop()
    for task in service._tasks:
        task.cancel()
    receiver = getattr(service, "receiver", None)
    if receiver is not None:
        await receiver.stop()
    worker = getattr(service, "worker", None)
    if worker is not None:
        worker.shutdown()  # the process's engine thread goes with it


def lost_cancels() -> dict[str, float]:
    """Per engine service, the requests its lease freed as ``finished``: their router no longer
    ran them and no cancel had freed them (what tells an operator cancels go missing)."""
    from shared.metrics import LEASES_EXPIRED

    return {
        service: LEASES_EXPIRED.labels(service, "finished")._value.get()
        for service in ("prefill", "relay_decode", "main_decode")
    }


def exported_families() -> set[str]:
    """Every metric family the services and the WAN link export (their modules imported)."""
    from prometheus_client import REGISTRY, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    import services.router.service  # noqa: F401  (registers the router's metrics)
    import shared.dead_letters  # noqa: F401  (registers the dead-letter metrics)
    from infra.wan_link import WanLink
    from infra.wan_link_metrics import WanLinkCollector

    text = generate_latest(REGISTRY).decode()
    families = {f.name for f in text_string_to_metric_families(text)}
    families |= {f.name for f in WanLinkCollector(WanLink()).collect()}
    return families


def run_to_end(engine: HfEngine, request_id: str) -> list[int]:
    while engine.has_work():
        engine.step()
    return engine.get(request_id).output_token_ids


def ship(
    sender: HfEngine, receiver: HfEngine, request_id: str, first_token_index: int, max_tokens_per_frame: int = 512
) -> int:
    """Export the prompt's KV from sender, through the wire decoder, into receiver."""
    num_prompt_tokens = sender.get(request_id).num_prompt_tokens
    frames = sender.export_frames(
        request_id, first_token_index, num_prompt_tokens, max_tokens_per_frame=max_tokens_per_frame
    )
    for parts in frames:
        receiver.import_frame(decode_frame(bytearray(frame_bytes(parts)), receiver.frame_expectation))
    return len(frames)


def relay_with_main(loaded, prompt: list[int], sampling: SamplingParams) -> tuple[HfEngine, HfEngine]:
    """A relay that has prefilled ``prompt`` (first token out) and a main decoder holding its KV."""
    relay, main = HfEngine(loaded, num_blocks=64), HfEngine(loaded, num_blocks=64)
    relay.add_request("r", prompt, sampling)
    main.begin_import("r", prompt, sampling)
    relay.step()
    ship(relay, main, "r", 0)
    main.finish_import("r", [])
    return relay, main


SECRET = "s3cret"


SAMPLING = SamplingParams(max_tokens=4, ignore_eos=True)


class RecordingHandler:
    """Imports into a real engine and records what the receiver told it."""

    def __init__(self, engine: HfEngine):
        self.engine = engine
        self.events: list[tuple[str, str]] = []
        self.ended = asyncio.Event()
        self.aborted = asyncio.Event()

    async def open_flow(self, flow_open, stats):
        if flow_open.request_id == "refuse-me":
            raise InvalidRequestState("refused on purpose")
        self.events.append(("open", flow_open.request_id))
        return self.engine.begin_import(flow_open.request_id, flow_open.token_ids, flow_open.sampling)

    async def import_frame(self, request_id, frame):
        self.engine.import_frame(frame)
        self.events.append(("frame", request_id))

    async def end_flow(self, request_id, end, stats):
        self.engine.finish_import(request_id, end.output_token_ids)
        self.events.append(("end", request_id))
        self.ended.set()

    async def abort_flow(self, request_id, reason):
        self.engine.free(request_id)
        self.events.append(("abort", reason))
        self.aborted.set()


def flow_open_for(request_id: str, prompt: list[int]) -> FlowOpen:
    return FlowOpen(
        request_id=request_id,
        role="main_decode",
        token_ids=prompt,
        sampling=SAMPLING,
        seed=1,
        sender_id="test",
        unix_s=0.0,
        nonce="",
    )


SLOW_WAN = LinkProfile(bandwidth_bps=50e6, rtt_ms=40, jitter_ms=2, seed=1)


def chat_prompt(tiny, content: str) -> list[int]:
    return list(
        tiny.tokenizer.apply_chat_template(
            [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=True, return_dict=False
        )
    )


def expected_text(tiny, prompt_ids: list[int], max_tokens: int) -> str:
    return tiny.tokenizer.decode(reference_greedy(tiny, prompt_ids, max_tokens), skip_special_tokens=True)


async def post(stack, path: str, body, *, raw: bool = False):
    async with aiohttp.ClientSession() as session:
        data = body if raw else json.dumps(body)
        async with session.post(
            stack.base_url + path, data=data, headers={"Content-Type": "application/json"}
        ) as response:
            return response.status, await response.json()


async def stream(stack, path: str, body) -> list[dict]:
    chunks = []
    async with aiohttp.ClientSession() as session:
        async with session.post(stack.base_url + path, json={**body, "stream": True}) as response:
            assert response.status == 200
            async for line in response.content:
                line = line.decode().strip()
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunks.append(json.loads(line[6:]))
    return chunks


def chat_body(content: str, max_tokens: int, **extra) -> dict:
    return {
        "model": "tiny",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        **extra,
    }


CATCH_UP_WAN = LinkProfile(bandwidth_bps=1e6, rtt_ms=4, jitter_ms=0, seed=2)


def held_engine_step(fn, args, kwargs, hold):
    """A call submitted to an engine worker, made to run ``hold()`` first on the engine thread
    when it is the engine loop's step (``step_if_work``) and the engine has work; an idle step
    returns None at once, other calls run as they are."""
    if getattr(fn, "__name__", "") != "step_if_work":
        return partial(fn, *args, **kwargs)
    engine = args[0]

    def held():
        if not engine.has_work():
            return None
        hold()
        return fn(*args, **kwargs)

    return held
