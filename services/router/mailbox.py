"""The router's mailbox: one standing subscription for every request's tokens and events.

Subscribing per request raced the main decoder: interest in a new subject reaches the other
site over the leafnode asynchronously, and a main decoder holding the prompt's blocks could
publish the first token before that, so NATS dropped it and the request hung until its
timeout. The router instead subscribes once, at start-up, to the subjects of every request
id it mints, decodes what arrives (a message that does not decode is reported as bad and
dropped; it never reaches, let alone ends, a request) and sorts it into per-request queues.
"""

import asyncio

import nats

from shared import subjects
from shared.dead_letters import BadMessageSink
from shared.messages import RequestEvent, TokensEmitted, decoder

_tokens_decoder = decoder(TokensEmitted)
_event_decoder = decoder(RequestEvent)


class RequestMailbox:
    """Per-request queues of ``("tokens", TokensEmitted)`` and ``("event", RequestEvent)``."""

    def __init__(self, nc: nats.NATS, origin: str, bad_messages: BadMessageSink):
        self._nc = nc
        self.origin = origin
        self._bad_messages = bad_messages
        self._queues: dict[str, asyncio.Queue] = {}

    async def start(self):
        """Subscribe and make sure the local server has registered the interest."""
        for kind, subject, message_decoder in (
            ("tokens", subjects.tokens_of_origin(self.origin), _tokens_decoder),
            ("event", subjects.request_events_of_origin(self.origin), _event_decoder),
        ):
            await self._nc.subscribe(subject, cb=self._deliver(kind, subject, message_decoder))
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

    def _deliver(self, kind: str, subscribed: str, message_decoder):
        async def callback(msg):
            queue = self._queues.get(subjects.request_of(msg.subject))
            if queue is None:
                return
            message = self._bad_messages.decode(message_decoder, msg, subscribed)
            if message is not None:
                queue.put_nowait((kind, message))

        return callback
