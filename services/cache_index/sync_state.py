"""One publisher's KV-event sync as a state machine: epochs, sequence numbers, gaps, dumps.

A publisher (a prefill or main-decode incarnation) numbers its events 1, 2, 3… within its
epoch. The state applies them in order and answers, for every input, whether a full dump
of the publisher's prefix cache is needed now:

- a heartbeat names the live epoch; events of any other incarnation are ignored (streams
  outlive processes), and state of an old epoch is dropped;
- an event that cannot be placed (the state has no base yet and the event is not seq 1, or
  a dump is in flight) is held; a gap in the numbers is held too and asks for a dump;
- a duplicate (seq already applied) is dropped;
- a dump replaces the state, and the held events that follow it without a gap are applied.

Time is passed in, never read: the owner drives it from NATS callbacks; tests drive it with
plain messages.
"""

import enum
from dataclasses import dataclass, field

from shared.messages import KvBlocksStored, KvEvent


class EventVerdict(enum.Enum):
    """What became of one event."""

    APPLIED = "applied"
    DUPLICATE = "duplicate"
    OTHER_INCARNATION = "other_incarnation"
    HELD = "held"
    GAP = "gap"


@dataclass
class PublisherSync:
    """What one instance holds, as far as its events tell.

    Attributes:
        site: The instance's site.
        last_seen: Time (the owner's clock) of its last heartbeat or applied event.
        service: Its service (known from its heartbeat; needed to ask for a dump).
        epoch: The publisher incarnation the state belongs to.
        live_epoch: The incarnation its latest heartbeat names ("" until one arrives).
        block_hashes: Cached block hashes.
        seq: Sequence number of the last event applied (-1: not in sync).
        syncing: A dump is in flight.
        pending: Events held until a dump tells where they fit.
    """

    site: str
    last_seen: float
    service: str = ""
    epoch: str = ""
    live_epoch: str = ""
    block_hashes: set[int] = field(default_factory=set)
    seq: int = -1
    syncing: bool = False
    pending: list = field(default_factory=list)

    @property
    def routable(self) -> bool:
        """Whether the state is the running incarnation's (a heartbeat confirmed it)."""
        return bool(self.live_epoch) and self.epoch == self.live_epoch

    def leading_hits(self, block_hashes: list[int]) -> int:
        """How many leading blocks of ``block_hashes`` are held."""
        hits = 0
        for block_hash in block_hashes:
            if block_hash not in self.block_hashes:
                break
            hits += 1
        return hits

    def heartbeat(self, service: str, epoch: str, now: float) -> bool:
        """The instance announced itself; True when a dump must be asked for now."""
        self.service, self.last_seen, self.live_epoch = service, now, epoch
        if self.epoch != epoch and not self.syncing:
            self._reset(epoch)
        return self.seq < 0 and self._start_dump()

    def event(self, event: KvEvent, now: float) -> tuple[EventVerdict, bool]:
        """Take one stream event; return what became of it and whether to ask for a dump."""
        if self.live_epoch and event.epoch != self.live_epoch:
            return EventVerdict.OTHER_INCARNATION, False
        if event.epoch != self.epoch:
            self._reset(event.epoch)
        if self.syncing or (self.seq < 0 and event.seq != 1):
            # Where this event fits is unknown until a dump says how far the state goes.
            self.pending.append(event)
            return EventVerdict.HELD, bool(self.service) and self._start_dump()
        if event.seq <= self.seq:
            return EventVerdict.DUPLICATE, False
        if self.seq >= 0 and event.seq > self.seq + 1:
            self.pending.append(event)
            return EventVerdict.GAP, self._start_dump()
        self._apply(event, now)
        return EventVerdict.APPLIED, False

    def dump_received(self, dump: KvBlocksStored, now: float) -> int:
        """A dump arrived: it replaces the state; return how many held events followed it."""
        self.epoch, self.block_hashes, self.seq = dump.epoch, set(dump.block_hashes), dump.seq
        applied = 0
        for event in sorted(self.pending, key=lambda e: e.seq):
            if event.epoch == self.epoch and event.seq == self.seq + 1:
                self._apply(event, now)
                applied += 1
        self._end_dump()
        return applied

    def dump_failed(self):
        """The dump did not come: the next heartbeat or event asks again."""
        self._end_dump()

    def _start_dump(self) -> bool:
        if self.syncing:
            return False
        self.syncing = True
        return True

    def _end_dump(self):
        self.pending.clear()
        self.syncing = False

    def _reset(self, epoch: str):
        """A new incarnation of the publisher: forget the old one's state."""
        self.epoch, self.block_hashes, self.seq, self.pending = epoch, set(), -1, []

    def _apply(self, event: KvEvent, now: float):
        if isinstance(event, KvBlocksStored):
            self.block_hashes.update(event.block_hashes)
        else:
            self.block_hashes.difference_update(event.block_hashes)
        self.seq = event.seq
        self.last_seen = now
