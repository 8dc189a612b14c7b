"""The receiving side of one flow striped over several connections: which of its streams
joined and ended, and the order its frames are imported in.

A sender puts frame k of a flow on its stream ``k mod streams``, so each stream carries its
frames in the flow's order, and the frame the flow needs next is always the first one some
stream has not imported yet. Each stream's reader therefore checks its next frame, then
waits for its turn (``turn``: the flow's import has reached the frame's first token), imports
it and moves the flow on (``imported``). The reorder buffer is thus the frames waiting for
their turn, at most one per stream, plus each stream's one read ahead: a flow holds at most
``2 × streams`` frames (``streams`` ≤ ``path_sizing.MAX_STREAMS``), each within the
receiver's frame limits, whatever its sender does. When every stream still sending waits
for a turn that none of them can give (a sender that skipped a frame, or put frames out of
order on one stream), the flow fails at once: it is cut off, never buffered. A frame waits
for its turn at most the receiver's frame timeout.

One stream (``streams == 1``) imports its frames as they come, exactly as before striping:
the engine refuses a frame that does not start where the import stands.
"""

import asyncio
import time

from shared.bulk.connection import BulkConnection
from shared.bulk.flow_stats import FlowStats
from shared.kv_wire import KvFrameHeader
from shared.messages import FlowOpen


class StreamBroken(Exception):
    """A stream or the whole flow must end; the message says why (it becomes the abort reason)."""


class StripedFlow:
    """One accepted flow's streams (index 0: the lead, which carried the FlowOpen)."""

    def __init__(self, flow_open: FlowOpen, lead: BulkConnection, first_token_index: int, stats: FlowStats):
        self.flow_open = flow_open
        self.stats = stats
        self.failure: str | None = None
        """Why the flow failed (the first reason given), None while it has not."""
        self.first_token_index = first_token_index
        self._next_token = first_token_index
        self._streams: dict[int, BulkConnection] = {0: lead}
        self._done = 0  # streams that sent their last frame (the lead's FlowEnd, a StreamEnd)
        self._waiting: list[int] = []  # first tokens of the frames waiting for their turn
        self._changed = asyncio.Event()

    @property
    def request_id(self) -> str:
        return self.flow_open.request_id

    @property
    def num_streams(self) -> int:
        """Streams the FlowOpen announced, the lead included."""
        return self.flow_open.streams

    def join(self, stream: int, connection: BulkConnection) -> str | None:
        """Attach ``connection`` as stream ``stream``; None if it may, else why not."""
        if self.failure is not None:
            return "the flow has failed"
        if not 1 <= stream < self.num_streams:
            return f"stream {stream} is not within 1..{self.num_streams - 1}"
        if stream in self._streams:
            return f"stream {stream} has joined already"
        self._streams[stream] = connection
        return None

    async def turn(self, header: KvFrameHeader, timeout_s: float):
        """Wait until the flow's import reaches ``header``'s first token.

        Raises:
            StreamBroken: the flow failed meanwhile, the wait passed ``timeout_s``, or no
                stream can bring the frame the flow needs next (the flow is failed then).
        """
        start = header.first_token_index
        if self.num_streams == 1 or start <= self._next_token:
            return
        deadline = time.monotonic() + timeout_s
        self._waiting.append(start)
        self._notify()
        try:
            while not (self.failure is not None or start <= self._next_token or self._stuck()):
                changed = self._changed
                try:
                    await asyncio.wait_for(changed.wait(), max(0.0, deadline - time.monotonic()))
                except TimeoutError:
                    raise StreamBroken(f"a frame waited {timeout_s:.0f} s for the frames before it") from None
        finally:
            self._waiting.remove(start)
        if self.failure is not None:
            raise StreamBroken(self.failure)
        if start > self._next_token:
            raise StreamBroken(self.fail(f"frames out of order: none of the streams brings token {self._next_token}"))

    def _stuck(self) -> bool:
        """Every stream that may still send waits for a turn, and none of them holds the frame
        the flow needs next (one that does has its turn and goes on, once its task runs: a frame
        imported just now gives the turn to a waiting one while the others may still arrive)."""
        return len(self._waiting) >= self.num_streams - self._done and min(self._waiting) > self._next_token

    def imported(self, header: KvFrameHeader, size: int):
        """The frame ``header`` heads is imported: the flow moves on past its tokens."""
        self._next_token = max(self._next_token, header.first_token_index + header.num_tokens)
        self.stats.frames += 1
        if self.stats.frames == 1:
            self.stats.first_frame_monotonic, self.stats.first_frame_bytes = time.monotonic(), size
        self._notify()

    def stream_done(self, stream: int):
        """Stream ``stream`` sent its last frame (the lead its FlowEnd, a joined stream its
        StreamEnd); a joined stream's connection is no longer the flow's (it may serve another)."""
        if stream:
            self._streams.pop(stream, None)
        self._done += 1
        self._notify()

    async def all_streams_done(self, timeout_s: float):
        """Wait until every stream sent its last frame (and so the flow's frames are imported).

        Raises:
            StreamBroken: the flow failed, or ``timeout_s`` passed first.
        """
        deadline = time.monotonic() + timeout_s
        while self.failure is None and self._done < self.num_streams:
            changed = self._changed
            try:
                await asyncio.wait_for(changed.wait(), max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                missing = self.num_streams - self._done
                raise StreamBroken(
                    f"{missing} of {self.num_streams} streams did not end within {timeout_s:.0f} s"
                ) from None
        if self.failure is not None:
            raise StreamBroken(self.failure)

    def fail(self, reason: str) -> str:
        """Fail the flow (once: the first reason stays) and close the connections of its streams
        still sending, which ends their reads; return the reason that stands."""
        if self.failure is None:
            self.failure = reason
            for connection in self._streams.values():
                connection.close()
            self._notify()
        return self.failure

    def _notify(self):
        self._changed.set()
        self._changed = asyncio.Event()
