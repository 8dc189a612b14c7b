"""The router's mailbox: one standing subscription for every request's tokens and events.

Subscribing per request raced the main decoder: interest in a new subject reaches the other
site over the leafnode asynchronously, and a main decoder holding the prompt's blocks could
publish the first token before that, so NATS dropped it and the request hung until its
timeout. The router instead subscribes once, at start-up, to the subjects of every request
id it mints, and sorts what arrives into per-request queues.
"""

import asyncio

import nats

from shared import subjects


class RequestMailbox:
    """Per-request queues of ``("tokens" | "event", msg)`` fed by two standing subscriptions."""

    def __init__(self, nc: nats.NATS, origin: str):
        self._nc = nc
        self.origin = origin
        self._queues: dict[str, asyncio.Queue] = {}

    async def start(self):
        """Subscribe and make sure the local server has registered the interest."""
        await self._nc.subscribe(subjects.tokens_of_origin(self.origin), cb=self._deliver("tokens"))
        await self._nc.subscribe(subjects.request_events_of_origin(self.origin), cb=self._deliver("event"))
        await self._nc.flush()

    def open(self, request_id: str) -> asyncio.Queue:
        """Start collecting ``request_id``'s messages; returns its queue."""
        if subjects.origin_of(request_id) != self.origin:
            raise ValueError(f"request {request_id!r} was not minted by {self.origin!r}")
        queue = self._queues[request_id] = asyncio.Queue()
        return queue

    @property
    def open_request_ids(self) -> list[str]:
        """Requests being collected now (the router's heartbeat lists them: their leases)."""
        return list(self._queues)

    def close(self, request_id: str):
        """Stop collecting; later messages for the request are dropped."""
        self._queues.pop(request_id, None)

    def _deliver(self, kind: str):
        async def callback(msg):
            request_id = msg.subject.rsplit(".", 1)[-1]
            queue = self._queues.get(request_id)
            if queue is not None:
                queue.put_nowait((kind, msg))
        return callback
