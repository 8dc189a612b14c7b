"""Every NATS subject the system uses, in one place.

Shapes (DESIGN §4b): ``pdd.<site>.<service>.<verb>`` for work shared by a queue group,
``pdd.<site>.<service>.<instance>.<verb>`` for a chosen instance,
``pdd.tokens.<origin>.<request>.<sender>`` for a request's token stream,
``pdd.steps.<origin>.<sender>`` for a decoder's per-step tokens of all of one router's requests,
``pdd.req.<origin>.<request>.<sender>`` for its lifecycle events (``<origin>`` is the router
that minted the request id), ``pdd.evt.<site>.kv.<instance>`` and
``pdd.evt.<site>.load.<service>.<instance>`` for KV and load events, ``pdd.cancel.<router>``
for cancels. Request and instance ids must be single subject tokens.

Every subject a message's sender matters on ends in that sender (``sender_of``): the NATS
servers let each instance publish only on subjects ending in its own id (``nats_roles``), so
the subject proves who sent a message, and a receiver refuses a message whose body names
another sender (``messages.claimed_sender``).
"""

import re

PREFIX = "pdd"
CANCEL_ALL = f"{PREFIX}.cancel.*"
"""Every router's cancels: every service drops the named request (both sites, through the leafnode)."""
LOAD_ALL = f"{PREFIX}.evt.*.load.*.*"
KV_EVENTS_ALL = f"{PREFIX}.evt.*.kv.*"

_TOKEN = re.compile(r"^[A-Za-z0-9_-]{1,128}$")


def check_token(value: str, what: str) -> str:
    """Return ``value`` if it is a valid single subject token, else raise ValueError."""
    if not _TOKEN.match(value):
        raise ValueError(f"{what} {value!r} must be 1-128 of [A-Za-z0-9_-]")
    return value


FIXED_WORDS = frozenset({"cancel", "dlq", "evt", "req", "steps", "tokens"})
"""The words after the prefix that are not a site: a site so named would make its work subjects
look like request, token or event subjects (``sender_of``)."""


def shared_work(site: str, service: str, verb: str) -> str:
    """Work any instance of ``service`` at ``site`` may take (queue group)."""
    return f"{PREFIX}.{site}.{service}.{verb}"


def instance_work(site: str, service: str, instance_id: str, verb: str) -> str:
    """Work addressed to one instance."""
    return f"{PREFIX}.{site}.{service}.{instance_id}.{verb}"


def new_request_id(origin: str, nonce: str) -> str:
    """A request id minted by the router instance ``origin`` (``<origin>-<nonce>``).

    The id names its router so that tokens and events can travel on subjects the router
    subscribed to once at start-up: a subscription made per request would race the other
    site's first publish, because interest crosses the leafnode asynchronously and NATS
    drops messages nobody is known to want.
    """
    check_token(origin, "origin")
    if not nonce.isalnum():
        raise ValueError(f"nonce {nonce!r} must be alphanumeric")
    return check_token(f"{origin}-{nonce}", "request id")


def attempt_request_id(request_id: str, attempt: int) -> str:
    """The id attempt ``attempt`` of a request runs under on every instance (attempt 0: the id itself).

    A recovered request runs again under a fresh id, so that nothing its failed attempt left
    behind (a late token, a parked sequence, a cancel) can mix with the new one; the id keeps
    its router's name, so it still reaches that router's mailbox.
    """
    return request_id if attempt == 0 else check_token(f"{request_id}r{attempt}", "request id")


def origin_of(request_id: str) -> str:
    """The router instance that minted ``request_id`` (the part before its last ``-``)."""
    return request_id.rsplit("-", 1)[0]


def cancel(router_id: str) -> str:
    """Where router ``router_id`` cancels the requests it minted (``CancelRequest``)."""
    return f"{PREFIX}.cancel.{router_id}"


def tokens(request_id: str, sender: str) -> str:
    """The request's token stream (``TokensEmitted``) as written by instance ``sender``."""
    return f"{PREFIX}.tokens.{origin_of(request_id)}.{request_id}.{sender}"


def request_events(request_id: str, sender: str) -> str:
    """The request's lifecycle events (``KvReady``, ``RequestFailed``…) as sent by ``sender``."""
    return f"{PREFIX}.req.{origin_of(request_id)}.{request_id}.{sender}"


def tokens_of_origin(origin: str) -> str:
    """Every token stream of the requests ``origin`` minted (a router's one subscription)."""
    return f"{PREFIX}.tokens.{origin}.*.*"


def request_events_of_origin(origin: str) -> str:
    """Every lifecycle event of the requests ``origin`` minted."""
    return f"{PREFIX}.req.{origin}.*.*"


def tokens_by(sender: str) -> str:
    """Every token stream instance ``sender`` writes (what its permissions allow)."""
    return f"{PREFIX}.tokens.*.*.{sender}"


def step_tokens(origin: str, sender: str) -> str:
    """Decoder ``sender``'s per-step tokens of the requests router ``origin`` minted (``StepTokens``)."""
    return f"{PREFIX}.steps.{origin}.{sender}"


def step_tokens_of_origin(origin: str) -> str:
    """Every decoder's per-step tokens for router ``origin`` (a router's one subscription)."""
    return f"{PREFIX}.steps.{origin}.*"


def step_tokens_by(sender: str) -> str:
    """Every per-step token message instance ``sender`` writes (what its permissions allow)."""
    return f"{PREFIX}.steps.*.{sender}"


def request_events_by(sender: str) -> str:
    """Every request event instance ``sender`` sends (what its permissions allow)."""
    return f"{PREFIX}.req.*.*.{sender}"


def request_of(subject: str) -> str:
    """The request id of a ``tokens`` or ``request_events`` subject."""
    return subject.split(".")[3]


REQUEST_EVENTS_ALL = f"{PREFIX}.req.*.*.*"
"""Every request's lifecycle events (the relay follows the main decoder's ``KvReady``)."""


def sender_of(subject: str) -> str | None:
    """The instance a subject says published on it (its last token), for the subjects whose
    publishers the servers pin (tokens, step tokens, request events, load, KV events, handoffs,
    cancels);
    None for any other subject."""
    parts = subject.split(".")
    if len(parts) < 3 or parts[0] != PREFIX:
        return None
    shapes = {("tokens", 5), ("steps", 4), ("req", 5), ("cancel", 3)}
    if (
        (parts[1], len(parts)) in shapes
        or (len(parts) == 5 and parts[1] == "evt" and parts[3] == "kv")
        or (len(parts) == 6 and parts[1] == "evt" and parts[3] == "load")
        or (len(parts) == 6 and parts[4] == HANDOFF)
    ):
        return parts[-1]
    return None


def service_of_load(subject: str) -> str:
    """The service a ``load`` subject names (pinned by the servers like its sender)."""
    return subject.split(".")[4]


def site_of_load(subject: str) -> str:
    """The site a ``load`` subject names."""
    return subject.split(".")[2]


def request_named_by(subject: str) -> str | None:
    """The request id of a ``tokens`` or ``request_events`` subject; None for any other."""
    parts = subject.split(".")
    return parts[3] if len(parts) == 5 and parts[0] == PREFIX and parts[1] in ("req", "tokens") else None


def kv_events(site: str, instance_id: str) -> str:
    """Stored/evicted block events of one instance."""
    return f"{PREFIX}.evt.{site}.kv.{instance_id}"


def site_of_kv_events(subject: str) -> str:
    """The site of a ``kv_events`` subject.

    Raises:
        ValueError: ``subject`` is not a KV events subject.
    """
    parts = subject.split(".")
    if len(parts) != 5 or (parts[0], parts[1], parts[3]) != (PREFIX, "evt", "kv") or not all(parts):
        raise ValueError(f"{subject!r} is not a KV events subject")
    return parts[2]


def dead_letters(site: str, service: str, instance_id: str) -> str:
    """Where instance ``instance_id`` of ``service`` at ``site`` copies messages it could not
    decode (JetStream, bounded)."""
    return f"{PREFIX}.dlq.{site}.{service}.{instance_id}"


def dead_letters_of_site(site: str) -> str:
    """Every dead letter of a site (its dead-letter stream's subjects)."""
    return f"{PREFIX}.dlq.{site}.*.*"


def load(site: str, service: str, instance_id: str) -> str:
    """Heartbeat and load of one instance of ``service`` (``LoadReported``)."""
    return f"{PREFIX}.evt.{site}.load.{service}.{instance_id}"


def handoff(site: str, main_decode_id: str, relay_id: str) -> str:
    """Handoffs from relay ``relay_id`` to main decoder ``main_decode_id`` (``HandoffTokens``)."""
    return f"{instance_work(site, 'main_decode', main_decode_id, HANDOFF)}.{relay_id}"


# Verbs.
START_PREFILL = "start_prefill"
HANDOFF = "handoff"
RESEND = "resend"
OVERLAP = "overlap"
DUMP = "dump"
