"""The engine: continuous batching over a block KV pool, with prefix reuse, KV import/export
and token-ID extend — the three properties every PDD instance relies on.

One ``step()`` runs one packed forward pass over every schedulable sequence. A sequence is
schedulable when it knows tokens whose KV is not computed yet: a prompt (prefill), the
token it sampled last (decode), or token IDs handed over by a relay (extend). After the
pass, every sequence that has no pending tokens left samples its next token. Sequences
join and leave between steps.
"""

import math
import secrets
from dataclasses import dataclass

import torch

from shared.block_hash import ROOT_PARENT_HASH, hash_block, hash_blocks
from shared.engine import attention, logits_processing
from shared.engine.attention import ForwardPlan, SequencePlan, forward_plan
from shared.engine.block_manager import BlockManager
from shared.engine.kv_layout import DEFAULT_BLOCK_SIZE, KvLayout
from shared.engine.kv_pool import KvPool
from shared.engine.kv_transfer import KvTransfer
from shared.engine.logprobs import TokenLogprobs, token_logprobs
from shared.engine.prefix_cache import KvEventListener, PrefixCache
from shared.engine.sampling import SamplingParams, sample_token
from shared.engine.sequence import Sequence, SequenceStatus
from shared.errors import (
    ContextLengthExceeded,
    InvalidRequestState,
    OutOfKvBlocks,
    UnknownRequest,
)
from shared.kv_wire import FrameExpectation
from shared.model_loader import LoadedModel

DEFAULT_KV_CACHE_BYTES = 1 << 30
DEFAULT_MAX_BATCH_TOKENS = 2048


@dataclass(frozen=True)
class StepOutput:
    """One sampled token, an absorbed handoff chunk, or a failure, of one sequence in one step.

    Attributes:
        request_id: The sequence it belongs to.
        token_id: The sampled token; None when the sequence failed or only absorbed tokens.
        token_index: Index of ``token_id`` among the request's output tokens (for an
            absorbed chunk: how many output tokens the sequence now holds KV for).
        finished: Whether the sequence stopped with this output.
        finish_reason: ``stop``, ``length`` or ``error`` when finished.
        error: What went wrong, when ``finish_reason`` is ``error``.
        absorbed: True when a held extend (``extend(..., sample=False)``) has been computed.
        logprobs: The sampled token's log-probabilities, when the request asked for them.
    """

    request_id: str
    token_id: int | None
    token_index: int
    finished: bool
    finish_reason: str | None = None
    error: str | None = None
    absorbed: bool = False
    logprobs: TokenLogprobs | None = None


class Engine(KvTransfer):
    """A model instance with its own KV pool and prefix cache. Not thread-safe."""

    def __init__(
        self,
        loaded: LoadedModel,
        *,
        num_blocks: int | None = None,
        kv_cache_bytes: int = DEFAULT_KV_CACHE_BYTES,
        block_size: int = DEFAULT_BLOCK_SIZE,
        max_batch_tokens: int = DEFAULT_MAX_BATCH_TOKENS,
        kv_listener: KvEventListener | None = None,
        enable_prefix_cache: bool = True,
    ):
        self.loaded = loaded
        self.model = loaded.model
        attention.install(self.model)
        self.layout = KvLayout.from_model(self.model, block_size)
        if num_blocks is None:
            num_blocks = max(1, kv_cache_bytes // self.layout.kv_bytes_per_block)
        self.pool = KvPool(self.layout, num_blocks, loaded.device)
        self.prefix_cache = PrefixCache(kv_listener)
        self.enable_prefix_cache = enable_prefix_cache
        self.blocks = BlockManager(num_blocks, self.prefix_cache)
        self.max_batch_tokens = max_batch_tokens
        self.max_context_len = self.model.config.max_position_embeddings
        self.frame_expectation = FrameExpectation(loaded.fingerprint, self.layout)
        self._eos_ids = loaded.eos_token_ids
        self._sequences: dict[str, Sequence] = {}
        self.num_preemptions = 0

    # ----- lifecycle of a sequence -------------------------------------------------------

    def add_request(self, request_id: str, prompt_token_ids: list[int],
                    sampling: SamplingParams, seed: int | None = None) -> Sequence:
        """Queue a prompt for prefill, reusing whatever prefix blocks the cache holds.

        The block holding the last prompt token is never taken from the cache: the model
        must compute at least one token to produce the next-token logits. ``seed``
        overrides ``sampling.seed`` (instances of one request share the router's seed).
        """
        seq = self._new_sequence(request_id, prompt_token_ids, sampling, seed)
        hashes = hash_blocks(prompt_token_ids[:-1], self.layout.block_size)
        hit = self._lookup(hashes)
        self.blocks.acquire(hit)
        self._adopt_cached(seq, hit, hashes)
        self._sequences[request_id] = seq
        return seq

    def extend(self, request_id: str, token_ids: list[int], sample: bool = True) -> Sequence:
        """Hand a running, idle sequence tokens produced elsewhere; the next step computes
        their KV in one pass and samples the token after them (unless they end the request).

        With ``sample=False`` (a catch-up chunk) the step only computes their KV and reports
        an ``absorbed`` output; the sequence then waits for the next extend.
        """
        seq = self._get(request_id, SequenceStatus.RUNNING)
        if seq.num_pending_tokens:
            raise InvalidRequestState(f"request {request_id!r} still has pending tokens")
        if not token_ids:
            raise ValueError("extend needs at least one token")
        self._append_outputs(seq, token_ids)
        seq.hold_after_compute = not sample
        return seq

    def pause(self, request_id: str):
        """Stop scheduling a running sequence (e.g. while a handoff is in flight)."""
        self._get(request_id, SequenceStatus.RUNNING).status = SequenceStatus.PAUSED

    def resume(self, request_id: str):
        """Schedule a paused sequence again."""
        self._get(request_id, SequenceStatus.PAUSED).status = SequenceStatus.RUNNING

    def free(self, request_id: str) -> Sequence:
        """Forget a sequence and release its blocks (cached ones stay reusable)."""
        seq = self._sequences.pop(request_id, None)
        if seq is None:
            raise UnknownRequest(f"unknown request {request_id!r}")
        self.blocks.release(seq.block_ids)
        seq.block_ids = []
        return seq

    def get(self, request_id: str) -> Sequence:
        """The live sequence ``request_id``."""
        seq = self._sequences.get(request_id)
        if seq is None:
            raise UnknownRequest(f"unknown request {request_id!r}")
        return seq

    def free_if_held(self, request_id: str) -> bool:
        """Free ``request_id`` if it is still live (a cancel may race its finish); True if it was."""
        if request_id not in self._sequences:
            return False
        self.free(request_id)
        return True

    def request_ids(self) -> list[str]:
        """Ids of the live sequences."""
        return list(self._sequences)

    def holds(self, request_id: str) -> bool:
        """Whether ``request_id`` is a live sequence here."""
        return request_id in self._sequences

    def has_work(self) -> bool:
        """Whether a step would compute anything."""
        return any(seq.schedulable for seq in self._sequences.values())

    @property
    def num_sequences(self) -> int:
        """Live sequences, in any state."""
        return len(self._sequences)

    # ----- stepping ----------------------------------------------------------------------

    def step(self) -> list[StepOutput]:
        """Run one forward pass over all schedulable sequences; return what they sampled."""
        scheduled, outputs = self._schedule()
        if not scheduled:
            return outputs
        input_ids, positions, slots, plans, samplers = [], [], [], [], []
        for seq, num_tokens in scheduled:
            start, end = seq.num_kv_tokens, seq.num_kv_tokens + num_tokens
            plans.append(SequencePlan(
                len(input_ids), len(input_ids) + num_tokens,
                torch.tensor(seq.block_ids[:math.ceil(end / self.layout.block_size)],
                             dtype=torch.long, device=self.loaded.device),
                end))
            input_ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            slots.extend(self._slot(seq, position) for position in range(start, end))
            if end == len(seq.token_ids) and not seq.hold_after_compute:
                samplers.append((seq, len(input_ids) - 1))
        logits = self._forward(input_ids, positions, slots, plans, [row for _, row in samplers])
        for seq, num_tokens in scheduled:
            seq.num_kv_tokens += num_tokens
            seq.num_computed_tokens += num_tokens
            self._cache_full_blocks(seq)
            if seq.hold_after_compute and not seq.num_pending_tokens and seq.status is SequenceStatus.RUNNING:
                seq.hold_after_compute = False
                outputs.append(StepOutput(seq.request_id, None, len(seq.output_token_ids), False,
                                          absorbed=True))
        outputs.extend(self._sample(seq, logits[i]) for i, (seq, _) in enumerate(samplers))
        return outputs

    def generate(self, request_id: str, prompt_token_ids: list[int],
                 sampling: SamplingParams) -> list[int]:
        """Prefill and decode one request to the end alone; free it; return its output tokens."""
        self.add_request(request_id, prompt_token_ids, sampling)
        try:
            while self.get(request_id).status is SequenceStatus.RUNNING:
                self.step()
            return self.get(request_id).output_token_ids
        finally:
            self.free(request_id)

    def _schedule(self) -> tuple[list[tuple[Sequence, int]], list[StepOutput]]:
        """Pick (sequence, tokens) pairs under the token budget: decodes first, then chunks
        of prompts and extends. A sequence that cannot get blocks waits for others to
        finish; if none can run at all, the youngest running sequence is preempted (its
        blocks freed, its KV recomputed later), and only a sequence that cannot fit even
        then fails with an error output."""
        candidates = sorted((s for s in self._sequences.values() if s.schedulable),
                            key=lambda s: s.num_pending_tokens != 1)
        budget, scheduled, starved = self.max_batch_tokens, [], []
        for seq in candidates:
            num_tokens = min(seq.num_pending_tokens, budget)
            if num_tokens == 0:
                break
            try:
                self._ensure_blocks(seq, seq.num_kv_tokens + num_tokens)
            except OutOfKvBlocks:
                starved.append(seq)
                continue
            scheduled.append((seq, num_tokens))
            budget -= num_tokens
        if scheduled or not starved:
            return scheduled, []
        victim = self._preemption_victim(spare=starved[0])
        if victim is not None:
            self._preempt(victim)
            return self._schedule()
        seq = starved[0]
        seq.status, seq.finish_reason = SequenceStatus.FINISHED, "error"
        error = f"out of KV blocks: {len(seq.token_ids)} tokens do not fit the pool"
        return [], [StepOutput(seq.request_id, None, len(seq.output_token_ids), True, "error", error)]

    def _preemption_victim(self, spare: Sequence) -> Sequence | None:
        """The youngest running sequence holding blocks, other than ``spare`` (the oldest waits)."""
        running = [s for s in self._sequences.values()
                   if s is not spare and s.status is SequenceStatus.RUNNING and s.block_ids]
        return running[-1] if running else None

    def _preempt(self, seq: Sequence):
        """Free a running sequence's blocks; it recomputes its KV later (vLLM's recompute
        preemption). Its output is unchanged: token ``i`` depends only on the tokens before it
        and on ``(seed, i)``."""
        self.blocks.release(seq.block_ids)
        seq.block_ids, seq.block_hashes, seq.num_kv_tokens = [], [], 0
        self.num_preemptions += 1

    def _forward(self, input_ids, positions, slots, plans, sample_rows) -> torch.Tensor:
        device = self.loaded.device
        plan = ForwardPlan(self.pool, torch.tensor(slots, dtype=torch.long, device=device), plans)
        # With nothing to sample (a prompt chunk), still keep one row: HF treats 0 as "all".
        keep = torch.tensor(sample_rows or [len(input_ids) - 1], dtype=torch.long, device=device)
        with torch.inference_mode(), forward_plan(plan):
            out = self.model(
                input_ids=torch.tensor([input_ids], device=device),
                position_ids=torch.tensor([positions], device=device),
                use_cache=False, logits_to_keep=keep,
            )
        return out.logits[0]

    def _sample(self, seq: Sequence, logits: torch.Tensor) -> StepOutput:
        index, params = len(seq.output_token_ids), seq.sampling
        processed = logits_processing.apply(logits, params, seq.token_ids, seq.num_prompt_tokens, self._eos_ids)
        token = sample_token(processed, params, seq.seed, index)
        logprobs = token_logprobs(logits, token, params.logprobs) if params.logprobs is not None else None
        seq.token_ids.append(token)
        seq.output_logprobs.append(logprobs)
        reason = self._finish_reason(seq, token)
        if reason:
            seq.status, seq.finish_reason = SequenceStatus.FINISHED, reason
        return StepOutput(seq.request_id, token, index, reason is not None, reason, logprobs=logprobs)

    def _finish_reason(self, seq: Sequence, token: int) -> str | None:
        if len(seq.output_token_ids) < seq.sampling.min_tokens:
            return None  # neither EOS nor a stop string ends it yet (vLLM's min_tokens)
        if token in self._eos_ids and not seq.sampling.ignore_eos:
            return "stop"
        if seq.sampling.stop:
            text = self.loaded.tokenizer.decode(seq.output_token_ids, skip_special_tokens=True)
            if any(stop in text for stop in seq.sampling.stop):
                return "stop"
        if len(seq.output_token_ids) >= seq.sampling.max_tokens:
            return "length"
        return None

    # ----- helpers -----------------------------------------------------------------------

    def _new_sequence(self, request_id, prompt_token_ids, sampling, seed=None) -> Sequence:
        if request_id in self._sequences:
            raise InvalidRequestState(f"request {request_id!r} is already live")
        if not prompt_token_ids:
            raise ValueError("prompt must hold at least one token")
        sampling.validate()
        if len(prompt_token_ids) + sampling.max_tokens > self.max_context_len:
            raise ContextLengthExceeded(
                f"{len(prompt_token_ids)} prompt + {sampling.max_tokens} output tokens exceed "
                f"the context of {self.max_context_len}")
        if seed is None:
            seed = sampling.seed if sampling.seed is not None else secrets.randbits(63)
        return Sequence(request_id, list(prompt_token_ids), len(prompt_token_ids), sampling, seed)

    def _adopt_cached(self, seq: Sequence, hit: list[int], hashes: list[int]):
        seq.block_ids = list(hit)
        seq.block_hashes = hashes[:len(hit)]
        seq.num_kv_tokens = seq.num_cached_tokens = len(hit) * self.layout.block_size

    def _append_outputs(self, seq: Sequence, token_ids: list[int],
                        logprobs: list[TokenLogprobs | None] | tuple = ()):
        if len(seq.output_token_ids) + len(token_ids) > seq.sampling.max_tokens:
            raise InvalidRequestState(f"request {seq.request_id!r} would exceed max_tokens")
        seq.token_ids.extend(token_ids)
        seq.output_logprobs.extend(logprobs[i] if i < len(logprobs) else None for i in range(len(token_ids)))
        reason = self._finish_reason(seq, token_ids[-1]) if token_ids else None
        if reason:
            seq.status, seq.finish_reason = SequenceStatus.FINISHED, reason

    def _get(self, request_id: str, status: SequenceStatus) -> Sequence:
        seq = self.get(request_id)
        if seq.status is not status:
            raise InvalidRequestState(
                f"request {request_id!r} is {seq.status.value}, expected {status.value}")
        return seq

    def _ensure_blocks(self, seq: Sequence, num_tokens: int):
        missing = math.ceil(num_tokens / self.layout.block_size) - len(seq.block_ids)
        if missing > 0:
            seq.block_ids.extend(self.blocks.allocate(missing))

    def _slot(self, seq: Sequence, position: int) -> int:
        block_size = self.layout.block_size
        return seq.block_ids[position // block_size] * block_size + position % block_size

    def _lookup(self, hashes: list[int]) -> list[int]:
        """Cached block ids of the longest hit (none when the prefix cache is disabled)."""
        return self.prefix_cache.match(hashes) if self.enable_prefix_cache else []

    def _cache_full_blocks(self, seq: Sequence):
        """Publish every newly completed block of ``seq`` to the prefix cache."""
        block_size = self.layout.block_size
        for index in range(len(seq.block_hashes), seq.num_kv_tokens // block_size):
            parent = seq.block_hashes[-1] if seq.block_hashes else ROOT_PARENT_HASH
            block_hash = hash_block(parent, seq.token_ids[index * block_size:(index + 1) * block_size])
            if self.enable_prefix_cache:
                self.blocks.cache_block(parent, block_hash, seq.block_ids[index])
            seq.block_hashes.append(block_hash)
