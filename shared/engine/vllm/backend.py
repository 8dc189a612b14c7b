"""``VllmBackend``: vLLM's engine behind ``EngineBackend`` (``--engine vllm``).

vLLM runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), stepped by the service's
engine thread like any backend. What PDD needs and vLLM has no call for is built on its
prefix cache:

- KV that arrives as frames is staged and written into the request's blocks by
  ``PddConnector`` when vLLM schedules it; vLLM computes only what no block holds.
- Tokens produced elsewhere (``finish_import``, ``extend``, ``resume``) start a new vLLM
  request whose prompt is the prompt plus every output token so far: the prefix cache covers
  what this instance holds, and only the rest is computed (a handoff's extend). An extend
  that does not sample (catch-up) runs that request for one step and drops its token.
- A prompt computes in chunks of ``max_batch_tokens`` (its first one ``first_chunk_tokens``);
  between steps the blocks computed so far can be exported while the rest computes, and a
  finished request keeps its blocks (the connector tells vLLM so) until ``free`` (``chunks.py``).
- vLLM's block events become PDD's stored/evicted hashes (``BlockMirror``).

Greedy output matches the HF engine's and transformers' token for token. Seeded sampling is
reproducible on one engine but draws differently from the HF engine's ``(seed, index)``
streams, and frequency/presence penalties restart their counts when a new vLLM request
continues one (its earlier output becomes prompt); docs/engine.md lists the differences.
"""

import logging
import os
import secrets
from dataclasses import dataclass, field
from pathlib import Path

import structlog
import torch

from shared.block_hash import hash_blocks
from shared.engine.backend import (
    BackendOptions,
    EngineBackend,
    EngineLoad,
    RequestStatus,
    RequestView,
    StepOutput,
    register_backend,
)
from shared.engine.logprobs import TokenLogprobs
from shared.engine.sampling import SamplingParams
from shared.engine.vllm import bridge as bridges
from shared.engine.vllm.block_events import BlockMirror
from shared.engine.vllm.chunks import FirstChunkBound, chunking_args, kv_so_far, kv_tokens
from shared.engine.vllm.kv_blocks import VllmKvBlocks, check_layout
from shared.errors import (
    ConfigError,
    ContextLengthExceeded,
    InvalidPrompt,
    InvalidRequestState,
    UnknownRequest,
)
from shared.kv_layout import KvLayout
from shared.kv_wire import FrameExpectation, KvFrame, check_next_frame, encode_frames
from shared.model_loader import SMOLLM2, TINY, LoadedModel, ensure_smollm2_converted, load_model

log = structlog.get_logger(__name__)

_engines_in_process = 0
CONNECTOR = "PddConnector"
CONNECTOR_MODULE = "shared.engine.vllm.connector"


@dataclass
class _Request:
    """One request on this instance (vLLM may have run it as several of its own)."""

    request_id: str
    prompt: list[int]
    sampling: SamplingParams
    seed: int
    status: RequestStatus = RequestStatus.RUNNING
    outputs: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    finish_reason: str | None = None
    num_cached_tokens: int = 0
    num_imported_tokens: int = 0
    engine_id: str | None = None
    """vLLM's current request for it (None: not in vLLM now)."""
    vllm_id: str | None = None
    """vLLM's own id of that request (its scheduler's key)."""
    emitted: int = 0
    """Output tokens that vLLM request has produced so far."""
    absorbing: bool = False
    """The vLLM request only computes KV (a catch-up extend); its token is dropped."""
    attempt: int = 0
    import_next: int = 0
    staged: list[torch.Tensor] = field(default_factory=list)
    staged_first: int = 0

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.outputs

    def view(self, num_kv_tokens: int = 0) -> RequestView:
        return RequestView(
            self.request_id,
            self.status,
            len(self.prompt),
            self.num_cached_tokens,
            self.num_imported_tokens,
            tuple(self.outputs),
            tuple(self.logprobs) if self.sampling.logprobs is not None else None,
            self.finish_reason,
            self.sampling.max_tokens,
            num_kv_tokens,
        )


def _claim_the_process():
    """vLLM in this process, in-process engine core (the connector must share our memory); one
    engine per process (vLLM keeps its KV connector process-wide)."""
    global _engines_in_process
    if _engines_in_process:
        raise ConfigError(
            "--engine vllm: one vLLM engine per process (vLLM keeps its KV connector "
            "process-wide); run each vLLM instance as its own service process"
        )
    _engines_in_process += 1
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{(os.cpu_count() or 1) - 1}")


class VllmBackend(EngineBackend):
    """A vLLM engine instance in this process. Not thread-safe (as every backend)."""

    def __init__(
        self,
        loaded: LoadedModel,
        folder: Path,
        *,
        block_size: int,
        kv_cache_bytes: int,
        enable_prefix_cache: bool = True,
        kv_listener=None,
        max_batch_tokens: int = 2048,
        first_chunk_tokens: int = 0,
    ):
        _claim_the_process()
        self.loaded = loaded
        self.layout = KvLayout.from_model(loaded.model, block_size)
        self.block_size = block_size
        self.frame_expectation = FrameExpectation(loaded.fingerprint, self.layout)
        self.vocab_size = loaded.model.config.vocab_size
        # vLLM refuses a context its cache could not hold whole (and keeps a null block).
        cache_tokens = (kv_cache_bytes // self.layout.kv_bytes_per_token // block_size - 2) * block_size
        self.max_context_len = min(loaded.model.config.max_position_embeddings, cache_tokens)
        self._eos = loaded.eos_token_ids
        self._dtype = str(loaded.dtype).removeprefix("torch.")
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        isa = _get_attn_isa(loaded.dtype, block_size, self.layout.head_dim)
        self._bridge_key, self.bridge = bridges.new_bridge()
        self.mirror = BlockMirror(block_size, kv_listener)
        self.first_chunk = FirstChunkBound(first_chunk_tokens, max_batch_tokens)
        self.engine = self._new_engine(folder, kv_cache_bytes, enable_prefix_cache, isa)
        # vLLM publishes block events to a ZMQ socket or nowhere; in-process, to the mirror.
        self._scheduler.kv_event_publisher = self.mirror
        check_layout(self.bridge.kv_caches[0], isa)
        self.kv = VllmKvBlocks(self.bridge.kv_caches, block_size, isa)
        self._requests: dict[str, _Request] = {}
        self._by_engine_id: dict[str, _Request] = {}
        log.info(
            "vllm_engine_ready",
            folder=str(folder),
            block_size=block_size,
            isa=isa,
            kv_blocks=self.kv.caches[0].shape[0],
        )

    def _new_engine(self, folder: Path, kv_cache_bytes: int, enable_prefix_cache: bool, isa: str):
        from vllm import EngineArgs
        from vllm.config import KVEventsConfig, KVTransferConfig
        from vllm.v1.engine.llm_engine import LLMEngine

        transfer = KVTransferConfig(
            kv_connector=CONNECTOR,
            kv_connector_module_path=CONNECTOR_MODULE,
            kv_role="kv_both",
            kv_connector_extra_config={bridges.BRIDGE_KEY: self._bridge_key, "isa": isa},
        )
        args = EngineArgs(
            model=str(folder),
            tokenizer=str(folder),
            dtype=self._dtype,
            block_size=self.block_size,
            enable_prefix_caching=enable_prefix_cache,
            max_model_len=self.max_context_len,
            seed=0,
            enforce_eager=True,
            kv_cache_memory_bytes=kv_cache_bytes,
            kv_transfer_config=transfer,
            kv_events_config=KVEventsConfig(enable_kv_cache_events=True, publisher="null"),
            **chunking_args(self.first_chunk.max_batch_tokens),
        )
        return LLMEngine.from_engine_args(args)

    @property
    def _scheduler(self):
        return self.engine.engine_core.engine_core.scheduler

    # ----- requests ---------------------------------------------------------------------

    def add_request(
        self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams, seed: int | None = None
    ) -> RequestView:
        record = self._new(request_id, prompt_token_ids, sampling, seed)
        self._submit(record)
        return record.view()

    def abort(self, request_id: str) -> bool:
        if request_id not in self._requests:
            return False
        self.free(request_id)
        return True

    def free(self, request_id: str) -> RequestView:
        record = self._get(request_id)
        self._leave_engine(record)
        del self._requests[request_id]
        return record.view()

    def pause(self, request_id: str):
        record = self._get(request_id, RequestStatus.RUNNING)
        self._leave_engine(record)
        record.status = RequestStatus.PAUSED

    def resume(self, request_id: str):
        record = self._get(request_id, RequestStatus.PAUSED)
        record.status = RequestStatus.RUNNING
        self._submit(record)

    def extend(self, request_id: str, token_ids: list[int], sample: bool = True) -> RequestView:
        record = self._get(request_id, RequestStatus.RUNNING)
        if record.engine_id is not None:
            raise InvalidRequestState(f"request {request_id!r} still has pending tokens")
        if not token_ids:
            raise ValueError("extend needs at least one token")
        self._append_outputs(record, token_ids)
        if record.status is RequestStatus.RUNNING:
            self._submit(record, absorb=not sample)
        return record.view()

    def request(self, request_id: str) -> RequestView | None:
        record = self._requests.get(request_id)
        if record is None:
            return None
        return record.view(
            kv_tokens(self._scheduler, self.bridge, record.engine_id, record.vllm_id, len(record.tokens))
        )

    def request_ids(self) -> list[str]:
        return list(self._requests)

    # ----- stepping ---------------------------------------------------------------------

    def has_work(self) -> bool:
        # A released export frees its blocks only in vLLM's next step.
        return bool(self._by_engine_id) or any(i in self.bridge.held_blocks for i in self.bridge.released)

    def step(self) -> list[StepOutput]:
        outputs = []
        self.first_chunk.before_step(self._scheduler)
        for result in self.engine.step():
            record = self._by_engine_id.get(result.request_id)
            if record is None:
                continue  # a request we already left (its last output, or an abort's)
            outputs.extend(self._outputs(record, result))
        return outputs

    def _outputs(self, record: _Request, result) -> list[StepOutput]:
        completion = result.outputs[0]
        new = list(completion.token_ids[record.emitted :])
        if result.num_cached_tokens is not None and record.emitted == 0 and not record.outputs:
            record.num_cached_tokens = result.num_cached_tokens
        if record.absorbing:  # only the KV was wanted; the token it sampled is dropped
            if not new and not result.finished:
                return []
            self._leave_engine(record)
            return [StepOutput(record.request_id, None, len(record.outputs), False, absorbed=True)]
        outputs = []
        for offset, token in enumerate(new):
            logprobs = _logprobs(completion.logprobs, record.emitted + offset, token, record.sampling)
            record.outputs.append(token)
            record.logprobs.append(logprobs)
            outputs.append(StepOutput(record.request_id, token, len(record.outputs) - 1, False, logprobs=logprobs))
        record.emitted += len(new)
        if result.finished and record.status is RequestStatus.RUNNING:
            record.status = RequestStatus.FINISHED
            record.finish_reason = "length" if completion.finish_reason == "length" else "stop"
            self._by_engine_id.pop(record.engine_id, None)  # its blocks stay held until free
            if outputs:
                last = outputs[-1]
                outputs[-1] = StepOutput(
                    last.request_id, last.token_id, last.token_index, True, record.finish_reason, logprobs=last.logprobs
                )
        return outputs

    # ----- KV over the wire -------------------------------------------------------------

    def begin_import(
        self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams, seed: int | None = None
    ) -> int:
        record = self._new(request_id, prompt_token_ids, sampling, seed)
        record.status = RequestStatus.IMPORTING
        hit = self.mirror.cached_prefix_blocks(hash_blocks(prompt_token_ids, self.block_size))
        record.import_next = record.staged_first = min(
            hit * self.block_size, (len(prompt_token_ids) - 1) // self.block_size * self.block_size
        )
        return record.import_next

    def import_frame(self, frame: KvFrame):
        header = frame.header
        record = self._requests.get(header.request_id)
        importing = record is not None and record.status is RequestStatus.IMPORTING
        check_next_frame(header, importing, record.import_next if importing else 0, record.prompt if importing else [])
        end = header.first_token_index + header.num_tokens
        record.staged.append(frame.kv.to(self.loaded.dtype, copy=True))  # the frame is a view of a receive buffer
        record.import_next = end
        record.num_imported_tokens += header.num_tokens

    def finish_import(self, request_id: str, token_ids: list[int], logprobs: list | tuple = ()) -> RequestView:
        record = self._get(request_id, RequestStatus.IMPORTING)
        record.status = RequestStatus.RUNNING
        self._append_outputs(record, token_ids, logprobs)
        if record.status is RequestStatus.RUNNING and token_ids:
            self._submit(record)
        return record.view()

    def export_frames(
        self,
        request_id: str,
        first_token_index: int = 0,
        end_token_index: int | None = None,
        *,
        max_tokens_per_frame: int = 512,
        traceparent: str | None = None,
    ) -> list[list]:
        record = self._get(request_id)
        computed, block_ids = kv_so_far(
            self._scheduler, self.bridge, record.engine_id, record.vllm_id, len(record.tokens)
        )
        stop = computed if end_token_index is None else end_token_index
        bs = self.block_size
        if first_token_index % bs or not 0 <= first_token_index < stop <= computed:
            raise ValueError(
                f"cannot export tokens [{first_token_index}, {stop}): need a block "
                f"start below the end, within {computed} computed tokens"
            )
        return encode_frames(
            lambda start, end: self.kv.read(block_ids, start, end),
            record.tokens,
            first_token_index,
            stop,
            block_size=bs,
            model_fingerprint=self.loaded.fingerprint,
            request_id=request_id,
            max_tokens_per_frame=max_tokens_per_frame,
            traceparent=traceparent,
        )

    # ----- cache and load ---------------------------------------------------------------

    def cached_prefix_blocks(self, block_hashes: list[int]) -> int:
        return self.mirror.cached_prefix_blocks(block_hashes)

    def cached_block_hashes(self) -> list[int]:
        return self.mirror.cached_hashes()

    def load(self) -> EngineLoad:
        records = list(self._requests.values())  # one atomic copy of the table
        total = self.kv.caches[0].shape[0]
        used = sum(-(-len(r.prompt + r.outputs) // self.block_size) for r in records)
        pending = sum(
            len(r.prompt) - r.num_cached_tokens
            for r in records
            if r.status is RequestStatus.RUNNING and r.emitted == 0 and not r.outputs
        )
        return EngineLoad(
            num_sequences=len(records),
            num_blocks=total,
            num_free_blocks=max(0, total - used),
            num_used_blocks=min(total, used),
            num_pending_tokens=pending,
        )

    def blocks_held_only_by(self, request_ids: set[str]) -> int:
        records = [r for rid, r in list(self._requests.items()) if rid in request_ids]
        return sum(-(-len(r.prompt + r.outputs) // self.block_size) for r in records)

    def shutdown(self):
        """Stop vLLM's engine and forget the bridge."""
        bridges.drop_bridge(self._bridge_key)
        self.engine.engine_core.shutdown()

    # ----- helpers ----------------------------------------------------------------------

    def _new(self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams, seed) -> _Request:
        if request_id in self._requests:
            raise InvalidRequestState(f"request {request_id!r} is already live")
        if not prompt_token_ids:
            raise InvalidPrompt("prompt must hold at least one token")
        sampling.validate()
        if len(prompt_token_ids) + sampling.max_tokens > self.max_context_len:
            raise ContextLengthExceeded(
                f"{len(prompt_token_ids)} prompt + {sampling.max_tokens} output "
                f"tokens exceed the context of {self.max_context_len}"
            )
        if seed is None:
            seed = sampling.seed if sampling.seed is not None else secrets.randbits(63)
        record = _Request(request_id, list(prompt_token_ids), sampling, seed)
        self._requests[request_id] = record
        return record

    def _submit(self, record: _Request, absorb: bool = False):
        """Run the request in vLLM from everything it holds (prompt and outputs)."""
        record.attempt += 1
        engine_id = f"{record.request_id}#{record.attempt}"
        if record.staged:
            kv = torch.cat(record.staged, dim=2)
            self.bridge.staged[engine_id] = bridges.StagedKv(record.staged_first, kv)
            record.staged = []
        self.bridge.export.add(engine_id)
        record.vllm_id = self.engine.add_request(
            engine_id, {"prompt_token_ids": record.tokens}, _vllm_sampling(record, 1 if absorb else None)
        )
        record.engine_id, record.emitted, record.absorbing = engine_id, 0, absorb
        self._by_engine_id[engine_id] = record

    def _leave_engine(self, record: _Request):
        """Take the request out of vLLM and let vLLM free its blocks (they stay cached)."""
        engine_id, record.engine_id = record.engine_id, None
        if engine_id is None:
            return
        if self._by_engine_id.pop(engine_id, None) is not None:
            self.engine.abort_request([engine_id])
        self.bridge.staged.pop(engine_id, None)
        self.bridge.export.discard(engine_id)
        self.bridge.released.add(engine_id)

    def _append_outputs(self, record: _Request, token_ids: list[int], logprobs: list | tuple = ()):
        if len(record.outputs) + len(token_ids) > record.sampling.max_tokens:
            raise InvalidRequestState(f"request {record.request_id!r} would exceed max_tokens")
        for index, token in enumerate(token_ids):
            record.outputs.append(token)
            record.logprobs.append(logprobs[index] if index < len(logprobs) else None)
        reason = self._finish_reason(record) if token_ids else None
        if reason:
            record.status, record.finish_reason = RequestStatus.FINISHED, reason

    def _finish_reason(self, record: _Request) -> str | None:
        """Whether tokens produced elsewhere end the request here (EOS, stop string, length)."""
        sampling, outputs = record.sampling, record.outputs
        if len(outputs) >= sampling.min_tokens:
            if not sampling.ignore_eos and outputs[-1] in self._eos:
                return "stop"
            if sampling.stop:
                text = self.loaded.tokenizer.decode(outputs[-64:])
                if any(stop in text for stop in sampling.stop):
                    return "stop"
        return "length" if len(outputs) >= sampling.max_tokens else None

    def _get(self, request_id: str, status: RequestStatus | None = None) -> _Request:
        record = self._requests.get(request_id)
        if record is None:
            raise UnknownRequest(f"request {request_id!r} is not live here")
        if status is not None and record.status is not status:
            raise InvalidRequestState(f"request {request_id!r} is {record.status.value}, expected {status.value}")
        return record


def _vllm_sampling(record: _Request, max_tokens: int | None):
    """vLLM's parameters for the rest of ``record``'s output."""
    from vllm import SamplingParams as VllmSamplingParams

    ours, done = record.sampling, len(record.outputs)
    return VllmSamplingParams(
        max_tokens=max_tokens or ours.max_tokens - done,
        min_tokens=max(0, ours.min_tokens - done),
        temperature=ours.temperature,
        top_p=ours.top_p,
        top_k=ours.top_k,
        seed=record.seed,
        stop=list(ours.stop) or None,
        ignore_eos=ours.ignore_eos,
        repetition_penalty=ours.repetition_penalty,
        frequency_penalty=ours.frequency_penalty,
        presence_penalty=ours.presence_penalty,
        logprobs=ours.logprobs,
        detokenize=bool(ours.stop),
        skip_special_tokens=False,
    )


def _logprobs(per_token, index: int, token: int, sampling: SamplingParams) -> TokenLogprobs | None:
    """vLLM's logprobs of one output token as PDD's: the chosen token's, and the ``logprobs``
    most likely (vLLM's entry holds those, by rank, and the chosen one)."""
    if sampling.logprobs is None or not per_token or index >= len(per_token):
        return None
    entry = per_token[index]
    top = sorted((item for item in entry.items() if item[1].rank <= sampling.logprobs), key=lambda item: item[1].rank)
    return TokenLogprobs(entry[token].logprob, tuple(t for t, _ in top), tuple(lp.logprob for _, lp in top))


def model_folder(source: str) -> Path:
    """The HF folder vLLM loads for a model source."""
    if source == TINY:
        raise ConfigError(
            "--engine vllm: the tiny test model has 16-wide heads, which vLLM's CPU attention "
            "does not run; use smollm2 or a model folder"
        )
    if source == SMOLLM2:
        return ensure_smollm2_converted()
    return Path(source).expanduser()


@register_backend("vllm")
def create_vllm_backend(options: BackendOptions, loaded: LoadedModel | None = None) -> VllmBackend:
    """The ``vllm`` backend (vLLM must be installed: ``make setup-vllm``)."""
    # vLLM's records go through our logging (JSON on stderr, like every library's), at
    # warning and above: its own handler would print plain text on stdout.
    os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")
    logging.getLogger("vllm").setLevel(max(logging.WARNING, logging.getLogger().getEffectiveLevel()))
    try:
        import vllm  # noqa: F401
    except ImportError as exc:
        raise ConfigError(
            f"--engine vllm: vLLM is not installed in this environment ({exc}); "
            "run `make setup-vllm` and use .venv-vllm"
        ) from None
    folder = model_folder(options.model)
    if loaded is None:
        loaded = load_model(options.model, device=options.device, dtype=options.dtype)
    return VllmBackend(
        loaded,
        folder,
        block_size=options.block_size,
        kv_cache_bytes=options.kv_cache_bytes,
        enable_prefix_cache=options.enable_prefix_cache,
        kv_listener=options.kv_listener,
        max_batch_tokens=options.max_batch_tokens,
        first_chunk_tokens=options.first_chunk_tokens,
    )
