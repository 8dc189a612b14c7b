"""What the router reports about a request: the ``pdd`` extension object of its response."""

from dataclasses import dataclass, field

from services.router.kv_landings import kv_after_prefill_ms
from services.router.placement import Placement


@dataclass(frozen=True)
class Recovery:
    """One resumption of a request after an instance failed it.

    Attributes:
        from_instance: The instance that failed (died, went silent, or reported a retryable error).
        to_instance: The instance that continues the token stream.
        reason: Stable cause (``instance_unresponsive``, ``timeout``, a service error code).
        at_token: Output tokens the client already had; the new attempt goes on from here.
    """

    from_instance: str
    to_instance: str
    reason: str
    at_token: int

    def as_pdd(self) -> dict:
        """The entry in ``pdd.recoveries``."""
        return {"from": self.from_instance, "to": self.to_instance, "reason": self.reason, "at_token": self.at_token}


@dataclass
class RequestOutcome:
    """What the ``pdd`` response object reports about a request.

    Attributes mirror the response fields; ``finish_reason`` is OpenAI's. Placement fields
    describe the attempt that finished the request.
    """

    pipeline: str
    prompt_tokens: int
    cached_blocks_md: int
    finished_on: str | None = None
    handoff_mode: str | None = None
    handoff_chunks: int = 0
    eager_tokens: int = 0
    wan_kv_bytes: int = 0
    odd_traffic: bool = False
    ttft_ms: float | None = None
    finish_reason: str | None = None
    output_tokens: int = 0
    instances: dict[str, str] = field(default_factory=dict)
    predicted_wan_ms: float = 0.0
    predicted_prefill_ms: float = 0.0
    kv_transfer_ms: float | None = None
    recoveries: list[Recovery] = field(default_factory=list)
    degraded_reason: str = ""
    queue_ms: float = 0.0
    prefill_cached_tokens: int = 0
    prefill_compute_ms: float | None = None
    prefill_computed_unix_s: float = 0.0
    kv_landed_unix_s: float = 0.0

    @property
    def kv_after_prefill_ms(self) -> float | None:
        """See ``kv_landings.kv_after_prefill_ms``: the same figure a late landing reports."""
        return kv_after_prefill_ms(self.prefill_computed_unix_s, self.kv_landed_unix_s)

    def place(self, placement: Placement):
        """Describe the attempt running on ``placement``."""
        self.pipeline = placement.pipeline
        self.cached_blocks_md = placement.md_cached_blocks
        self.predicted_wan_ms = placement.predicted_wan_s * 1000
        self.predicted_prefill_ms = placement.predicted_prefill_s * 1000
        self.odd_traffic = placement.odd_traffic
        self.degraded_reason = placement.degraded_reason
        self.instances = {
            role: ref.instance_id
            for role, ref in (
                ("prefill", placement.prefill),
                ("main_decode", placement.main_decode),
                ("relay_decode", placement.relay_decode),
            )
            if ref is not None
        }

    def as_pdd(self) -> dict:
        """The ``pdd`` extension object."""
        return {
            "pipeline": self.pipeline,
            "finished_on": self.finished_on,
            "handoff_mode": self.handoff_mode,
            "handoff_chunks": self.handoff_chunks,
            "eager_tokens": self.eager_tokens,
            "prompt_tokens": self.prompt_tokens,
            "cached_blocks_md": self.cached_blocks_md,
            "wan_kv_bytes": self.wan_kv_bytes,
            "odd_traffic": self.odd_traffic,
            "ttft_ms": self.ttft_ms,
            "predicted_wan_ms": round(self.predicted_wan_ms, 1),
            "predicted_prefill_ms": round(self.predicted_prefill_ms, 1),
            "kv_transfer_ms": self.kv_transfer_ms,
            "instances": self.instances,
            "recoveries": [r.as_pdd() for r in self.recoveries],
            "degraded": self.degraded_reason or None,
            "queue_ms": round(self.queue_ms, 1),
            "prefill_compute_ms": self.prefill_compute_ms,
            "kv_after_prefill_ms": self.kv_after_prefill_ms,
            "prefill_computed_unix_s": self.prefill_computed_unix_s or None,
        }
