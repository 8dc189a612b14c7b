"""The relay's handoff state machine, one per request.

``DECODING → (ONE_SHOT | CATCH_UP(chunk k)) → RELEASED``, or ``FINISHED_LOCALLY`` when the
relay ends the request itself (short output, odd traffic, or a handoff that failed).

When main decode announces it holds the prompt KV, the relay looks at its backlog (tokens
emitted that main decode must absorb) and its own load:

- one-shot: the relay is busy (load at or above the watermark) or the backlog is small:
  hand everything over at once and free the slot now;
- catch-up: the backlog exceeds the threshold and the relay has room: hand over a chunk
  while it keeps relaying; when main decode has absorbed it, hand over what accumulated
  meanwhile; once the gap is small (or the relay gets busy), pause and hand over the rest
  for good. Many small absorptions instead of one big stall of main decode's other streams.

The machine only decides: it returns the ``HandoffChunk`` to send and keeps what it did as
events (``StateChanged``, ``ChunkPlanned``) for its owner to take. It touches nothing global:
the relay service executes the chunks and turns the events into logs and span events; the
simulator runs the same machine and ignores them.
"""

import enum
from dataclasses import dataclass, field


class HandoffState(enum.Enum):
    """Where a relayed request stands."""

    DECODING = "decoding"
    CATCH_UP = "catch_up"
    ONE_SHOT = "one_shot"
    RELEASED = "released"
    FINISHED_LOCALLY = "finished_locally"


@dataclass(frozen=True)
class HandoffPolicy:
    """Thresholds of the mode switch.

    Attributes:
        catch_up_threshold_tokens: Backlog above which catch-up is worth it.
        final_gap_tokens: Gap at or below which catch-up hands over for good.
        load_watermark: Relay load (active / max sequences) at or above which it frees itself.
        max_chunks: Chunks after which catch-up hands over for good even if the gap is not
            small (a relay faster than the handoff round trip would otherwise chase forever).
        max_chunk_tokens: Largest catch-up chunk: bounds each absorption's stall of main
            decode's other streams.
    """

    catch_up_threshold_tokens: int = 64
    final_gap_tokens: int = 8
    load_watermark: float = 0.5
    max_chunks: int = 16
    max_chunk_tokens: int = 32


@dataclass(frozen=True)
class HandoffChunk:
    """Hand output tokens ``[start_index, end_index)`` to main decode.

    Attributes:
        start_index: First output index in the chunk (what main decode already holds).
        end_index: One past the last.
        final: Main decode owns the request afterwards (the relay pauses before sending).
        mode: ``one-shot`` or ``catch-up``.
        chunk: 1-based chunk number.
    """

    start_index: int
    end_index: int
    final: bool
    mode: str
    chunk: int


@dataclass(frozen=True)
class StateChanged:
    """The machine moved from ``previous`` to ``state``.

    Attributes:
        request_id: The relayed request.
        previous: The state it left.
        state: The state it entered.
        why: What decided it (``backlog`` and ``load``, ``chunks``, or ``reason``).
    """

    request_id: str
    previous: HandoffState
    state: HandoffState
    why: dict[str, str | int | float] = field(default_factory=dict)


@dataclass(frozen=True)
class ChunkPlanned:
    """The machine decided to hand ``chunk`` to main decode."""

    request_id: str
    chunk: HandoffChunk


HandoffEvent = StateChanged | ChunkPlanned


class IllegalTransition(Exception):
    """An event arrived that the current state does not allow."""


@dataclass
class HandoffMachine:
    """Decides one relayed request's handoff."""

    request_id: str
    policy: HandoffPolicy = field(default_factory=HandoffPolicy)
    state: HandoffState = HandoffState.DECODING
    handed_index: int = 0
    chunks: int = 0
    mode: str | None = None
    in_flight: HandoffChunk | None = None
    history: list[str] = field(default_factory=lambda: [HandoffState.DECODING.value])
    events: list[HandoffEvent] = field(default_factory=list)
    """What the machine did since its owner last took the events, oldest first."""

    def kv_ready(self, emitted: int, load: float) -> HandoffChunk | None:
        """Main decode holds the prompt KV; ``emitted`` tokens are out, relay load is ``load``."""
        self._expect(HandoffState.DECODING)
        backlog = emitted - self.handed_index
        if backlog > self.policy.catch_up_threshold_tokens and load < self.policy.load_watermark:
            self.mode = "catch-up"
            self._move(HandoffState.CATCH_UP, backlog=backlog, load=load)
            return self._chunk(self.handed_index + min(backlog, self.policy.max_chunk_tokens), final=False)
        self.mode = "one-shot"
        self._move(HandoffState.ONE_SHOT, backlog=backlog, load=load)
        return self._chunk(emitted, final=True) if emitted > 0 else None

    def accepted(self, next_index: int, emitted: int, load: float) -> HandoffChunk | None:
        """Main decode absorbed the chunk in flight and will produce ``next_index`` next."""
        chunk = self.in_flight
        # A final chunk may carry more than planned: the relay pauses only when it sends it.
        if chunk is None or next_index < chunk.end_index or (not chunk.final and next_index != chunk.end_index):
            raise IllegalTransition(f"unexpected acceptance up to {next_index}")
        final, self.in_flight, self.handed_index = self.in_flight.final, None, next_index
        if final:
            self._move(HandoffState.RELEASED, chunks=self.chunks)
            return None
        return self.tokens_emitted(emitted, load)

    def tokens_emitted(self, emitted: int, load: float) -> HandoffChunk | None:
        """The relay produced more tokens; hand over the next chunk if one is due."""
        if self.state is not HandoffState.CATCH_UP or self.in_flight is not None:
            return None
        gap = emitted - self.handed_index
        if gap <= 0:
            return None  # the final chunk needs at least one token: wait for the next
        final = (
            gap <= self.policy.final_gap_tokens
            or load >= self.policy.load_watermark
            or self.chunks + 1 >= self.policy.max_chunks
        )
        end = emitted if final else self.handed_index + min(gap, self.policy.max_chunk_tokens)
        return self._chunk(end, final=final)

    def failed(self, reason: str):
        """The handoff could not be done: the relay finishes the request itself."""
        self.in_flight = None
        self._move(HandoffState.FINISHED_LOCALLY, reason=reason)

    def finished_locally(self, reason: str = "relay finished first"):
        """The relay's sequence ended before a final handoff."""
        if self.state not in (HandoffState.RELEASED, HandoffState.FINISHED_LOCALLY):
            self._move(HandoffState.FINISHED_LOCALLY, reason=reason)

    @property
    def done(self) -> bool:
        """No more handoff work for this request."""
        return self.state in (HandoffState.RELEASED, HandoffState.FINISHED_LOCALLY)

    def take_events(self) -> list[HandoffEvent]:
        """The events since the last call, oldest first (the machine forgets them)."""
        taken, self.events = self.events, []
        return taken

    def _chunk(self, emitted: int, final: bool) -> HandoffChunk:
        self.chunks += 1
        self.in_flight = HandoffChunk(self.handed_index, emitted, final, self.mode, self.chunks)
        self.events.append(ChunkPlanned(self.request_id, self.in_flight))
        return self.in_flight

    def _expect(self, state: HandoffState):
        if self.state is not state:
            raise IllegalTransition(f"{self.request_id}: {self.state.value}, expected {state.value}")

    def _move(self, state: HandoffState, **why):
        self.events.append(StateChanged(self.request_id, self.state, state, why))
        self.state = state
        self.history.append(state.value)
