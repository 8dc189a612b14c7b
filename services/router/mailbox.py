"""The router's mailbox: standing subscriptions for every request's tokens and events.

Subscribing per request raced the main decoder: interest in a new subject reaches the other
site over the leafnode asynchronously, and a main decoder holding the prompt's blocks could
publish the first token before that, so NATS dropped it and the request hung until its
timeout. The router instead subscribes once, at start-up, to the subjects of every request
id it mints, decodes what arrives (a message that does not decode is reported as bad and
dropped; it never reaches, let alone ends, a request) and sorts it into per-request inboxes.

A decoder's ``StepTokens`` (one message per step for all of this router's requests on it) is
split here into one ``("step", index, token, producer, sender)`` item per entry, ``sender``
being the instance its subject proves; the request's flow takes an entry only if the request
is placed on that sender, as it does a ``TokensEmitted``.
"""

import asyncio
from collections.abc import Callable

import nats

from shared import subjects
from shared.dead_letters import BadMessageSink
from shared.messages import RequestEvent, StepTokens, TokensEmitted, decoder

_tokens_decoder = decoder(TokensEmitted)
_steps_decoder = decoder(StepTokens)
_event_decoder = decoder(RequestEvent)


DirectStep = Callable[[tuple], bool]
"""Takes a ``("step", …)`` item on the spot, from the mailbox's callback; False: not now (it
is then queued for the flow's task as usual)."""


class Inbox:
    """One request's arrived items, in arrival order: ``("tokens", TokensEmitted)``,
    ``("event", RequestEvent)``, ``("step", index, token, producer, sender)`` and whatever its
    flow puts itself.

    No timer per wait: the mailbox's tick wakes an inbox quiet since its last tick. While its
    flow waits with nothing queued, a step item goes to the flow's ``DirectStep`` at once (no
    task wake-up); an exception it raises is queued as ``("raise", exc)`` for the flow's task.
    """

    __slots__ = ("_direct", "_fresh", "_waiter", "items")

    def __init__(self):
        self.items: list[tuple] = []
        self._waiter: asyncio.Future | None = None
        self._direct: DirectStep | None = None
        self._fresh = False

    def put(self, item: tuple):
        """Hand a step item to the waiting flow directly if it takes it; else add the item and
        wake the flow if it waits."""
        self._fresh = True
        direct = self._direct
        if direct is not None and item[0] == "step" and not self.items:
            try:
                if direct(item):
                    return
            except Exception as exc:  # noqa: BLE001 - whatever it is, the flow's task raises it
                item = ("raise", exc)
        self.items.append(item)
        self._wake()

    def tick(self):
        """Wake a flow that waits and heard nothing since the last tick (it checks liveness)."""
        if not self._fresh:
            self._wake()
        self._fresh = False

    def _wake(self):
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)
            self._direct = None  # the task takes over until it waits again

    def empty(self) -> bool:
        return not self.items

    async def take(self, direct: DirectStep | None = None) -> list[tuple]:
        """Every item arrived, waiting for one if none has; [] when a tick came first.
        ``direct``: takes step items on the spot meanwhile."""
        if not self.items:
            self._waiter, self._direct = asyncio.get_running_loop().create_future(), direct
            try:
                await self._waiter
            finally:
                self._waiter = self._direct = None
        items, self.items = self.items, []
        return items


class RequestMailbox:
    """Per-request inboxes of everything the request's producers send its router."""

    def __init__(
        self,
        nc: nats.NATS,
        origin: str,
        bad_messages: BadMessageSink,
        on_late_event: Callable[[RequestEvent, str], None] | None = None,
    ):
        """``on_late_event(event, sender)``: an event for a request no longer collected (a main
        decoder's ``KvReady`` after the relay finished the request), ``sender`` being the
        instance its subject proves."""
        self._nc = nc
        self.origin = origin
        self._bad_messages = bad_messages
        self._on_late_event = on_late_event
        self._inboxes: dict[str, Inbox] = {}

    async def start(self):
        """Subscribe and make sure the local server has registered the interest."""
        for kind, subject, message_decoder in (
            ("tokens", subjects.tokens_of_origin(self.origin), _tokens_decoder),
            ("event", subjects.request_events_of_origin(self.origin), _event_decoder),
        ):
            await self._nc.subscribe(subject, cb=self._deliver(kind, subject, message_decoder))
        steps = subjects.step_tokens_of_origin(self.origin)
        await self._nc.subscribe(steps, cb=self._deliver_steps(steps))
        await self._nc.flush()

    async def tick_forever(self, interval_s: float):
        """Every ``interval_s``, wake the flows whose inbox stayed empty since the last tick."""
        while True:
            await asyncio.sleep(interval_s)
            for inbox in list(self._inboxes.values()):
                inbox.tick()

    def open(self, request_id: str) -> Inbox:
        """Start collecting ``request_id``'s messages; returns its inbox."""
        if subjects.origin_of(request_id) != self.origin:
            raise ValueError(f"request {request_id!r} was not minted by {self.origin!r}")
        inbox = self._inboxes[request_id] = Inbox()
        return inbox

    @property
    def open_request_ids(self) -> list[str]:
        """Requests being collected now (the router's heartbeat lists them: their leases)."""
        return list(self._inboxes)

    def close(self, request_id: str):
        """Stop collecting; later messages for the request are dropped."""
        self._inboxes.pop(request_id, None)

    def _deliver(self, kind: str, subscribed: str, message_decoder):
        async def callback(msg):
            inbox = self._inboxes.get(subjects.request_of(msg.subject))
            if inbox is None and (kind != "event" or self._on_late_event is None):
                return
            message = self._bad_messages.decode(message_decoder, msg, subscribed)
            if message is None:
                return
            if inbox is not None:
                inbox.put((kind, message))
            elif (sender := subjects.sender_of(msg.subject)) is not None:
                self._on_late_event(message, sender)

        return callback

    def _deliver_steps(self, subscribed: str):
        inboxes = self._inboxes

        async def callback(msg):
            steps = self._bad_messages.decode(_steps_decoder, msg, subscribed)
            if steps is None:
                return
            subject = msg.subject
            sender, producer = subject[subject.rindex(".") + 1 :], steps.producer
            for request_id, index, token in zip(steps.request_ids, steps.indices, steps.token_ids, strict=True):
                inbox = inboxes.get(request_id)
                if inbox is not None:
                    inbox.put(("step", index, token, producer, sender))

        return callback
