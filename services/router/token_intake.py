"""What an attempt's producers send, turned into what its client gets.

Tokens reach a request as ``TokensEmitted`` (a request's last token, tokens with
log-probabilities, resends) or as ``StepTokens`` entries (a decode step's plain tokens). Either
way only an instance the attempt was placed on may write the stream (the sender its subject
proves); the token log merges by index; the outcome counts what was released. While the
request's flow waits and its client keeps up, a step entry that is next in line goes straight
from the mailbox's callback to the client (``direct``), with no task wake-up.
"""

import time
from typing import Protocol

import structlog

from services.router.outcome import RequestOutcome
from services.router.stream_watch import StreamWatch
from services.router.token_log import TokenLog
from shared.messages import TokensEmitted
from shared.metrics import REFUSED_MESSAGES

log = structlog.get_logger(__name__)


class DirectSink(Protocol):
    """Where a streaming answer's tokens can go straight from the mailbox's callback."""

    def ready(self) -> bool:
        """Whether ``deliver`` of one plain token would finish now, without waiting."""

    def deliver(self, batch: list[int]):
        """Send ``batch`` to the client now (synchronously)."""


class TokenIntake:
    """One attempt's token intake (a recovery starts a new one on the same log and outcome).

    Attributes:
        sink: Where ``direct`` delivers (None: every token goes through the flow's task).
    """

    def __init__(
        self, request_id: str, token_log: TokenLog, watch: StreamWatch, outcome: RequestOutcome, started: float
    ):
        self.request_id, self.log, self.watch, self.outcome, self.started = (
            request_id,
            token_log,
            watch,
            outcome,
            started,
        )
        self.sink: DirectSink | None = None

    def released(self, tokens: TokensEmitted) -> list[int]:
        """The tokens a producer's message lets the client have now (none from an instance
        the attempt was not placed on)."""
        if not self.watch.may_write(tokens.instance_id):
            self._refuse(tokens.instance_id)
            return []
        batch = self.log.add(tokens)
        self.outcome.finish_reason, self.outcome.finished_on = self.log.finish_reason, self.log.finished_on
        return batch

    def released_step(self, index: int, token: int, producer: str, sender: str) -> list[int]:
        """What one ``StepTokens`` entry from ``sender`` (its subject's instance) lets the
        client have now: nothing from an instance the attempt was not placed on."""
        if not self.watch.may_write(sender):
            self._refuse(sender)
            return []
        return self.log.add_one(index, token, producer)

    def direct(self, item: tuple) -> bool:
        """Deliver a ``("step", index, token, producer, sender)`` item from the mailbox's
        callback: only the next token in line, from a decoder the attempt is placed on, into a
        sink that can write it now; False for anything else (the flow's task takes it)."""
        _, index, token, producer, sender = item
        token_log = self.log
        if (
            index != token_log.next_index
            or token_log.has_gap
            or not self.watch.may_write(sender)
            or not self.sink.ready()
        ):
            return False
        self.sink.deliver(self.delivered(token_log.add_one(index, token, producer)))
        return True

    def delivered(self, batch: list[int]) -> list[int]:
        """Account a batch about to go to the client."""
        self.watch.on_tokens_released(time.monotonic())
        outcome = self.outcome
        if outcome.ttft_ms is None:
            outcome.ttft_ms = round((time.perf_counter() - self.started) * 1000, 1)
        outcome.output_tokens = self.log.next_index
        outcome.eager_tokens = self.log.eager_tokens
        return batch

    def _refuse(self, instance_id: str):
        """Only the instances this attempt was placed on write its stream."""
        REFUSED_MESSAGES.labels("router", "tokens_from_unplaced_instance").inc()
        log.warning("tokens_refused", request_id=self.request_id, instance=instance_id, reason="not placed on it")
