"""A second engine backend, with no transformers inside: proof that the services need nothing
but ``EngineBackend``.

Its "model" reads its own KV: the next token is a function of every key held for the
sequence, ``1000 + sum((p + 1) * key[p]) % 1000``, where ``key[p]`` is the token at position
``p`` and ``value[p]`` is ``p``. A decoder that lost or garbled a block of imported KV
therefore produces other tokens, and ``import_frame`` checks the values it receives.
Each step takes ``step_s`` of wall time, like a real forward pass, so a relay emits eager
tokens while the WAN copy is still crossing.
"""

import math
import time
from dataclasses import dataclass, field

import torch

from shared.block_hash import ROOT_PARENT_HASH, hash_blocks
from shared.engine.backend import (
    BackendOptions,
    EngineBackend,
    EngineLoad,
    RequestStatus,
    RequestView,
    StepOutput,
    register_backend,
)
from shared.engine.sampling import SamplingParams
from shared.errors import FrameOwnershipError, InvalidRequestState, UnknownRequest
from shared.kv_layout import KvLayout
from shared.kv_wire import FrameExpectation, KvFrame, encode_frame

FINGERPRINT = "fake-model-v1"
NUM_BLOCKS = 4096


def next_token(keys: list[int]) -> int:
    """The fake model: the token after a sequence whose KV keys are ``keys``."""
    return 1000 + sum((p + 1) * k for p, k in enumerate(keys)) % 1000


def reference(prompt: list[int], max_tokens: int) -> list[int]:
    """What the fake model generates for ``prompt`` run alone (the flow test's reference)."""
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(next_token(tokens))
    return tokens[len(prompt) :]


@dataclass
class _Request:
    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    sampling: SamplingParams
    status: RequestStatus = RequestStatus.RUNNING
    keys: list[int] = field(default_factory=list)
    num_cached_tokens: int = 0
    num_imported_tokens: int = 0
    finish_reason: str | None = None
    hold: bool = False

    def view(self) -> RequestView:
        outputs = tuple(self.token_ids[self.num_prompt_tokens :])
        return RequestView(
            self.request_id,
            self.status,
            self.num_prompt_tokens,
            self.num_cached_tokens,
            self.num_imported_tokens,
            outputs,
            (None,) * len(outputs) if self.sampling.logprobs is not None else None,
            self.finish_reason,
            self.sampling.max_tokens,
        )


class FakeBackend(EngineBackend):
    """The fake model behind the full ``EngineBackend`` contract."""

    def __init__(self, options: BackendOptions, step_s: float = 0.004):
        self.block_size = options.block_size
        self.frame_expectation = FrameExpectation(FINGERPRINT, KvLayout(1, 1, 1, self.block_size, torch.float32))
        self.vocab_size = 2000
        self.max_context_len = 8192
        self._listener = options.kv_listener
        self._step_s = step_s
        self._requests: dict[str, _Request] = {}
        self._cache: dict[int, list[int]] = {}  # block hash -> the block's keys

    # ----- requests ---------------------------------------------------------------------

    def add_request(self, request_id, prompt_token_ids, sampling, seed=None) -> RequestView:
        request = self._new(request_id, prompt_token_ids, sampling)
        request.keys = self._cached_keys(prompt_token_ids[:-1])
        request.num_cached_tokens = len(request.keys)
        self._requests[request_id] = request
        return request.view()

    def abort(self, request_id) -> bool:
        return self._requests.pop(request_id, None) is not None

    def free(self, request_id) -> RequestView:
        request = self._get(request_id)
        del self._requests[request_id]
        return request.view()

    def pause(self, request_id):
        self._get(request_id, RequestStatus.RUNNING).status = RequestStatus.PAUSED

    def resume(self, request_id):
        self._get(request_id, RequestStatus.PAUSED).status = RequestStatus.RUNNING

    def extend(self, request_id, token_ids, sample=True) -> RequestView:
        request = self._get(request_id, RequestStatus.RUNNING)
        if len(request.keys) < len(request.token_ids):
            raise InvalidRequestState(f"request {request_id!r} still has pending tokens")
        self._append(request, token_ids)
        request.hold = not sample
        return request.view()

    def request(self, request_id) -> RequestView | None:
        request = self._requests.get(request_id)
        return request.view() if request else None

    def request_ids(self) -> list[str]:
        return list(self._requests)

    # ----- stepping ---------------------------------------------------------------------

    def has_work(self) -> bool:
        return any(
            r.status is RequestStatus.RUNNING and len(r.keys) < len(r.token_ids) for r in self._requests.values()
        )

    def step(self) -> list[StepOutput]:
        outputs = []
        for request in list(self._requests.values()):
            if request.status is not RequestStatus.RUNNING or len(request.keys) == len(request.token_ids):
                continue
            request.keys = list(request.token_ids)  # "compute" the pending tokens' KV
            self._cache_blocks(request)
            index = len(request.token_ids) - request.num_prompt_tokens
            if request.hold:
                request.hold = False
                outputs.append(StepOutput(request.request_id, None, index, False, absorbed=True))
                continue
            token = next_token(request.keys)
            self._append(request, [token])
            outputs.append(
                StepOutput(request.request_id, token, index, request.finish_reason is not None, request.finish_reason)
            )
        if outputs:
            time.sleep(self._step_s)  # a forward pass takes time
        return outputs

    # ----- KV over the wire -------------------------------------------------------------

    def begin_import(self, request_id, prompt_token_ids, sampling, seed=None) -> int:
        request = self._new(request_id, prompt_token_ids, sampling)
        request.status = RequestStatus.IMPORTING
        request.keys = self._cached_keys(prompt_token_ids)
        request.num_cached_tokens = len(request.keys)
        self._requests[request_id] = request
        return len(request.keys)

    def import_frame(self, frame: KvFrame):
        header = frame.header
        request = self._requests.get(header.request_id)
        if request is None or request.status is not RequestStatus.IMPORTING:
            raise FrameOwnershipError(f"no KV import under way for request {header.request_id!r}")
        start = header.first_token_index
        if start != len(request.keys) or header.token_ids != request.token_ids[start : start + header.num_tokens]:
            raise FrameOwnershipError(f"frame at token {start} is not the next part of the prompt")
        keys, values = frame.kv[0, 0, :, 0, 0].tolist(), frame.kv[0, 1, :, 0, 0].tolist()
        if values != [float(p) for p in range(start, start + header.num_tokens)]:
            raise FrameOwnershipError("frame values are not the positions the fake model wrote")
        request.keys.extend(int(k) for k in keys)
        request.num_imported_tokens += header.num_tokens
        self._cache_blocks(request)

    def finish_import(self, request_id, token_ids, logprobs=()) -> RequestView:
        request = self._get(request_id, RequestStatus.IMPORTING)
        request.status = RequestStatus.RUNNING
        self._append(request, token_ids)
        return request.view()

    def export_frames(
        self, request_id, first_token_index=0, end_token_index=None, *, max_tokens_per_frame=512, traceparent=None
    ) -> list[list]:
        request = self._get(request_id)
        end = len(request.keys) if end_token_index is None else end_token_index
        step = max(self.block_size, max_tokens_per_frame // self.block_size * self.block_size)
        hashes = hash_blocks(request.token_ids[:end], self.block_size)
        frames = []
        for start in range(first_token_index, end, step):
            stop = min(start + step, end)
            kv = torch.tensor([[request.keys[start:stop], list(range(start, stop))]], dtype=torch.float32)
            first_block = start // self.block_size
            frames.append(
                encode_frame(
                    kv=kv.view(1, 2, stop - start, 1, 1).contiguous(),
                    model_fingerprint=FINGERPRINT,
                    block_size=self.block_size,
                    request_id=request_id,
                    first_block_index=first_block,
                    parent_hash=hashes[first_block - 1] if first_block else ROOT_PARENT_HASH,
                    token_ids=request.token_ids[start:stop],
                    traceparent=traceparent,
                )
            )
        return frames

    # ----- cache and load ---------------------------------------------------------------

    def cached_prefix_blocks(self, block_hashes) -> int:
        count = 0
        for block_hash in block_hashes:
            if block_hash not in self._cache:
                break
            count += 1
        return count

    def cached_block_hashes(self) -> list[int]:
        return list(self._cache)

    def load(self) -> EngineLoad:
        used = sum(self._blocks_of(r) for r in list(self._requests.values()))
        return EngineLoad(len(self._requests), NUM_BLOCKS, NUM_BLOCKS - used, used)

    def blocks_held_only_by(self, request_ids) -> int:
        return sum(self._blocks_of(r) for rid, r in list(self._requests.items()) if rid in request_ids)

    # ----- helpers ----------------------------------------------------------------------

    def _new(self, request_id, prompt_token_ids, sampling) -> _Request:
        if request_id in self._requests:
            raise InvalidRequestState(f"request {request_id!r} is already live")
        sampling.validate()
        return _Request(request_id, list(prompt_token_ids), len(prompt_token_ids), sampling)

    def _get(self, request_id, status: RequestStatus | None = None) -> _Request:
        request = self._requests.get(request_id)
        if request is None:
            raise UnknownRequest(f"unknown request {request_id!r}")
        if status is not None and request.status is not status:
            raise InvalidRequestState(f"request {request_id!r} is {request.status.value}")
        return request

    def _append(self, request: _Request, token_ids: list[int]):
        request.token_ids.extend(token_ids)
        if token_ids and len(request.token_ids) - request.num_prompt_tokens >= request.sampling.max_tokens:
            request.status, request.finish_reason = RequestStatus.FINISHED, "length"

    def _cached_keys(self, token_ids: list[int]) -> list[int]:
        keys = []
        for block_hash in hash_blocks(token_ids, self.block_size):
            if block_hash not in self._cache:
                break
            keys.extend(self._cache[block_hash])
        return keys

    def _cache_blocks(self, request: _Request):
        full = len(request.keys) // self.block_size
        stored = []
        for index, block_hash in enumerate(hash_blocks(request.token_ids[: full * self.block_size], self.block_size)):
            if block_hash not in self._cache:
                self._cache[block_hash] = request.keys[index * self.block_size : (index + 1) * self.block_size]
                stored.append(block_hash)
        if stored and self._listener:
            self._listener("stored", stored)

    def _blocks_of(self, request: _Request) -> int:
        return math.ceil(len(request.token_ids) / self.block_size)


register_backend("fake")(lambda options, loaded=None: FakeBackend(options))
