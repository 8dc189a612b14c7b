"""Every NATS subject the system uses, in one place.

Shapes (DESIGN §4b): ``pdd.<site>.<service>.<verb>`` for work shared by a queue group,
``pdd.<site>.<service>.<instance>.<verb>`` for a chosen instance, ``pdd.tokens.<request>``
for a request's token stream, ``pdd.req.<request>`` for its lifecycle events,
``pdd.evt.<site>.kv.<instance>`` and ``pdd.evt.<site>.load.<instance>`` for KV and load
events. Request and instance ids must be single subject tokens.
"""

import re

PREFIX = "pdd"
CANCEL = f"{PREFIX}.cancel"
"""Broadcast: every service drops the named request (both sites, through the leafnode)."""
LOAD_ALL = f"{PREFIX}.evt.*.load.*"
KV_EVENTS_ALL = f"{PREFIX}.evt.*.kv.*"

_TOKEN = re.compile(r"^[A-Za-z0-9_-]{1,128}$")


def check_token(value: str, what: str) -> str:
    """Return ``value`` if it is a valid single subject token, else raise ValueError."""
    if not _TOKEN.match(value):
        raise ValueError(f"{what} {value!r} must be 1-128 of [A-Za-z0-9_-]")
    return value


def shared_work(site: str, service: str, verb: str) -> str:
    """Work any instance of ``service`` at ``site`` may take (queue group)."""
    return f"{PREFIX}.{site}.{service}.{verb}"


def instance_work(site: str, service: str, instance_id: str, verb: str) -> str:
    """Work addressed to one instance."""
    return f"{PREFIX}.{site}.{service}.{instance_id}.{verb}"


def tokens(request_id: str) -> str:
    """The request's token stream (``TokensEmitted``)."""
    return f"{PREFIX}.tokens.{request_id}"


def request_events(request_id: str) -> str:
    """The request's lifecycle events (``KvReady``, ``PrefillCompleted``, ``RequestFailed``…)."""
    return f"{PREFIX}.req.{request_id}"


def kv_events(site: str, instance_id: str) -> str:
    """Stored/evicted block events of one instance."""
    return f"{PREFIX}.evt.{site}.kv.{instance_id}"


def load(site: str, instance_id: str) -> str:
    """Heartbeat and load of one instance (``LoadReported``)."""
    return f"{PREFIX}.evt.{site}.load.{instance_id}"


# Verbs.
START_PREFILL = "start_prefill"
HANDOFF = "handoff"
OVERLAP = "overlap"
DUMP = "dump"
