"""Per-request state inside one engine instance."""

from dataclasses import dataclass, field

from shared.engine.backend import RequestStatus, RequestView
from shared.engine.logprobs import TokenLogprobs
from shared.engine.sampling import SamplingParams


@dataclass(eq=False)
class Sequence:
    """One request's tokens, KV blocks and progress on this instance.

    Attributes:
        request_id: Caller's id, unique among live sequences of the engine.
        token_ids: Prompt followed by every output token known here (sampled here or
            handed over by another instance).
        num_prompt_tokens: Length of the prompt prefix of ``token_ids``.
        sampling: Sampling and stopping parameters.
        seed: Effective sampling seed (the request's, or one the engine drew).
        block_ids: Block table: block ``i`` holds tokens ``[i*B, (i+1)*B)``.
        num_kv_tokens: Leading tokens whose KV is in the pool; the rest are pending.
        num_cached_tokens: Tokens whose KV came from the prefix cache.
        num_imported_tokens: Tokens whose KV came from wire frames.
        num_computed_tokens: Tokens whose KV this instance computed in forward passes.
        block_hashes: Chained hashes of the leading full blocks that have KV.
        finish_reason: ``stop``, ``length`` or ``error`` once finished.
        hold_after_compute: Compute the pending tokens' KV but sample nothing (catch-up chunk).
        output_logprobs: Per output token, its log-probabilities when the request asked for
            them and they are known here (None for a token handed over without them).
        num_stop_checked_tokens: Output tokens already known to end no stop string.
    """

    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    sampling: SamplingParams
    seed: int
    status: RequestStatus = RequestStatus.RUNNING
    block_ids: list[int] = field(default_factory=list)
    num_kv_tokens: int = 0
    num_cached_tokens: int = 0
    num_imported_tokens: int = 0
    num_computed_tokens: int = 0
    block_hashes: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    hold_after_compute: bool = False
    output_logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    num_stop_checked_tokens: int = 0

    @property
    def output_token_ids(self) -> list[int]:
        """Tokens after the prompt."""
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_pending_tokens(self) -> int:
        """Known tokens whose KV is not computed yet."""
        return len(self.token_ids) - self.num_kv_tokens

    @property
    def schedulable(self) -> bool:
        """Whether the next step should compute something for this sequence."""
        return self.status is RequestStatus.RUNNING and self.num_pending_tokens > 0

    def view(self) -> RequestView:
        """An immutable snapshot for callers outside the engine."""
        return RequestView(
            request_id=self.request_id,
            status=self.status,
            num_prompt_tokens=self.num_prompt_tokens,
            num_cached_tokens=self.num_cached_tokens,
            num_imported_tokens=self.num_imported_tokens,
            output_token_ids=tuple(self.token_ids[self.num_prompt_tokens :]),
            output_logprobs=tuple(self.output_logprobs) if self.sampling.logprobs is not None else None,
            finish_reason=self.finish_reason,
            max_tokens=self.sampling.max_tokens,
            num_kv_tokens=self.num_kv_tokens,
        )
