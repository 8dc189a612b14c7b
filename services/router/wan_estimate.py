"""The router's live estimate of the WAN link, learnt from the bulk channel's own transfers.

Main decode measures throughput between the first and last frame of each WAN flow
(``KvReady.throughput_bps``); prefill measures the flow handshake, one round trip
(``PrefillCompleted.wan_rtt_s``). Both are smoothed with an exponentially weighted moving
average; the configured values stand until the first measurement replaces them.

Smoothing applies to rises and noise only. A transfer much slower than believed (below
``DROP_FACTOR`` of the estimate) replaces the bandwidth estimate at once: a link that fell
from 100 to 2 Mbit/s must not send several more requests P→MD while the average catches up,
and over-predicting for one transfer after a brief dip only costs a relayed request. A flow
that shared the link with other placed flows measured its share of it: that sample may raise
the estimate, never lower it (with flows re-planned at the rate believed now, taking a share
for the link's rate stretched every flow in the ledger).

A handshake sample also waits behind other flows' KV in the link's queue; one sample may
raise the RTT estimate at most ``RTT_MAX_RISE``-fold, so one handshake queued behind a burst
does not make every later request look relay-worthy. Repeated slow handshakes still raise it
quickly.

The link is shared: every flow this router placed is still crossing until its predicted last
byte (``flow_placed``), relayed requests' included (their KV still goes to main decode after
the relay answered), unless the router stopped it (``flow_stopped``: odd traffic the relay
finished). A flow's last byte leaves no earlier than its prefill ends: predicted from the
prefill's reported rate until the prefill says it is done (``prefill_done``). A prefill sends
its WAN flows shortest-remaining-first (``shared/bulk/link_turns.py``), and the flows of
different prefills share the link equally, so the ledger tracks what each placed flow has still
to send with each prefill's flow with the least left, among those whose first byte may leave,
given an equal share of the link (``services/router/link_share.py``), and plans their last
bytes the same way, each no earlier than its prefill ends. A flow that lands (its
``KvReady``) or is stopped leaves the others what the link carried of them so far; a faster
link measured since moves them all up. A new flow of ``B`` bytes is done once the link has
carried ``B`` plus all of each flow of its prefill still crossing with no more than ``B`` left,
plus as much of each other prefill's flow (``WanEstimate.crossing_bytes``): a follow-up turn's
megabyte beside a cold prompt's 30 MB from the same prefill takes a megabyte's time, and a
cold prompt placed behind another waits for it.
Blocks a placed
flow is still bringing to a main decoder do not cross again (a decoder's later flow waits for
them, ``shared/decode_cache.py``): ``arriving`` says how many of a prompt's leading blocks
each decoder has on the way and when they land, so a follow-up turn counts only its new
blocks. Other routers' flows are not counted.
"""

import time
from collections.abc import Callable
from dataclasses import dataclass

from services.router.link_share import Sending, advance, drained, finish_times, shared_transfer_bytes
from shared.block_hash import common_prefix

MIN_SAMPLE_BYTES = 256 << 10
DROP_FACTOR = 0.5
RTT_MAX_RISE = 4.0


@dataclass(frozen=True)
class WanEstimate:
    """What the router believes about the link.

    Attributes:
        bandwidth_bps: Bits per second.
        rtt_s: Round trip in seconds.
        queue_s: Seconds from now until the flows this router already placed have left (shown
            by the router's status; predictions use ``crossing_bytes``).
        crossing_bytes: What each of those flows still has to send, as of now.
        crossing_senders: The prefill sending each of them (empty: one prefill sends them all).
    """

    bandwidth_bps: float
    rtt_s: float
    queue_s: float = 0.0
    crossing_bytes: tuple[float, ...] = ()
    crossing_senders: tuple[str, ...] = ()

    def arrival_after_prefill_s(
        self,
        num_bytes: int,
        prefill_s: float = 0.0,
        ships_from_s: float = 0.0,
        tail_bytes: int = 0,
        sender_id: str = "",
    ) -> float:
        """When the last of ``num_bytes`` of KV lands at main decode, counted from the end of
        a prefill that computes for ``prefill_s``: the first of them is ready ``ships_from_s``
        into the compute, and ``tail_bytes`` of them come out of its last chunk, ready when it
        ends. The flow opens as the compute starts (one round trip), so its first byte leaves
        at ``max(ships_from_s, rtt)``; until then the flows crossing drain, the smallest first
        (each counted as sending from now, even one whose own first byte is still ahead). From
        there its last byte leaves once the link has carried its bytes, all of each flow of its
        prefill (``sender_id``) crossing with no more left, and of each other prefill's flow
        as much as its own prefill sent meanwhile (``shared_transfer_bytes``), and no earlier than the link
        has carried the tail after the prefill ends (the flows crossing drained until then of
        what the link did not carry of this flow's earlier bytes); it lands one one-way delay
        later.
        Without a prefill estimate (0, 0): a round trip, the shared transfer and a one-way
        delay."""
        first_byte_s = max(ships_from_s, self.rtt_s)
        transfer_s = self._shared_transfer_s(num_bytes, first_byte_s, sender_id)
        last_byte_s = max(prefill_s, first_byte_s + transfer_s)
        if tail_bytes > 0:
            tail_from_s = max(prefill_s, self.rtt_s)
            tail_s = self._shared_transfer_s(tail_bytes, tail_from_s, sender_id, num_bytes - tail_bytes)
            last_byte_s = max(last_byte_s, tail_from_s + tail_s)
        return last_byte_s - prefill_s + self.rtt_s / 2

    def _shared_transfer_s(
        self, num_bytes: float, from_s: float, sender_id: str, carried_own_bytes: float = 0.0
    ) -> float:
        """Seconds the link takes to carry ``num_bytes`` of ``sender_id``'s from ``from_s`` on
        beside the flows crossing, drained of what the link carried of them until then
        besides ``carried_own_bytes`` of this flow's."""
        carried_bytes = max(0.0, from_s * self.bandwidth_bps / 8 - carried_own_bytes)
        crossing = drained(self.crossing_bytes, carried_bytes)
        senders = self.crossing_senders or None
        return shared_transfer_bytes(num_bytes, crossing, senders, sender_id) * 8 / self.bandwidth_bps


@dataclass
class PlacedFlow:
    """KV this router sent across the link: to whom, which blocks, how many bytes, when (clock
    seconds) it was placed and its prefill ends, and how it fares on the link (``sending``:
    when its first byte may leave, what it has still to send as of the ledger's last look)."""

    main_decode_id: str
    block_hashes: tuple[int, ...]
    num_bytes: int
    placed_at: float
    prefill_ends_at: float
    sending: Sending


@dataclass(frozen=True)
class Arriving:
    """A prompt's leading blocks on their way to one main decoder.

    Attributes:
        blocks: How many.
        lands_in_s: Seconds from now until the last of them lands.
    """

    blocks: int
    lands_in_s: float


class WanEstimator:
    """EWMA of bandwidth and RTT samples, and the flows placed on the link."""

    def __init__(
        self, bandwidth_bps: float, rtt_s: float, alpha: float = 0.3, clock: Callable[[], float] = time.monotonic
    ):
        self.bandwidth_bps, self.rtt_s, self.alpha = bandwidth_bps, rtt_s, alpha
        self.bandwidth_samples = self.rtt_samples = 0
        self._clock = clock
        self._flows: dict[str, PlacedFlow] = {}  # by request id, in placement order (a recovery's replaces its first)
        self._as_of = clock()  # the flows' unsent bytes are as of this clock time
        self._last_landed_at = float("-inf")
        self._num_ledger_changes = 0  # bumped whenever _flows changes (keys the _leaving plan)
        self._plan: tuple[tuple, dict[str, float]] = ((), {})

    def add_throughput(self, throughput_bps: float, num_bytes: int, request_id: str | None = None):
        """A WAN flow's measured throughput (ignored for transfers too small to tell). With
        ``request_id`` (the placed flow it measured): a flow that shared the link with other
        placed flows measured its share, a lower bound of the link's rate: it may raise the
        estimate, never lower it."""
        if throughput_bps <= 0 or num_bytes < MIN_SAMPLE_BYTES:
            return
        self._advance()  # what crossed so far crossed at the rate believed so far
        shared = request_id is not None and self._shared(request_id, num_bytes * 8 / throughput_bps)
        if shared and throughput_bps <= self.bandwidth_bps:
            return
        dropped = throughput_bps < DROP_FACTOR * self.bandwidth_bps
        weight = self.alpha if self.bandwidth_samples and not dropped else 1.0
        self.bandwidth_bps += weight * (throughput_bps - self.bandwidth_bps)
        self.bandwidth_samples += 1

    def _shared(self, request_id: str, transfer_s: float) -> bool:
        """Whether another placed flow was on the link while ``request_id``'s crossed (its last
        byte left a round trip ago, ``transfer_s`` after its first)."""
        now = self._clock()
        sent_from, sent_until = now - self.rtt_s - transfer_s, now - self.rtt_s
        if self._last_landed_at > sent_from:
            return True
        return any(
            leaves_at > sent_from and self._flows[rid].placed_at < sent_until
            for rid, leaves_at in self._leaving().items()
            if rid != request_id
        )

    def add_rtt(self, rtt_s: float):
        """A WAN flow's handshake time."""
        if rtt_s <= 0:
            return
        rtt_s = min(rtt_s, RTT_MAX_RISE * self.rtt_s) if self.rtt_s > 0 else rtt_s
        weight = self.alpha if self.rtt_samples else 1.0
        self.rtt_s += weight * (rtt_s - self.rtt_s)
        self.rtt_samples += 1

    def flow_placed(
        self,
        request_id: str,
        main_decode_id: str,
        block_hashes: list[int],
        num_bytes: int,
        prefill_s: float,
        ships_from_s: float | None = None,
        sender_id: str = "",
    ):
        """``request_id``'s flow of ``num_bytes`` to ``main_decode_id`` for a prompt of
        ``block_hashes`` was placed now on prefill ``sender_id``, its prefill predicted to take
        ``prefill_s`` and its first missing block ready to ship ``ships_from_s`` into it (None:
        all at the end)."""
        now = self._clock()
        for rid in [rid for rid, leaves_at in self._leaving().items() if leaves_at <= now or rid == request_id]:
            self._forget(rid)
        self._num_ledger_changes += 1
        if num_bytes <= 0:
            return
        first_byte_at = now + max(prefill_s if ships_from_s is None else ships_from_s, self.rtt_s)
        self._flows[request_id] = PlacedFlow(
            main_decode_id,
            tuple(block_hashes),
            num_bytes,
            now,
            now + prefill_s,
            Sending(first_byte_at, num_bytes, sender_id),
        )

    def prefill_done(self, request_id: str):
        """``request_id``'s prefill has computed and exported its whole prompt: its flow's last
        byte now waits for the link alone, not for the predicted end of the compute."""
        flow = self._flows.get(request_id)
        if flow is None:
            return
        self._advance()
        now = self._clock()
        flow.prefill_ends_at = now
        flow.sending.first_byte_at = min(flow.sending.first_byte_at, now)
        self._num_ledger_changes += 1

    def _advance(self):
        """Bring the flows' unsent bytes up to now: the link carried them (``link_share``)."""
        now = self._clock()
        if now > self._as_of:
            advance([flow.sending for flow in self._flows.values()], self._as_of, now, self.bandwidth_bps / 8)
            self._as_of = now

    def _leaving(self) -> dict[str, float]:
        """When each placed flow's last byte leaves: from what each has still to send, the
        link shared as ``link_share`` says among those whose first byte may leave, at the
        bandwidth believed now; no earlier than the flow's prefill ends. Planned again only after the ledger or
        the bandwidth changed: advancing the flows along the plan does not move it."""
        key = (self._num_ledger_changes, self.bandwidth_bps)
        if self._plan[0] == key:
            return self._plan[1]
        self._advance()
        flows = list(self._flows.items())
        done_at = finish_times([flow.sending for _, flow in flows], self._as_of, self.bandwidth_bps / 8)
        leaving = {rid: max(flow.prefill_ends_at, at) for (rid, flow), at in zip(flows, done_at, strict=True)}
        self._plan = (key, leaving)
        return leaving

    def flow_landed(self, request_id: str, main_decode_id: str | None = None, *, just_now: bool = True):
        """Main decode has all of ``request_id``'s KV: the flow holds the link no longer.
        With ``main_decode_id`` (who says so), only if the flow went to that decoder.
        ``just_now``: told by its ``KvReady`` (its last byte left a round trip ago); False:
        found out later (the cache-index lists its blocks)."""
        flow = self._flows.get(request_id)
        if flow is not None and main_decode_id in (None, flow.main_decode_id):
            self._forget(request_id)
            if just_now:
                self._last_landed_at = self._clock() - self.rtt_s

    def main_decode_of(self, request_id: str) -> str | None:
        """The main decoder ``request_id``'s flow goes to, while it is on the ledger."""
        flow = self._flows.get(request_id)
        return flow.main_decode_id if flow is not None else None

    def flow_stopped(self, request_id: str):
        """The router stopped ``request_id``'s flow (odd traffic the relay finished): its bytes
        cross no more."""
        if request_id in self._flows:
            self._forget(request_id)

    def _forget(self, request_id: str):
        """Drop ``request_id``'s flow; the others keep what the link carried of them so far."""
        self._advance()
        del self._flows[request_id]
        self._num_ledger_changes += 1

    def seen_cached(self, block_hashes: list[int], hits: dict[str, int]):
        """The cache-index lists ``hits`` leading blocks of ``block_hashes`` per instance: a
        placed flow whose whole prompt they cover at its main decoder has landed (its
        ``KvReady`` may have come after its request ended, when nobody listened)."""
        for request_id, flow in list(self._flows.items()):
            covered = len(flow.block_hashes)
            if _covers(block_hashes, flow.block_hashes) and hits.get(flow.main_decode_id, 0) >= covered:
                self.flow_landed(request_id, just_now=False)

    def arriving(self, block_hashes: list[int]) -> dict[str, Arriving]:
        """Per main decoder, the most leading blocks of ``block_hashes`` that placed flows are
        still bringing it, and when the flow bringing them lands. A flow that landed (or should
        have) counts no more: only the cache-index credits blocks a decoder holds (a restarted
        decoder holds none of them)."""
        now, found = self._clock(), {}
        for request_id, leaves_at in self._leaving().items():
            if leaves_at <= now:
                continue
            flow = self._flows[request_id]
            blocks = common_prefix(flow.block_hashes, block_hashes)
            best = found.get(flow.main_decode_id)
            if blocks and (best is None or blocks > best.blocks):
                found[flow.main_decode_id] = Arriving(blocks, leaves_at + self.rtt_s / 2 - now)
        return found

    def current(self) -> WanEstimate:
        """The estimate placement uses now."""
        now, leaving = self._clock(), self._leaving()
        self._advance()
        link_free_at = max(leaving.values(), default=now)
        crossing = [
            self._flows[rid].sending
            for rid, leaves_at in leaving.items()
            if leaves_at > now and self._flows[rid].sending.unsent_bytes > 0
        ]
        return WanEstimate(
            self.bandwidth_bps,
            self.rtt_s,
            max(0.0, link_free_at - now),
            tuple(flow.unsent_bytes for flow in crossing),
            tuple(flow.sender for flow in crossing),
        )


def _covers(a: list[int], b: tuple[int, ...]) -> bool:
    """Whether chained block hashes ``a`` start with all of ``b`` (equal at i means equal up to i)."""
    return len(b) <= len(a) and (not b or a[len(b) - 1] == b[-1])
