"""Helpers the tests share: the transformers reference, real-text prompts, the ``pdd`` CLI."""

import subprocess
import sys
from pathlib import Path

import torch

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
