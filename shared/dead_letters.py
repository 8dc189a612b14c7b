"""Bad messages are harmless: counted, logged, dead-lettered, never fatal.

A message on any subject that does not decode as that subject's type (garbage, a message of
another version, a forged field of the wrong type) is counted in
``pdd_bad_messages_total{service,subject}`` (the subject as subscribed, so the label stays
bounded), logged with its real subject, and copied to the site's dead-letter stream
(JetStream ``PDD_DEAD_LETTERS``, bounded by count and bytes, oldest dropped) for someone to
look at. The actor drops it and goes on; a request it seemed to belong to is not touched.
"""

import asyncio

import msgspec
import nats
import structlog
from nats.js.api import DiscardPolicy, StorageType, StreamConfig
from prometheus_client import Counter

from shared import subjects
from shared.messages import LoadReported, claimed_sender
from shared.metrics import REFUSED_MESSAGES

log = structlog.get_logger(__name__)
STREAM_NAME = "PDD_DEAD_LETTERS"
MAX_MESSAGES = 10_000
MAX_BYTES = 64 << 20
BAD_MESSAGES = Counter(
    "pdd_bad_messages_total", "Messages that did not decode (dropped, dead-lettered)", ["service", "subject"]
)


def stream_config(site: str) -> StreamConfig:
    """The site's dead-letter stream."""
    return StreamConfig(
        name=STREAM_NAME,
        subjects=[subjects.dead_letters_of_site(site)],
        storage=StorageType.FILE,
        max_msgs=MAX_MESSAGES,
        max_bytes=MAX_BYTES,
        discard=DiscardPolicy.OLD,
    )


def sender_problem(message: msgspec.Struct, subject: str) -> str | None:
    """Why ``message`` cannot have been sent by the instance ``subject`` proves, or None.

    The servers let an instance publish only on subjects that end in its own id; a body that
    names another sender (a forged ``instance_id``, ``publisher_id``, relay, router or
    service) is therefore a lie, as is a request event or token message whose body names
    another request than its subject.
    """
    sender = subjects.sender_of(subject)
    if sender is None:
        return None
    claimed = claimed_sender(message)
    if claimed is not None and claimed != sender:
        return f"names {claimed!r} as its sender on {sender!r}'s subject"
    if isinstance(message, LoadReported):
        if message.service != subjects.service_of_load(subject):
            return f"claims service {message.service!r} on a {subjects.service_of_load(subject)!r} subject"
        if message.instance.site != subjects.site_of_load(subject):  # each site admits only its own
            return f"claims site {message.instance.site!r} on a {subjects.site_of_load(subject)!r} subject"
    named, subject_request = getattr(message, "request_id", None), subjects.request_named_by(subject)
    if named is not None and subject_request is not None and named != subject_request:
        return f"names request {named!r} on request {subject_request!r}'s subject"
    return None


class BadMessageSink:
    """Where one service reports the messages it could not decode."""

    def __init__(self, nc: nats.NATS, site: str, service: str, instance_id: str):
        self._nc, self._service = nc, service
        self._subject = subjects.dead_letters(site, service, instance_id)

    def decode(self, decoder: msgspec.msgpack.Decoder, msg, subscribed: str):
        """``msg`` decoded, or None when it is bad (then reported) or names a sender other than
        the one its subject proves (then refused and counted)."""
        try:
            message = decoder.decode(msg.data)
        except msgspec.DecodeError as exc:
            self.report(msg, subscribed, exc)
            return None
        problem = sender_problem(message, msg.subject)
        if problem is not None:
            REFUSED_MESSAGES.labels(self._service, "sender_mismatch").inc()
            log.warning(
                "message_refused",
                service=self._service,
                subject=msg.subject,
                message=type(message).__name__,
                reason=problem,
            )
            return None
        return message

    def report(self, msg, subscribed: str, error: Exception):
        """Count, log and dead-letter one bad message."""
        BAD_MESSAGES.labels(self._service, subscribed).inc()
        log.warning("bad_message", service=self._service, subject=msg.subject, bytes=len(msg.data), error=str(error))
        asyncio.ensure_future(self._dead_letter(msg, str(error)))

    async def _dead_letter(self, msg, error: str):
        headers = {"Pdd-Subject": msg.subject, "Pdd-Error": error[:200], "Pdd-Service": self._service}
        try:
            await self._nc.publish(self._subject, msg.data, headers=headers)
        except nats.errors.Error:
            pass  # counted and logged already; the copy is best effort
