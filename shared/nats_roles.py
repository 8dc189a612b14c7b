"""Who may publish and subscribe what on NATS: one identity per instance.

Each instance gets exactly the subjects its role's code uses (built from ``shared.subjects``,
so the two cannot drift), and every subject whose sender matters ends in the instance's own
id: an instance may write tokens, request events, heartbeats, KV events, handoffs, cancels
and dead letters only as itself, so a receiver learns the sender from the subject
(``subjects.sender_of``). Only routers publish ``StartPrefill`` and cancels (each for the
requests it minted), only relays send handoffs, only decoders write token streams, and so on.
Replies go back through ``allow_responses`` (a responder may answer only the requests it was
sent), and each instance's inboxes live under its own prefix, so none can read another's
replies. ``permissions(role)`` without an instance is the role-wide form (``*`` for the
instance) that replicas sharing one credential use (docker compose and Kubernetes).
"""

from dataclasses import dataclass

from shared import subjects
from shared.kv_event_stream import STREAM_NAME as KV_EVENT_STREAM

ROLES = ("router", "prefill", "relay_decode", "main_decode", "cache_index")
ANY = "*"


@dataclass(frozen=True)
class RolePermissions:
    """Subjects one role may publish to and subscribe to (NATS wildcards allowed)."""

    publish: tuple[str, ...]
    subscribe: tuple[str, ...]


def inbox_prefix(role: str, instance_id: str) -> str:
    """Where an instance's request/reply inboxes live (``_INBOX.<role>.<instance>``)."""
    return f"_INBOX.{role}.{instance_id}"


def _stream_lookup(stream: str, api: str = "$JS.API") -> list[str]:
    """Look one stream up (``wait_for_stream``), on this site's JetStream API or, with
    ``api="$JS.<domain>.API"``, another domain's. No service may create, update or delete a
    stream: the deployment step does, as ``admin`` (``infra/streams.py``)."""
    return [f"{api}.STREAM.INFO.{stream}", f"{api}.INFO"]


def _stream_consumers(stream: str, api: str = "$JS.API") -> list[str]:
    """Create, look up and delete consumers of one stream (an ordered consumer does all three)."""
    return [f"{api}.CONSUMER.{ANY}.{stream}", f"{api}.CONSUMER.{ANY}.{stream}.>"]


ADMIN = "admin"
"""The deployment step's identity: JetStream administration, nothing else. No service holds it."""


def admin_permissions() -> RolePermissions:
    """What ``admin`` may do: its site's JetStream API (streams and consumers), its replies."""
    return RolePermissions(("$JS.API.>",), (inbox_prefix(ADMIN, ADMIN) + ".>",))


def _instance_verb(service: str, verb: str, instance_id: str = ANY) -> str:
    return subjects.instance_work(ANY, service, instance_id, verb)


ENGINES = ("prefill", "relay_decode", "main_decode")
DECODERS = ("relay_decode", "main_decode")


def _role_subjects(role: str, me: str) -> tuple[list[str], list[str]]:
    """(publish, subscribe) beyond what every role has; ``me``: the instance id (or ``*``)."""
    if role == "router":
        return ([_instance_verb("prefill", subjects.START_PREFILL), subjects.cancel(me),
                 subjects.shared_work(ANY, "cache_index", subjects.OVERLAP),
                 *(_instance_verb(d, subjects.RESEND) for d in DECODERS),
                 f"$JS.{ANY}.API.INFO"],  # probing each site's JetStream domain
                [subjects.tokens_of_origin(me), subjects.request_events_of_origin(me)])
    if role == "cache_index":
        # It follows every site's KV event stream with ordered consumers. The local domain's API
        # is checked under its plain name, the others under $JS.<domain>.
        follow = [call for api in ("$JS.API", f"$JS.{ANY}.API")
                  for call in (*_stream_lookup(KV_EVENT_STREAM, api), f"{api}.STREAM.NAMES",
                               *_stream_consumers(KV_EVENT_STREAM, api))]
        return ([*(_instance_verb(e, subjects.DUMP) for e in ENGINES), *follow, "$JS.FC.>", "$JS.ACK.>"],
                [subjects.shared_work(ANY, "cache_index", subjects.OVERLAP)])
    publish = [subjects.request_events_by(me)]
    subscribe = [_instance_verb(role, subjects.DUMP, me)]
    if role in ("prefill", "main_decode"):  # their caches are routing targets
        publish += [subjects.kv_events(ANY, me), *_stream_lookup(KV_EVENT_STREAM)]
    if role == "prefill":
        subscribe += [_instance_verb("prefill", subjects.START_PREFILL, me),
                      subjects.shared_work(ANY, "prefill", subjects.START_PREFILL)]
    if role in DECODERS:
        publish.append(subjects.tokens_by(me))
        subscribe.append(_instance_verb(role, subjects.RESEND, me))
    if role == "relay_decode":
        publish.append(subjects.handoff(ANY, ANY, me))
        subscribe.append(subjects.REQUEST_EVENTS_ALL)
    if role == "main_decode":
        subscribe.append(subjects.handoff(ANY, me, ANY))
    return publish, subscribe


def permissions(role: str, instance_id: str = ANY) -> RolePermissions:
    """The subjects instance ``instance_id`` of ``role`` may use (``*``: any instance of the
    role, for replicas that share one credential); ValueError for an unknown role."""
    if role not in ROLES:
        raise ValueError(f"unknown role {role!r}; roles are {', '.join(ROLES)}")
    if instance_id != ANY:
        subjects.check_token(instance_id, "instance id")
    publish, subscribe = _role_subjects(role, instance_id)
    every_role_publishes = [subjects.load(ANY, role, instance_id), subjects.dead_letters(ANY, role, instance_id)]
    every_role_subscribes = [subjects.CANCEL_ALL, subjects.LOAD_ALL, inbox_prefix(role, instance_id) + ".>"]
    return RolePermissions(tuple(dict.fromkeys(publish + every_role_publishes)),
                           tuple(dict.fromkeys(subscribe + every_role_subscribes)))
