"""The HF engine: the ``hf`` backend, continuous batching of a transformers model over a block
KV pool, with prefix reuse, KV import/export and token-ID extend.

In nano-vllm's shape: the ``Scheduler`` picks each step's work and owns the block tables,
the ``ModelRunner`` runs one packed forward pass, the ``Sampler`` draws tokens and the
``StopDetector`` ends sequences; ``BlockManager`` and ``PrefixCache`` own and reuse blocks,
``KvTransfer`` moves KV as wire frames. This class is the ``EngineBackend`` front over them.
"""

import secrets

from shared.block_hash import hash_blocks
from shared.engine.backend import (
    BackendOptions,
    EngineBackend,
    EngineLoad,
    KvEventListener,
    RequestStatus,
    RequestView,
    StepOutput,
    generate,
    register_backend,
)
from shared.engine.block_manager import BlockManager
from shared.engine.kv_pool import KvPool
from shared.engine.kv_transfer import KvTransfer
from shared.engine.logprobs import TokenLogprobs
from shared.engine.model_runner import ModelRunner
from shared.engine.prefix_cache import PrefixCache
from shared.engine.sampler import RowFacts, Sampler, row_facts
from shared.engine.sampling import SamplingParams
from shared.engine.scheduler import Scheduler
from shared.engine.sequence import Sequence
from shared.engine.stop_detector import StopDetector
from shared.errors import (
    ContextLengthExceeded,
    InvalidPrompt,
    InvalidRequestState,
    OutOfKvBlocks,
    PddError,
    SamplingFailed,
    StepFailed,
)
from shared.kv_layout import DEFAULT_BLOCK_SIZE, KvLayout
from shared.kv_wire import FrameExpectation, KvFrame
from shared.model_loader import LoadedModel, load_model

DEFAULT_KV_CACHE_BYTES = 1 << 30
DEFAULT_MAX_BATCH_TOKENS = 2048


class HfEngine(EngineBackend):
    """A transformers model instance with its own KV pool and prefix cache. Not thread-safe."""

    def __init__(
        self,
        loaded: LoadedModel,
        *,
        num_blocks: int | None = None,
        kv_cache_bytes: int = DEFAULT_KV_CACHE_BYTES,
        block_size: int = DEFAULT_BLOCK_SIZE,
        max_batch_tokens: int = DEFAULT_MAX_BATCH_TOKENS,
        first_chunk_tokens: int = 0,
        kv_listener: KvEventListener | None = None,
        enable_prefix_cache: bool = True,
    ):
        self.loaded = loaded
        self.layout = KvLayout.from_model(loaded.model, block_size)
        if num_blocks is None:
            num_blocks = max(1, kv_cache_bytes // self.layout.kv_bytes_per_block)
        self.pool = KvPool(self.layout, num_blocks, loaded.device)
        self.prefix_cache = PrefixCache(kv_listener)
        self.blocks = BlockManager(num_blocks, self.prefix_cache)
        self.scheduler = Scheduler(
            self.blocks, self.prefix_cache, block_size, max_batch_tokens, enable_prefix_cache, first_chunk_tokens
        )
        self.runner = ModelRunner(loaded, self.layout, self.pool)
        self.sampler = Sampler(loaded.eos_token_ids)
        self.stop_detector = StopDetector(loaded.tokenizer, loaded.eos_token_ids)
        self.kv_transfer = KvTransfer(self.scheduler, self.pool, loaded.fingerprint)
        self.block_size = block_size
        self.frame_expectation = FrameExpectation(loaded.fingerprint, self.layout)
        self.vocab_size = loaded.model.config.vocab_size
        self.max_context_len = loaded.model.config.max_position_embeddings
        self.last_batch: list[tuple[int, int]] = []
        """The latest step's ``(new_tokens, cached_tokens)`` per sequence (the call log's)."""

    # ----- requests ---------------------------------------------------------------------

    def add_request(
        self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams, seed: int | None = None
    ) -> RequestView:
        # The block holding the last prompt token is never taken from the cache: the model
        # must compute at least one token to produce the next-token logits.
        seq = self._new_sequence(request_id, prompt_token_ids, sampling, seed)
        self.scheduler.adopt_cached_prefix(seq, hash_blocks(prompt_token_ids[:-1], self.block_size))
        self.scheduler.sequences[request_id] = seq
        return seq.view()

    def extend(self, request_id: str, token_ids: list[int], sample: bool = True) -> RequestView:
        seq = self._get(request_id, RequestStatus.RUNNING)
        if seq.num_pending_tokens:
            raise InvalidRequestState(f"request {request_id!r} still has pending tokens")
        if not token_ids:
            raise ValueError("extend needs at least one token")
        self._append_outputs(seq, token_ids)
        seq.hold_after_compute = not sample
        return seq.view()

    def pause(self, request_id: str):
        self._get(request_id, RequestStatus.RUNNING).status = RequestStatus.PAUSED

    def resume(self, request_id: str):
        self._get(request_id, RequestStatus.PAUSED).status = RequestStatus.RUNNING

    def free(self, request_id: str) -> RequestView:
        return self.scheduler.remove(request_id).view()

    def abort(self, request_id: str) -> bool:
        if request_id not in self.scheduler.sequences:
            return False
        self.scheduler.remove(request_id)
        return True

    def request(self, request_id: str) -> RequestView | None:
        seq = self.scheduler.sequences.get(request_id)
        return seq.view() if seq is not None else None

    def request_ids(self) -> list[str]:
        return list(self.scheduler.sequences)

    # ----- stepping ---------------------------------------------------------------------

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def step(self) -> list[StepOutput]:
        """One scheduled step. A failure of one sequence (its sampling, its stop check) ends that
        sequence with ``finish_reason="error"``; a failed forward pass ends the step's sequences;
        neither raises, so the engine carries on with the rest."""
        self.last_batch = []
        batch, unfit = self.scheduler.schedule()
        if unfit is not None:
            return [
                self._fail(unfit, OutOfKvBlocks(f"out of KV blocks: {len(unfit.token_ids)} tokens do not fit the pool"))
            ]
        if not batch:
            return []
        self.last_batch = [(entry.num_tokens, entry.seq.num_kv_tokens) for entry in batch]
        try:
            logits = self.runner.run(batch)
        except Exception as exc:  # noqa: BLE001 - whatever broke, the batch ends, the engine lives
            return [self._fail(entry.seq, StepFailed(f"forward pass failed: {exc!r}")) for entry in batch]
        outputs = [
            StepOutput(seq.request_id, None, len(seq.output_token_ids), False, absorbed=True)
            for seq in self.scheduler.computed(batch)
        ]
        samplers = [entry.seq for entry in batch if entry.samples]
        facts = row_facts(logits) if samplers else []
        outputs.extend(self._sample(seq, logits[row], facts[row]) for row, seq in enumerate(samplers))
        return outputs

    def _sample(self, seq: Sequence, logits, facts: RowFacts) -> StepOutput:
        index = len(seq.output_token_ids)
        try:
            token, logprobs = self.sampler.sample(seq, logits, facts)
            seq.token_ids.append(token)
            seq.output_logprobs.append(logprobs)
            reason = self.stop_detector.finish_reason(seq)
        except PddError as exc:
            return self._fail(seq, exc)
        except Exception as exc:  # noqa: BLE001 - one sequence's failure must not end the engine
            return self._fail(seq, SamplingFailed(f"sampling failed: {exc!r}"))
        if reason:
            seq.status, seq.finish_reason = RequestStatus.FINISHED, reason
        return StepOutput(seq.request_id, token, index, reason is not None, reason, logprobs=logprobs)

    def _fail(self, seq: Sequence, error: PddError) -> StepOutput:
        seq.status, seq.finish_reason = RequestStatus.FINISHED, "error"
        return StepOutput(
            seq.request_id, None, len(seq.output_token_ids), True, "error", str(error), error_code=error.code
        )

    # ----- KV over the wire -------------------------------------------------------------

    def begin_import(
        self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams, seed: int | None = None
    ) -> int:
        seq = self._new_sequence(request_id, prompt_token_ids, sampling, seed)
        seq.status = RequestStatus.IMPORTING
        first = self.kv_transfer.reserve(seq)
        self.scheduler.sequences[request_id] = seq
        return first

    def import_frame(self, frame: KvFrame):
        self.kv_transfer.import_frame(frame)

    def finish_import(self, request_id: str, token_ids: list[int], logprobs: list | tuple = ()) -> RequestView:
        seq = self._get(request_id, RequestStatus.IMPORTING)
        seq.status = RequestStatus.RUNNING
        self._append_outputs(seq, token_ids, logprobs)
        return seq.view()

    def export_frames(
        self,
        request_id: str,
        first_token_index: int = 0,
        end_token_index: int | None = None,
        *,
        max_tokens_per_frame: int = 512,
        traceparent: str | None = None,
    ) -> list[list]:
        return self.kv_transfer.export_frames(
            self.get(request_id), first_token_index, end_token_index, max_tokens_per_frame, traceparent
        )

    # ----- cache and load ---------------------------------------------------------------

    def cached_prefix_blocks(self, block_hashes: list[int]) -> int:
        return self.prefix_cache.peek(block_hashes)

    def cached_block_hashes(self) -> list[int]:
        return self.prefix_cache.block_hashes()

    def load(self) -> EngineLoad:
        sequences = list(self.scheduler.sequences.values())  # one atomic copy of the table
        pending = sum(n for n in (seq.num_pending_tokens for seq in sequences) if n > 1)
        return EngineLoad(
            num_sequences=len(sequences),
            num_blocks=self.blocks.num_blocks,
            num_free_blocks=self.blocks.num_free_blocks,
            num_used_blocks=self.blocks.num_used_blocks,
            num_pending_tokens=pending,
        )

    def blocks_held_only_by(self, request_ids: set[str]) -> int:
        mine, others = set(), set()
        for rid, seq in list(self.scheduler.sequences.items()):  # one atomic copy of the table
            (mine if rid in request_ids else others).update(list(seq.block_ids))
        return len(mine - others)

    # ----- for the engine's own tests and benchmarks ------------------------------------

    def get(self, request_id: str) -> Sequence:
        """The live sequence ``request_id`` (engine-internal state)."""
        return self.scheduler.get(request_id)

    def holds(self, request_id: str) -> bool:
        """Whether ``request_id`` is live here."""
        return request_id in self.scheduler.sequences

    @property
    def num_sequences(self) -> int:
        """Live sequences, in any state."""
        return len(self.scheduler.sequences)

    @property
    def num_preemptions(self) -> int:
        """Sequences preempted so far (their KV recomputed)."""
        return self.scheduler.num_preemptions

    def generate(self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams) -> list[int]:
        """Prefill and decode one request to the end alone; free it; return its output tokens."""
        return generate(self, request_id, prompt_token_ids, sampling)

    # ----- helpers ----------------------------------------------------------------------

    def _new_sequence(self, request_id, prompt_token_ids, sampling, seed=None) -> Sequence:
        if request_id in self.scheduler.sequences:
            raise InvalidRequestState(f"request {request_id!r} is already live")
        if not prompt_token_ids:
            raise InvalidPrompt("prompt must hold at least one token")
        if not all(0 <= t < self.vocab_size for t in prompt_token_ids):
            raise InvalidPrompt(f"prompt token ids must lie in [0, {self.vocab_size})")
        sampling.validate()
        if len(prompt_token_ids) + sampling.max_tokens > self.max_context_len:
            raise ContextLengthExceeded(
                f"{len(prompt_token_ids)} prompt + {sampling.max_tokens} output tokens exceed "
                f"the context of {self.max_context_len}"
            )
        if seed is None:
            seed = sampling.seed if sampling.seed is not None else secrets.randbits(63)
        return Sequence(request_id, list(prompt_token_ids), len(prompt_token_ids), sampling, seed)

    def _append_outputs(self, seq: Sequence, token_ids: list[int], logprobs: list[TokenLogprobs | None] | tuple = ()):
        if len(seq.output_token_ids) + len(token_ids) > seq.sampling.max_tokens:
            raise InvalidRequestState(f"request {seq.request_id!r} would exceed max_tokens")
        seq.token_ids.extend(token_ids)
        seq.output_logprobs.extend(logprobs[i] if i < len(logprobs) else None for i in range(len(token_ids)))
        reason = self.stop_detector.finish_reason(seq) if token_ids else None
        if reason:
            seq.status, seq.finish_reason = RequestStatus.FINISHED, reason

    def _get(self, request_id: str, status: RequestStatus) -> Sequence:
        seq = self.get(request_id)
        if seq.status is not status:
            raise InvalidRequestState(f"request {request_id!r} is {seq.status.value}, expected {status.value}")
        return seq


@register_backend("hf")
def create_hf_engine(options: BackendOptions, loaded: LoadedModel | None = None) -> HfEngine:
    """The ``hf`` backend: loads the model unless one is given."""
    if loaded is None:
        loaded = load_model(options.model, device=options.device, dtype=options.dtype)
    return HfEngine(
        loaded,
        kv_cache_bytes=options.kv_cache_bytes,
        block_size=options.block_size,
        max_batch_tokens=options.max_batch_tokens,
        first_chunk_tokens=options.first_chunk_tokens,
        kv_listener=options.kv_listener,
        enable_prefix_cache=options.enable_prefix_cache,
    )
