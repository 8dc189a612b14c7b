"""How fast this prefill computes prompt tokens, as its heartbeat reports it to the routers
(which predict when a prompt's KV lands at main decode from it).

Prompts computing at once share the engine (its steps pack chunks of each), so a prompt's own
wall time says how busy the engine was, not how fast it computes. Each prompt is charged its
share of the time it was computing: with ``n`` prompts computing, each of them is charged
``1 / n`` of every second. The shares add up to the time the engine had work, so the rate is
the engine's: two cold prompts computed together each sample it, not half of it.
"""

import time
from collections import deque
from collections.abc import Callable, Hashable

MIN_SAMPLE_TOKENS = 256
"""Prompts computing fewer tokens say more about a prompt's fixed cost (joining a step, the first
token; 0.15-0.2 s for SmolLM2 on the 2-core bench machine, where 30-50 new tokens of a warm turn
took 145-225 ms) than about the rate of a long prompt, the one whose KV the routers must know
to overlap with its compute."""


SAMPLE_WINDOW = 8
"""The rate is over this many latest prompts: their tokens over their charged seconds."""


class PrefillSpeed:
    """Prompt tokens per second of the engine's compute over the latest ``SAMPLE_WINDOW``
    prompts (their tokens over the seconds charged to them), each prompt charged its share of
    the seconds it was computing. A ratio of sums, not a mean of per-prompt rates: whether the
    engine computes prompts side by side or one after another (its scheduler picks), the
    charged seconds add up to its busy time."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.tokens_per_s = 0.0
        """0 until the first sample."""
        self._clock = clock
        self._charged_s: dict[Hashable, float] = {}
        """Per prompt computing now: the seconds charged to it so far."""
        self._charged_until = clock()
        self._samples: deque[tuple[int, float]] = deque(maxlen=SAMPLE_WINDOW)

    def started(self, key: Hashable):
        """A prompt (``key``) begins computing."""
        self._charge()
        self._charged_s[key] = 0.0

    def finished(self, key: Hashable, num_computed_tokens: int):
        """The prompt ``key`` computed ``num_computed_tokens`` (not found in the prefix cache)."""
        self._charge()
        compute_s = self._charged_s.pop(key, 0.0)
        if num_computed_tokens < MIN_SAMPLE_TOKENS or compute_s <= 0:
            return
        self._samples.append((num_computed_tokens, compute_s))
        self.tokens_per_s = sum(tokens for tokens, _ in self._samples) / sum(s for _, s in self._samples)

    def abandoned(self, key: Hashable):
        """The prompt ``key`` stopped computing without a result (failed, cancelled): no sample."""
        self._charge()
        self._charged_s.pop(key, None)

    def _charge(self):
        """Split the seconds since the last change among the prompts computing meanwhile."""
        now = self._clock()
        if self._charged_s:
            share_s = (now - self._charged_until) / len(self._charged_s)
            for key in self._charged_s:
                self._charged_s[key] += share_s
        self._charged_until = now
