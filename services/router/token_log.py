"""A request's token log: every output token the client has been sent, merged by index.

Tokens may come from the relay and the main decoder at once, twice (a producer that resends,
or a recovered attempt that re-emits what the client already has), or out of order. The log
accepts each index once and releases tokens strictly in order, so the client sees every
index exactly once whoever produced it. It outlives the instances that fill it: a recovery
resumes the request elsewhere from ``token_ids``.
"""

from dataclasses import dataclass, field

from shared.engine.logprobs import TokenLogprobs
from shared.messages import TokensEmitted


@dataclass
class TokenLog:
    """The ordered output of one request.

    Attributes:
        token_ids: Tokens released to the client, in index order.
        finish_reason: ``stop`` or ``length`` once a producer ended the request.
        finished_on: Producer (``RLD`` or ``MD``) that ended it.
        eager_tokens: Released tokens the relay produced first.
        logprobs: Per released token, the log-probabilities its producer sent (None where it
            sent none).
    """

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    finish_reason: str | None = None
    finished_on: str | None = None
    eager_tokens: int = 0
    _pending: dict[int, tuple[int, str, TokenLogprobs | None]] = field(default_factory=dict)
    _final_index: int | None = None

    @property
    def next_index(self) -> int:
        """Index of the next token the client is owed."""
        return len(self.token_ids)

    @property
    def complete(self) -> bool:
        """Whether every token up to the final one has been released."""
        return self._final_index is not None and self.next_index > self._final_index

    @property
    def has_gap(self) -> bool:
        """Whether later tokens arrived while an earlier one is still missing."""
        return bool(self._pending)

    def add(self, message: TokensEmitted) -> list[int]:
        """Take a producer's message; return the tokens it lets the client have now, in order."""
        logprobs = message.logprobs or ()
        for offset, token in enumerate(message.token_ids):
            index = message.start_index + offset
            if index >= self.next_index:
                logprob = logprobs[offset] if offset < len(logprobs) else None
                known = self._pending.get(index)
                if known is None or (known[2] is None and logprob is not None and known[0] == token):
                    self._pending[index] = (token, message.producer, logprob)
        if message.finish_reason is not None and self._final_index is None:
            self._final_index = message.start_index + len(message.token_ids) - 1
            self.finish_reason, self.finished_on = message.finish_reason, message.producer
        return self._release()

    def add_one(self, index: int, token: int, producer: str) -> list[int]:
        """Take one plain token (no log-probabilities, ends nothing: a ``StepTokens`` entry);
        return the tokens it lets the client have now, in order."""
        if index == len(self.token_ids) and not self._pending:  # the usual case: next in line
            self.token_ids.append(token)
            self.logprobs.append(None)
            self.eager_tokens += producer == "RLD"
            return [token]
        if index >= len(self.token_ids) and index not in self._pending:
            self._pending[index] = (token, producer, None)
        return self._release()

    def _release(self) -> list[int]:
        released = []
        while self.next_index in self._pending:
            token, producer, logprob = self._pending.pop(self.next_index)
            self.token_ids.append(token)
            self.logprobs.append(logprob)
            released.append(token)
            self.eager_tokens += producer == "RLD"
        return released

    def forget_pending(self):
        """Drop tokens not yet released (a failed attempt's; the next attempt recomputes them)."""
        self._pending.clear()
        if self._final_index is not None and not self.complete:
            self._final_index = self.finish_reason = self.finished_on = None
