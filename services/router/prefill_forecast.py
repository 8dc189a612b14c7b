"""When a prefill computes each part of a prompt: what placement predicts a KV flow from.

A prefill computes a prompt's uncached tokens in chunks (its first chunk
``prefill_first_chunk_tokens``, the rest ``prefill_chunk_tokens``, both in its heartbeat) at its
reported rate, and ships each chunk's blocks as soon as the chunk is done. A main decoder that
holds a prefix lacks only the prompt's tail: its first missing block may come out of the last
chunk, so its KV cannot start crossing before the compute ends, however much the rest of the
prompt overlapped.
"""

import math
from dataclasses import dataclass

from shared.messages import LoadReported


@dataclass(frozen=True)
class PrefillForecast:
    """One prompt's predicted compute on one prefill.

    Attributes:
        num_prompt_tokens: The prompt's tokens.
        cached_tokens: Its leading tokens the prefill holds (it computes the rest; their KV is
            ready at once).
        tokens_per_s: The prefill's reported rate (0: none reported; then nothing is predicted,
            and every chunk counts as done at once).
        first_chunk_tokens: Most tokens of the first chunk computed.
        chunk_tokens: Most tokens of each later chunk.
    """

    num_prompt_tokens: int
    cached_tokens: int
    tokens_per_s: float
    first_chunk_tokens: int
    chunk_tokens: int

    @classmethod
    def of(cls, report: LoadReported, num_prompt_tokens: int, cached_tokens: int) -> "PrefillForecast":
        """The forecast of a prefill that reported ``report`` and holds ``cached_tokens`` of the
        prompt (it computes the last token whatever it holds; a report without a later chunk
        size counts every chunk as large as its first)."""
        cached_tokens = max(0, min(cached_tokens, num_prompt_tokens - 1))
        first = report.prefill_first_chunk_tokens or num_prompt_tokens - cached_tokens
        return cls(
            num_prompt_tokens=num_prompt_tokens,
            cached_tokens=cached_tokens,
            tokens_per_s=report.prefill_tokens_per_s,
            first_chunk_tokens=max(1, first),
            chunk_tokens=max(1, report.prefill_chunk_tokens or first),
        )

    @property
    def compute_tokens(self) -> int:
        return self.num_prompt_tokens - self.cached_tokens

    @property
    def compute_s(self) -> float:
        """Seconds from the compute's start to its end (0 without a rate)."""
        return self._seconds(self.compute_tokens)

    def ready_s(self, token: int) -> float:
        """Seconds from the compute's start until prompt token ``token``'s KV may ship: 0 for a
        token the prefill holds, else the end of the chunk that computes it."""
        offset = token - self.cached_tokens
        if offset < 0:
            return 0.0
        if offset < self.first_chunk_tokens:
            done = self.first_chunk_tokens
        else:
            done = (
                self.first_chunk_tokens
                + math.ceil((offset + 1 - self.first_chunk_tokens) / self.chunk_tokens) * self.chunk_tokens
            )
        return self._seconds(min(done, self.compute_tokens))

    @property
    def last_chunk_from(self) -> int:
        """The first prompt token of the last chunk computed (its KV ships when the compute ends)."""
        if self.compute_tokens <= self.first_chunk_tokens:
            return self.cached_tokens
        later = self.compute_tokens - self.first_chunk_tokens
        return self.num_prompt_tokens - (later - 1) % self.chunk_tokens - 1

    def _seconds(self, num_tokens: int) -> float:
        return num_tokens / self.tokens_per_s if self.tokens_per_s > 0 and num_tokens > 0 else 0.0
