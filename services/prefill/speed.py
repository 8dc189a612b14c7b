"""How fast this prefill computes prompt tokens, as its heartbeat reports it to the routers
(which predict when a prompt's KV lands at main decode from it)."""

MIN_SAMPLE_TOKENS = 32
"""Prompts computing fewer tokens say more about a step's fixed cost than about the rate."""


class PrefillSpeed:
    """An exponentially weighted moving average of prompt tokens per second of compute."""

    def __init__(self, alpha: float = 0.3):
        self.alpha = alpha
        self.tokens_per_s = 0.0
        """0 until the first sample."""

    def add(self, num_computed_tokens: int, compute_s: float):
        """One prompt: ``num_computed_tokens`` (not found in the prefix cache) in ``compute_s``."""
        if num_computed_tokens < MIN_SAMPLE_TOKENS or compute_s <= 0:
            return
        rate = num_computed_tokens / compute_s
        weight = self.alpha if self.tokens_per_s else 1.0
        self.tokens_per_s += weight * (rate - self.tokens_per_s)
