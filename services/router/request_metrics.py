"""The router's per-request metrics: latency histograms, token counters and request gauges."""

import time

from services.router.outcome import RequestOutcome
from shared.metrics import (
    E2E_SECONDS,
    GENERATION_TOKENS,
    ITL_SECONDS,
    PROMPT_TOKENS,
    REQUESTS,
    TTFT_SECONDS,
)


class RequestMetrics:
    """Records one request as it streams; ``finish`` once it ended (answered or failed)."""

    def __init__(self, model_name: str, started_s: float):
        self.model_name, self.started_s = model_name, started_s
        self._last_delivery_s: float | None = None
        self._finished = False
        self._itl, self._itl_pipeline = None, None

    def delivered(self, pipeline: str):
        """A batch of tokens went to the client now."""
        now = time.perf_counter()
        if self._last_delivery_s is not None:
            if self._itl_pipeline != pipeline:  # a labelled child costs a lookup: once per pipeline
                self._itl, self._itl_pipeline = ITL_SECONDS.labels(self.model_name, pipeline), pipeline
            self._itl.observe(now - self._last_delivery_s)
        self._last_delivery_s = now

    def finish(self, outcome: RequestOutcome, result: str):
        """Count the request (``result``: ok or error) and its tokens; only the first call counts."""
        if self._finished:
            return
        self._finished = True
        name, pipeline = self.model_name, outcome.pipeline
        REQUESTS.labels(name, pipeline, outcome.finished_on or "none", outcome.finish_reason or "none", result).inc()
        PROMPT_TOKENS.labels(name).inc(outcome.prompt_tokens)
        GENERATION_TOKENS.labels(name, "RLD").inc(outcome.eager_tokens)
        GENERATION_TOKENS.labels(name, "MD").inc(max(0, outcome.output_tokens - outcome.eager_tokens))
        if outcome.ttft_ms is not None:
            TTFT_SECONDS.labels(name, pipeline).observe(outcome.ttft_ms / 1000)
        if result == "ok":
            E2E_SECONDS.labels(name, pipeline).observe(time.perf_counter() - self.started_s)
