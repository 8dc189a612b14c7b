"""A fast stand-in engine (``--engine standin``): the whole ``EngineBackend`` contract, no model.

It exists to load the control plane (router, NATS, the WAN link, the bulk channel, the
decoders' services) at token rates a real model on these machines cannot reach, with
everything but the forward pass real: ``pdd bench control-plane`` runs on it.

The "model" reads its own KV, so a decoder that lost or garbled imported KV, or a handoff
that skipped a token, produces other tokens: the key of position ``p`` is the token there and
its value is ``p``, and the next token is ``1000 + sum((p + 1) * key[p]) % 1000``. The sum is
kept per sequence as tokens are computed, so a step costs O(sequences), not O(context). The
output is deterministic (every pipeline and every handoff give the same tokens, greedy or
not: sampling parameters other than ``max_tokens`` are accepted and ignored). It has no
tokenizer: a request ends at ``max_tokens`` only (no end-of-sequence token, no stop string;
the router still cuts the text at a stop string).

Each step takes ``step_s`` of wall time (``--standin-step-ms``), like a forward pass: the
step period sets the token rate, ``sequences / step_s`` per instance. Complete blocks are
cached (prefix reuse, KV events) under LRU eviction at ``kv_cache_bytes``.
"""

import collections
import time
from dataclasses import dataclass, field

import torch

from shared.block_hash import ROOT_PARENT_HASH, hash_block, hash_blocks
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
from shared.errors import (
    ContextLengthExceeded,
    FrameOwnershipError,
    InvalidRequestState,
    OutOfKvBlocks,
    UnknownRequest,
)
from shared.kv_layout import KvLayout
from shared.kv_wire import FrameExpectation, KvFrame, encode_frame, tokens_per_frame

FINGERPRINT = "standin-v1"
BYTES_PER_TOKEN = 8
"""One float32 key and one value per token (the pool's size in blocks follows from it)."""
VOCAB_SIZE = 1 << 17
"""Prompt token ids below this are accepted (covers the tokenizers served here)."""
MAX_CONTEXT_LEN = 32768
FIRST_OUTPUT_TOKEN, NUM_OUTPUT_TOKENS = 1000, 1000


@dataclass
class _Sequence:
    """One request on the stand-in; ``keys`` are the tokens whose KV exists."""

    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    sampling: SamplingParams
    status: RequestStatus = RequestStatus.RUNNING
    keys: list[int] = field(default_factory=list)
    key_sum: int = 0
    num_cached_tokens: int = 0
    num_imported_tokens: int = 0
    finish_reason: str | None = None
    hold: bool = False
    block_hashes: list[int] = field(default_factory=list)

    def view(self) -> RequestView:
        outputs = tuple(self.token_ids[self.num_prompt_tokens :])
        logprobs = (None,) * len(outputs) if self.sampling.logprobs is not None else None
        return RequestView(
            self.request_id,
            self.status,
            self.num_prompt_tokens,
            self.num_cached_tokens,
            self.num_imported_tokens,
            outputs,
            logprobs,
            self.finish_reason,
            self.sampling.max_tokens,
            len(self.keys),
        )

    def compute(self, keys: list[int]):
        """Append KV for ``keys`` (the next tokens)."""
        start = len(self.keys)
        self.key_sum += sum((start + i + 1) * k for i, k in enumerate(keys))
        self.keys.extend(keys)

    def next_token(self) -> int:
        return FIRST_OUTPUT_TOKEN + self.key_sum % NUM_OUTPUT_TOKENS


class StandinEngine(EngineBackend):
    """The stand-in "model" behind the full ``EngineBackend`` contract."""

    def __init__(self, options: BackendOptions):
        self.block_size = options.block_size
        self.frame_expectation = FrameExpectation(FINGERPRINT, KvLayout(1, 1, 1, self.block_size, torch.float32))
        self.vocab_size = VOCAB_SIZE
        self.max_context_len = MAX_CONTEXT_LEN
        self._step_s = options.standin_step_s
        self._listener = options.kv_listener
        self._cache_enabled = options.enable_prefix_cache
        self._num_blocks = max(1, options.kv_cache_bytes // (self.block_size * BYTES_PER_TOKEN))
        self._sequences: dict[str, _Sequence] = {}
        self._cache: collections.OrderedDict[int, list[int]] = collections.OrderedDict()  # LRU: hash -> keys

    # ----- requests ---------------------------------------------------------------------

    def add_request(self, request_id, prompt_token_ids, sampling, seed=None) -> RequestView:
        seq = self._new(request_id, prompt_token_ids, sampling)
        seq.compute(self._cached_keys(seq, prompt_token_ids[:-1]))
        seq.num_cached_tokens = len(seq.keys)
        self._sequences[request_id] = seq
        return seq.view()

    def abort(self, request_id) -> bool:
        return self._sequences.pop(request_id, None) is not None

    def free(self, request_id) -> RequestView:
        view = self._get(request_id).view()
        del self._sequences[request_id]
        return view

    def pause(self, request_id):
        self._get(request_id, RequestStatus.RUNNING).status = RequestStatus.PAUSED

    def resume(self, request_id):
        self._get(request_id, RequestStatus.PAUSED).status = RequestStatus.RUNNING

    def extend(self, request_id, token_ids, sample=True) -> RequestView:
        seq = self._get(request_id, RequestStatus.RUNNING)
        if len(seq.keys) < len(seq.token_ids):
            raise InvalidRequestState(f"request {request_id!r} still has pending tokens")
        self._append(seq, token_ids)
        seq.hold = not sample and seq.status is RequestStatus.RUNNING
        return seq.view()

    def request(self, request_id) -> RequestView | None:
        seq = self._sequences.get(request_id)
        return seq.view() if seq else None

    def request_ids(self) -> list[str]:
        return list(self._sequences)

    # ----- stepping ---------------------------------------------------------------------

    def has_work(self) -> bool:
        return any(_pending(s) for s in self._sequences.values())

    def step(self) -> list[StepOutput]:
        """Every running sequence with pending tokens computes them and samples one token;
        the step then lasts ``step_s`` in all."""
        started = time.perf_counter()
        outputs = [self._step_one(s) for s in list(self._sequences.values()) if _pending(s)]
        if outputs and self._step_s:
            time.sleep(max(0.0, self._step_s - (time.perf_counter() - started)))
        return outputs

    def _step_one(self, seq: _Sequence) -> StepOutput:
        seq.compute(seq.token_ids[len(seq.keys) :])
        self._cache_blocks(seq)
        index = len(seq.token_ids) - seq.num_prompt_tokens
        if seq.hold:
            seq.hold = False
            return StepOutput(seq.request_id, None, index, False, absorbed=True)
        token = seq.next_token()
        self._append(seq, [token])
        return StepOutput(seq.request_id, token, index, seq.finish_reason is not None, seq.finish_reason)

    # ----- KV over the wire -------------------------------------------------------------

    def begin_import(self, request_id, prompt_token_ids, sampling, seed=None) -> int:
        seq = self._new(request_id, prompt_token_ids, sampling)
        seq.status = RequestStatus.IMPORTING
        seq.compute(self._cached_keys(seq, prompt_token_ids))
        seq.num_cached_tokens = len(seq.keys)
        self._sequences[request_id] = seq
        return len(seq.keys)

    def import_frame(self, frame: KvFrame):
        header = frame.header
        seq = self._sequences.get(header.request_id)
        if seq is None or seq.status is not RequestStatus.IMPORTING:
            raise FrameOwnershipError(f"no KV import under way for request {header.request_id!r}")
        start, count = header.first_token_index, header.num_tokens
        if start != len(seq.keys) or header.token_ids != seq.token_ids[start : start + count]:
            raise FrameOwnershipError(f"frame at token {start} is not the next part of the prompt")
        keys, values = frame.kv[0, 0, :, 0, 0].tolist(), frame.kv[0, 1, :, 0, 0].tolist()
        if values != [float(p) for p in range(start, start + count)]:
            raise FrameOwnershipError("frame values are not the positions the stand-in wrote")
        seq.compute([int(k) for k in keys])
        seq.num_imported_tokens += count
        self._cache_blocks(seq)

    def finish_import(self, request_id, token_ids, logprobs=()) -> RequestView:
        seq = self._get(request_id, RequestStatus.IMPORTING)
        seq.status = RequestStatus.RUNNING
        self._append(seq, token_ids)
        return seq.view()

    def export_frames(
        self, request_id, first_token_index=0, end_token_index=None, *, max_tokens_per_frame=512, traceparent=None
    ) -> list[list]:
        seq = self._get(request_id)
        end = len(seq.keys) if end_token_index is None else end_token_index
        step = tokens_per_frame(max_tokens_per_frame, self.block_size)
        hashes = hash_blocks(seq.token_ids[:end], self.block_size)
        return [
            self._frame(seq, start, min(start + step, end), hashes, traceparent)
            for start in range(first_token_index, end, step)
        ]

    def _frame(self, seq: _Sequence, start: int, stop: int, hashes: list[int], traceparent) -> list:
        kv = torch.tensor([[seq.keys[start:stop], list(range(start, stop))]], dtype=torch.float32)
        first_block = start // self.block_size
        return encode_frame(
            kv=kv.view(1, 2, stop - start, 1, 1).contiguous(),
            model_fingerprint=FINGERPRINT,
            block_size=self.block_size,
            request_id=seq.request_id,
            first_block_index=first_block,
            parent_hash=hashes[first_block - 1] if first_block else ROOT_PARENT_HASH,
            token_ids=seq.token_ids[start:stop],
            traceparent=traceparent,
        )

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
        used = sum(self._blocks_of(s) for s in list(self._sequences.values()))
        pending = sum(len(s.token_ids) - len(s.keys) for s in list(self._sequences.values()))
        free = max(0, self._num_blocks - used - len(self._cache))
        return EngineLoad(len(self._sequences), self._num_blocks, free, used, max(0, pending))

    def blocks_held_only_by(self, request_ids) -> int:
        return sum(self._blocks_of(s) for rid, s in list(self._sequences.items()) if rid in request_ids)

    # ----- helpers ----------------------------------------------------------------------

    def _new(self, request_id, prompt_token_ids, sampling) -> _Sequence:
        if request_id in self._sequences:
            raise InvalidRequestState(f"request {request_id!r} is already live")
        sampling.validate()
        if len(prompt_token_ids) + sampling.max_tokens > self.max_context_len:
            raise ContextLengthExceeded(
                f"prompt ({len(prompt_token_ids)}) + max_tokens ({sampling.max_tokens}) exceed {self.max_context_len}"
            )
        used = sum(self._blocks_of(s) for s in self._sequences.values())
        if used + -(-(len(prompt_token_ids) + 1) // self.block_size) > self._num_blocks:
            raise OutOfKvBlocks(f"no KV blocks for request {request_id!r}")
        return _Sequence(request_id, list(prompt_token_ids), len(prompt_token_ids), sampling)

    def _get(self, request_id, status: RequestStatus | None = None) -> _Sequence:
        seq = self._sequences.get(request_id)
        if seq is None:
            raise UnknownRequest(f"unknown request {request_id!r}")
        if status is not None and seq.status is not status:
            raise InvalidRequestState(f"request {request_id!r} is {seq.status.value}")
        return seq

    def _append(self, seq: _Sequence, token_ids: list[int]):
        seq.token_ids.extend(token_ids)
        if token_ids and len(seq.token_ids) - seq.num_prompt_tokens >= seq.sampling.max_tokens:
            seq.status, seq.finish_reason = RequestStatus.FINISHED, "length"

    def _cached_keys(self, seq: _Sequence, token_ids: list[int]) -> list[int]:
        """Keys of the cached leading blocks of ``token_ids`` (touched as recently used)."""
        if not self._cache_enabled:
            return []
        keys = []
        for block_hash in hash_blocks(token_ids, self.block_size):
            if block_hash not in self._cache:
                break
            self._cache.move_to_end(block_hash)
            keys.extend(self._cache[block_hash])
            seq.block_hashes.append(block_hash)
        return keys

    def _cache_blocks(self, seq: _Sequence):
        """Cache the sequence's newly complete blocks; evict the least recently used over capacity."""
        if not self._cache_enabled:
            return
        stored, size = [], self.block_size
        for index in range(len(seq.block_hashes), len(seq.keys) // size):
            parent = seq.block_hashes[-1] if seq.block_hashes else ROOT_PARENT_HASH
            block_hash = hash_block(parent, seq.token_ids[index * size : (index + 1) * size])
            seq.block_hashes.append(block_hash)
            if block_hash not in self._cache:
                self._cache[block_hash] = seq.keys[index * size : (index + 1) * size]
                stored.append(block_hash)
        evicted = []
        while len(self._cache) > self._num_blocks:
            evicted.append(self._cache.popitem(last=False)[0])
        if self._listener and stored:
            self._listener("stored", stored)
        if self._listener and evicted:
            self._listener("evicted", evicted)

    def _blocks_of(self, seq: _Sequence) -> int:
        return -(-len(seq.token_ids) // self.block_size)


def reference(prompt_token_ids: list[int], max_tokens: int) -> list[int]:
    """What the stand-in generates for a prompt run alone, from the model's definition (each
    next token from every key before it, not from the engine's running sums)."""
    tokens = list(prompt_token_ids)
    for _ in range(max_tokens):
        tokens.append(FIRST_OUTPUT_TOKEN + sum((p + 1) * k for p, k in enumerate(tokens)) % NUM_OUTPUT_TOKENS)
    return tokens[len(prompt_token_ids) :]


def _pending(seq: _Sequence) -> bool:
    return seq.status is RequestStatus.RUNNING and len(seq.keys) < len(seq.token_ids)


register_backend("standin")(lambda options, loaded=None: StandinEngine(options))
