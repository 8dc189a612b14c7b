"""The one contract PDD needs from an engine, and the registry that picks one by name.

Prefill, relay decode and main decode talk to their engine only through ``EngineBackend``:
add and abort requests, step, hand KV over as wire frames, extend over token IDs produced
elsewhere, pause and resume around a handoff, and report load and cached blocks. Anything
that honours it can serve a PDD role; ``--engine NAME`` chooses which (``hf`` by default).

Threading: a backend is not thread-safe. Services call every method on one engine thread
(``EngineWorker``), in the order they were issued; only ``load`` and
``blocks_held_only_by`` may also be called from other threads (they read counters and
snapshot tables). The values returned (``RequestView``, ``StepOutput``, ``EngineLoad``) are
immutable snapshots, safe to read anywhere.
"""

import abc
import enum
import importlib
from collections.abc import Callable
from dataclasses import dataclass

from shared.engine.logprobs import TokenLogprobs
from shared.engine.sampling import SamplingParams
from shared.errors import ConfigError
from shared.kv_wire import FrameExpectation, KvFrame

KvEventListener = Callable[[str, list[int]], None]
"""Called with ("stored" | "evicted", block hashes) whenever the cached set changes; on the
engine thread."""


class RequestStatus(enum.Enum):
    """Where a request is in its life on one instance."""

    IMPORTING = "importing"  # KV frames are landing; not schedulable yet
    RUNNING = "running"  # schedulable whenever it has tokens without KV
    PAUSED = "paused"  # holds its KV but is not scheduled (handoff in flight)
    FINISHED = "finished"  # stopped (EOS, length, stop string or error); blocks held until freed


@dataclass(frozen=True)
class RequestView:
    """A snapshot of one request on this instance.

    Attributes:
        request_id: The caller's id.
        status: Where the request is.
        num_prompt_tokens: Prompt length.
        num_cached_tokens: Prompt tokens whose KV came from the prefix cache.
        num_imported_tokens: Tokens whose KV came from wire frames.
        output_token_ids: Output tokens known here (sampled here or handed over).
        output_logprobs: Per output token its log-probabilities (None where unknown); None
            when the request did not ask for them.
        finish_reason: ``stop``, ``length`` or ``error`` once finished.
        max_tokens: The request's output budget.
        num_kv_tokens: Leading tokens whose KV exists here (cached, imported or computed):
            the complete blocks below it can be exported while the rest of a long prompt is
            still being computed. A backend that exports only finished prompts reports 0.
    """

    request_id: str
    status: RequestStatus
    num_prompt_tokens: int
    num_cached_tokens: int
    num_imported_tokens: int
    output_token_ids: tuple[int, ...]
    output_logprobs: tuple[TokenLogprobs | None, ...] | None
    finish_reason: str | None
    max_tokens: int
    num_kv_tokens: int = 0

    @property
    def finished(self) -> bool:
        """Whether the request stopped here."""
        return self.status is RequestStatus.FINISHED


@dataclass(frozen=True)
class StepOutput:
    """One sampled token, an absorbed handoff chunk, or a failure, of one request in one step.

    Attributes:
        request_id: The request it belongs to.
        token_id: The sampled token; None when the request failed or only absorbed tokens.
        token_index: Index of ``token_id`` among the request's output tokens (for an
            absorbed chunk: how many output tokens the request now holds KV for).
        finished: Whether the request stopped with this output.
        finish_reason: ``stop``, ``length`` or ``error`` when finished.
        error: What went wrong, when ``finish_reason`` is ``error``.
        error_code: Its stable code (``PddError.code``: ``out_of_kv_blocks``,
            ``sampling_failed``, ``step_failed``), when ``finish_reason`` is ``error``.
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
    error_code: str | None = None


@dataclass(frozen=True)
class EngineLoad:
    """What a load report and placement need to know about an instance's engine.

    Attributes:
        num_sequences: Live requests, in any state.
        num_blocks: KV blocks in the pool.
        num_free_blocks: Blocks neither in use nor cached.
        num_used_blocks: Blocks held by live requests.
        num_pending_tokens: Prompt and extend tokens admitted and not computed yet (the work
            queued on a prefill instance; a decoding sequence's one next token is not counted).
    """

    num_sequences: int
    num_blocks: int
    num_free_blocks: int
    num_used_blocks: int
    num_pending_tokens: int = 0


@dataclass(frozen=True)
class BackendOptions:
    """How to build a backend, read from the service's configuration.

    Attributes:
        model: ``smollm2``, ``tiny`` or a model folder.
        device: Torch device name.
        dtype: Weights and KV dtype.
        kv_cache_bytes: KV pool size.
        block_size: Tokens per KV block (the same on every instance).
        max_batch_tokens: Most tokens one step computes; a longer prompt is computed in
            chunks of at most this many tokens, over several steps.
        first_chunk_tokens: Most tokens a prompt's first computed chunk holds (0: no other
            bound than ``max_batch_tokens``).
        enable_prefix_cache: Reuse cached prefix blocks.
        kv_listener: Receives stored/evicted block events; None publishes nothing.
        standin_step_s: Wall time of one step of the stand-in engine (``standin``); other
            backends ignore it.
    """

    model: str = "smollm2"
    device: str = "cpu"
    dtype: str = "float32"
    kv_cache_bytes: int = 512 << 20
    block_size: int = 16
    max_batch_tokens: int = 2048
    first_chunk_tokens: int = 0
    enable_prefix_cache: bool = True
    kv_listener: KvEventListener | None = None
    standin_step_s: float = 0.0


class EngineBackend(abc.ABC):
    """An engine instance with its own KV pool and prefix cache.

    Errors: methods that name a request raise ``UnknownRequest`` for one that is not live
    and ``InvalidRequestState`` for one in the wrong state; ``OutOfKvBlocks`` means the pool
    has no room now. A failure inside a step is reported as an ``error`` output of the
    request it hit, never raised.
    """

    block_size: int
    """Tokens per KV block."""
    frame_expectation: FrameExpectation
    """What incoming KV frames must match (model fingerprint and KV layout)."""
    vocab_size: int
    """Token ids are ``0 <= id < vocab_size``."""
    max_context_len: int
    """Prompt plus output tokens a request may hold."""

    # ----- requests ---------------------------------------------------------------------

    @abc.abstractmethod
    def add_request(
        self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams, seed: int | None = None
    ) -> RequestView:
        """Queue a prompt for prefill, reusing the cached prefix blocks.

        Raises:
            ContextLengthExceeded: prompt plus ``max_tokens`` exceed the context.
            InvalidRequestState: ``request_id`` is already live.
        """

    @abc.abstractmethod
    def abort(self, request_id: str) -> bool:
        """Free ``request_id`` if it is live (a cancel may race its end); True if it was."""

    @abc.abstractmethod
    def free(self, request_id: str) -> RequestView:
        """Forget a request and release its blocks (complete blocks stay cached)."""

    @abc.abstractmethod
    def pause(self, request_id: str) -> None:
        """Stop scheduling a running request (a handoff is in flight)."""

    @abc.abstractmethod
    def resume(self, request_id: str) -> None:
        """Schedule a paused request again."""

    @abc.abstractmethod
    def extend(self, request_id: str, token_ids: list[int], sample: bool = True) -> RequestView:
        """Append tokens produced elsewhere to a running, idle request; the next step computes
        their KV in one pass and samples the token after them, or with ``sample=False`` only
        computes their KV and reports an ``absorbed`` output (catch-up). Tokens that end the
        request (EOS, stop string, ``max_tokens``) finish it at once."""

    @abc.abstractmethod
    def request(self, request_id: str) -> RequestView | None:
        """A snapshot of ``request_id``, or None when it is not live here."""

    @abc.abstractmethod
    def request_ids(self) -> list[str]:
        """Ids of the live requests."""

    # ----- stepping ---------------------------------------------------------------------

    @abc.abstractmethod
    def has_work(self) -> bool:
        """Whether a step would compute anything."""

    @abc.abstractmethod
    def step(self) -> list[StepOutput]:
        """One forward pass over every schedulable request; what they sampled or absorbed."""

    # ----- KV over the wire -------------------------------------------------------------

    @abc.abstractmethod
    def begin_import(
        self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams, seed: int | None = None
    ) -> int:
        """Reserve blocks for a prompt whose KV arrives as frames; reuse cached ones.

        Returns:
            The token index the sender starts from (the cached prefix length, a block start).

        Raises:
            OutOfKvBlocks: the pool has no room for the prompt now.
        """

    @abc.abstractmethod
    def import_frame(self, frame: KvFrame) -> None:
        """Write a validated frame into its request's reserved blocks, in order.

        Raises:
            FrameOwnershipError: no import of that request is under way, or the frame is not
                the next one, or its tokens are not the prompt's.
        """

    @abc.abstractmethod
    def finish_import(self, request_id: str, token_ids: list[int], logprobs: list | tuple = ()) -> RequestView:
        """End an import; the request runs on from ``token_ids`` (output produced elsewhere;
        empty parks it until ``extend``)."""

    @abc.abstractmethod
    def export_frames(
        self,
        request_id: str,
        first_token_index: int = 0,
        end_token_index: int | None = None,
        *,
        max_tokens_per_frame: int = 512,
        traceparent: str | None = None,
    ) -> list[list]:
        """The request's computed KV for tokens ``[first, end)`` as wire frames (lists of
        buffers for ``writelines``); ``first`` is a block start."""

    # ----- cache and load ---------------------------------------------------------------

    @abc.abstractmethod
    def cached_prefix_blocks(self, block_hashes: list[int]) -> int:
        """How many leading blocks of the hash chain are cached (touches nothing)."""

    @abc.abstractmethod
    def cached_block_hashes(self) -> list[int]:
        """Every cached block's hash, parents before children (a full dump)."""

    @abc.abstractmethod
    def load(self) -> EngineLoad:
        """Sequences and blocks now; callable from any thread."""

    @abc.abstractmethod
    def blocks_held_only_by(self, request_ids: set[str]) -> int:
        """Blocks that only these live requests hold; callable from any thread."""


def generate(
    backend: EngineBackend, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams
) -> list[int]:
    """Prefill and decode one request to the end alone; free it; return its output tokens."""
    backend.add_request(request_id, prompt_token_ids, sampling)
    try:
        while backend.request(request_id).status is RequestStatus.RUNNING:
            backend.step()
        return list(backend.request(request_id).output_token_ids)
    finally:
        backend.free(request_id)


BackendFactory = Callable[..., EngineBackend]
"""``factory(options: BackendOptions, loaded=None)``: ``loaded`` is a model already in memory."""

_FACTORIES: dict[str, BackendFactory] = {}
_BUILT_IN = {
    "hf": "shared.engine.hf_engine",
    "vllm": "shared.engine.vllm.backend",
    "standin": "shared.engine.standin",
}
"""Backends shipped here, imported on first use (their modules register themselves)."""


def register_backend(name: str):
    """Class or function decorator: make ``factory`` available as ``--engine name``."""

    def register(factory: BackendFactory) -> BackendFactory:
        _FACTORIES[name] = factory
        return factory

    return register


def backend_names() -> list[str]:
    """Every backend name ``--engine`` accepts."""
    return sorted(set(_FACTORIES) | set(_BUILT_IN))


def create_backend(name: str, options: BackendOptions, loaded=None) -> EngineBackend:
    """Build the backend registered as ``name``.

    Raises:
        ConfigError: no backend has that name.
    """
    if name not in _FACTORIES and name in _BUILT_IN:
        importlib.import_module(_BUILT_IN[name])
    factory = _FACTORIES.get(name)
    if factory is None:
        raise ConfigError(f"--engine {name!r}: no such engine backend (have: {', '.join(backend_names())})")
    return factory(options, loaded)
