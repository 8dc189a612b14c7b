"""From an OpenAI request body to prompt token ids, and back from token ids to text.

All tokenizer work runs on one thread of its own (the fast tokenizer is not safe to call from
two threads at once) so that a long prompt never holds the event loop.
"""

import asyncio
from concurrent.futures import ThreadPoolExecutor

import jinja2
import msgspec

from services.router import openai_api
from services.router.api_error import ApiError
from services.router.detokenizer import Detokenizer
from services.router.openai_api import ParsedRequest
from services.router.token_bytes import TokenBytes
from shared.model_loader import ModelMetadata

HEAVY_DETOKENIZE_TOKENS = 64
"""Token batches at least this long are detokenized on the tokenizer thread, not the event loop."""


class PromptBuilder:
    """Validates bodies against the served model and turns them into ``ParsedRequest`` objects."""

    def __init__(self, metadata: ModelMetadata, served_model_name: str, default_max_tokens: int):
        self.metadata = metadata
        self.served_model_name = served_model_name
        self.default_max_tokens = default_max_tokens
        self.system_fingerprint = ""
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenize")
        self._max_token_chars = 0
        self._token_bytes: TokenBytes | None = None

    async def start(self, system_fingerprint: str):
        """Learn the longest token's length (the bound ``check_length`` uses) and each token's
        bytes where the tokenizer allows (``TokenBytes``: detokenizing without tokenizer calls)."""
        self.system_fingerprint = system_fingerprint
        vocab = await self.run(self.metadata.tokenizer.get_vocab)
        self._max_token_chars = max(map(len, vocab))
        self._token_bytes = await self.run(TokenBytes.of, self.metadata.tokenizer)

    def detokenizer(self, stop: tuple[str, ...]) -> Detokenizer:
        """A new stream's detokenizer, cut at ``stop``."""
        return Detokenizer(self.metadata.tokenizer, stop, self._token_bytes)

    def stop(self):
        self._thread.shutdown(wait=False, cancel_futures=True)

    async def run(self, function, *args):
        """``function(*args)`` on the tokenizer thread."""
        return await asyncio.get_running_loop().run_in_executor(self._thread, function, *args)

    async def detokenize_batch(self, detok: Detokenizer, batch: list[int]) -> str:
        """The text a batch of new tokens adds (long batches off the event loop)."""
        if len(batch) < HEAVY_DETOKENIZE_TOKENS:
            return detok.add(batch)
        return await self.run(detok.add, batch)

    def check_model(self, model):
        if model != self.served_model_name:
            raise ApiError(
                404,
                f"model {model!r} does not exist; this server serves {self.served_model_name!r}",
                param="model",
                code="model_not_found",
            )

    def parse(self, body: dict, chat: bool) -> ParsedRequest:
        """A completion or chat body → the request to run; ApiError(4xx) when it cannot run."""
        model = body.get("model")
        self.check_model(model)
        sampling = openai_api.parse_sampling(body, self.default_max_tokens, chat)
        stream, include_usage = openai_api.stream_flags(body)
        limit = self.metadata.max_context_tokens
        if chat:
            prompt = self.render_chat(openai_api.chat_messages(body), add_generation_prompt=True)
        else:
            prompt = self._completion_prompt(body.get("prompt"))
        if body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
            room = max(1, min(sampling.max_tokens, limit - len(prompt)))
            sampling = openai_api.checked(msgspec.structs.replace(sampling, max_tokens=room))
        if len(prompt) + sampling.max_tokens > limit:
            raise ApiError(
                400,
                f"prompt ({len(prompt)} tokens) plus max_tokens ({sampling.max_tokens}) "
                f"exceeds the model's context of {limit} tokens",
                param="messages" if chat else "prompt",
                code="context_length_exceeded",
            )
        return ParsedRequest(
            chat=chat,
            model=model,
            prompt_token_ids=prompt,
            sampling=sampling,
            stream=stream,
            include_usage=include_usage,
            system_fingerprint=self.system_fingerprint,
        )

    def tokenize(self, body: dict) -> list[int]:
        """vLLM's ``/tokenize`` body (a ``prompt`` or chat ``messages``) → token ids."""
        if "messages" in body:
            return self.render_chat(
                openai_api.chat_messages(body),
                add_generation_prompt=body.get("add_generation_prompt", True) is not False,
            )
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            raise ApiError(400, "'prompt' (a string) or 'messages' is required", param="prompt")
        self._check_length(len(prompt), "prompt")
        return self.metadata.tokenizer.encode(prompt, add_special_tokens=body.get("add_special_tokens") is True)

    def check_token_ids(self, tokens):
        """400 unless ``tokens`` is a list of ids in the vocabulary."""
        if not self._are_token_ids(tokens):
            vocab = self.metadata.vocab_size
            raise ApiError(400, f"'tokens' must be a list of token ids in [0, {vocab})", param="tokens")

    def _are_token_ids(self, tokens) -> bool:
        vocab = self.metadata.vocab_size
        return isinstance(tokens, list) and all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in tokens
        )

    def render_chat(self, messages: list[dict], add_generation_prompt: bool) -> list[int]:
        """The chat template's token ids for ``messages``; 400 when the template cannot render them."""
        self._check_length(sum(len(m["content"]) for m in messages), "messages")
        try:
            return list(
                self.metadata.tokenizer.apply_chat_template(
                    messages, add_generation_prompt=add_generation_prompt, tokenize=True, return_dict=False
                )
            )
        except (jinja2.TemplateError, TypeError, ValueError, KeyError, AttributeError) as exc:
            raise ApiError(400, f"the chat template cannot render these messages: {exc}", param="messages") from None

    def _completion_prompt(self, prompt) -> list[int]:
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, str) and prompt:
            self._check_length(len(prompt), "prompt")
            return self.metadata.tokenizer.encode(prompt, add_special_tokens=False)
        if prompt and self._are_token_ids(prompt):
            return prompt
        raise ApiError(400, "'prompt' must be a non-empty string or a list of token ids", param="prompt")

    def _check_length(self, num_chars: int, param: str):
        """Refuse text that cannot fit the context whatever it tokenizes to, before tokenizing it.

        No token spells more than ``_max_token_chars`` characters, so text this long has at
        least ``num_chars / _max_token_chars`` tokens.
        """
        at_least = num_chars // max(1, self._max_token_chars)
        if at_least > self.metadata.max_context_tokens:
            raise ApiError(
                400,
                f"the {param} ({num_chars} characters, at least {at_least} tokens) exceed "
                f"the model's context of {self.metadata.max_context_tokens} tokens",
                param=param,
                code="context_length_exceeded",
            )
