"""A prompt computed chunk by chunk in vLLM, and its KV read while the rest still computes.

- **Chunk sizes.** vLLM's V1 scheduler computes a prompt in chunks of at most
  ``max_num_batched_tokens`` per step (``max_batch_tokens``). It has no bound on a prompt's
  first chunk alone: ``FirstChunkBound`` sets one before each step in which a prompt waits
  to start (``first_chunk_tokens``).
- **KV so far.** The backend steps vLLM's engine core in its own thread and synchronously
  (in-process; no batch queue on CPU, where vLLM turns async scheduling off). Between two
  ``LLMEngine.step`` calls no forward pass is in flight, so a running request's
  ``num_computed_tokens`` (its prefix-cache hit, the connector's loads and every chunk
  computed so far) counts leading tokens whose KV is written, in the blocks vLLM's KV cache
  manager lists for it. A running request's blocks keep their ids as it grows; preemption
  frees them and sets its count back to 0.
"""

from dataclasses import dataclass

from shared.engine.vllm.bridge import Bridge


def chunking_args(max_batch_tokens: int) -> dict:
    """vLLM's engine arguments for chunks of at most ``max_batch_tokens`` tokens per step."""
    from vllm.config import SchedulerConfig

    return {
        "enable_chunked_prefill": True,
        "max_num_batched_tokens": max_batch_tokens,
        # vLLM refuses a step budget below its running-request limit.
        "max_num_seqs": min(SchedulerConfig.DEFAULT_MAX_NUM_SEQS, max_batch_tokens),
    }


def kv_tokens(scheduler, bridge: Bridge, engine_id: str | None, vllm_id: str | None, num_tokens: int) -> int:
    """How many leading tokens of a request have KV in vLLM's cache, between two steps: a
    finished exported request (blocks held by the connector) all ``num_tokens`` but the last;
    a running one what vLLM has computed; one vLLM does not run now (waiting, preempted,
    left) none."""
    if (engine_id or "") in bridge.held_blocks:
        return num_tokens - 1
    request = _running(scheduler, vllm_id)
    return request.num_computed_tokens if request is not None else 0


def kv_so_far(scheduler, bridge: Bridge, engine_id: str | None, vllm_id: str | None, num_tokens: int):
    """``(tokens, block_ids)``: ``kv_tokens`` and the request's blocks from its first
    (``(0, [])`` for a request vLLM does not run now)."""
    held = bridge.held_blocks.get(engine_id or "")
    if held is not None:
        return num_tokens - 1, held[1]
    request = _running(scheduler, vllm_id)
    if request is None:
        return 0, []
    return request.num_computed_tokens, list(scheduler.kv_cache_manager.get_block_ids(vllm_id)[0])


def _running(scheduler, vllm_id: str | None):
    """vLLM's request ``vllm_id`` if it is running now, else None."""
    from vllm.v1.request import RequestStatus

    request = scheduler.requests.get(vllm_id or "")
    return request if request is not None and request.status == RequestStatus.RUNNING else None


@dataclass
class FirstChunkBound:
    """Bounds a prompt's first computed chunk at ``first_chunk_tokens`` (0: no bound).

    Before a step in which some prompt waits with nothing computed, it caps the step:
    alone, that prompt gets a step budget of ``first_chunk_tokens``; beside other requests,
    every prompt chunk of the step is capped there (vLLM's ``long_prefill_token_threshold``,
    which vLLM applies only when more than one request is eligible); decodes are unaffected.
    Other steps run at ``max_batch_tokens`` with no cap.
    """

    first_chunk_tokens: int
    max_batch_tokens: int

    def before_step(self, scheduler):
        """Set the coming step's budget and chunk cap (on the engine thread)."""
        if not self.first_chunk_tokens or self.first_chunk_tokens >= self.max_batch_tokens:
            return
        starting = any(request.num_computed_tokens == 0 for request in scheduler.waiting)
        num_running, num_waiting = scheduler.get_request_counts()
        alone = starting and num_running + num_waiting == 1
        scheduler.max_num_scheduled_tokens = self.first_chunk_tokens if alone else self.max_batch_tokens
        cap = self.first_chunk_tokens if starting and not alone else 0
        scheduler.scheduler_config.long_prefill_token_threshold = cap
