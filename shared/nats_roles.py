"""Who may publish and subscribe what on NATS: one identity per service kind.

Each role gets exactly the subjects its code uses (built from ``shared.subjects``, so the
two cannot drift): only routers publish ``StartPrefill`` and ``CancelRequest``, only relays
send handoffs, only decoders write token streams, and so on. Replies go back through
``allow_responses`` (a responder may answer only the requests it was sent), and each role's
inboxes live under its own prefix, so no role can read another's replies.
"""

from dataclasses import dataclass

from shared import subjects
from shared.dead_letters import STREAM_NAME as DEAD_LETTER_STREAM
from shared.kv_event_stream import STREAM_NAME as KV_EVENT_STREAM

ROLES = ("router", "prefill", "relay_decode", "main_decode", "cache_index")
ANY = "*"


@dataclass(frozen=True)
class RolePermissions:
    """Subjects one role may publish to and subscribe to (NATS wildcards allowed)."""

    publish: tuple[str, ...]
    subscribe: tuple[str, ...]


def inbox_prefix(role: str) -> str:
    """Where a role's request/reply inboxes live (``_INBOX.<role>``)."""
    return f"_INBOX.{role}"


def _stream_admin(stream: str, api: str = "$JS.API") -> list[str]:
    """Create, update and look up one stream (what ``ensure_stream`` sends), on this site's
    JetStream API or, with ``api="$JS.<domain>.API"``, another domain's."""
    return [f"{api}.STREAM.{verb}.{stream}" for verb in ("CREATE", "UPDATE", "INFO")] + [f"{api}.INFO"]


def _instance_verb(service: str, verb: str) -> str:
    return subjects.instance_work(ANY, service, ANY, verb)


ENGINES = ("prefill", "relay_decode", "main_decode")
DECODERS = ("relay_decode", "main_decode")


def _role_subjects(role: str) -> tuple[list[str], list[str]]:
    """(publish, subscribe) beyond what every role has."""
    if role == "router":
        return ([_instance_verb("prefill", subjects.START_PREFILL), subjects.CANCEL,
                 subjects.shared_work(ANY, "cache_index", subjects.OVERLAP),
                 *(_instance_verb(d, subjects.RESEND) for d in DECODERS),
                 f"$JS.{ANY}.API.INFO"],  # probing each site's JetStream domain
                [subjects.tokens_of_origin(ANY), subjects.request_events_of_origin(ANY)])
    if role == "cache_index":
        # It follows every site's KV event stream (creating it if no engine has yet). The
        # local domain's API is checked under its plain name, the others under $JS.<domain>.
        follow = [call for api in ("$JS.API", f"$JS.{ANY}.API")
                  for call in (*_stream_admin(KV_EVENT_STREAM, api), f"{api}.STREAM.NAMES", f"{api}.CONSUMER.>")]
        return ([*(_instance_verb(e, subjects.DUMP) for e in ENGINES), *follow, "$JS.FC.>", "$JS.ACK.>"],
                [subjects.shared_work(ANY, "cache_index", subjects.OVERLAP)])
    publish = [subjects.REQUEST_EVENTS_ALL]
    subscribe = [_instance_verb(role, subjects.DUMP)]
    if role in ("prefill", "main_decode"):  # their caches are routing targets
        publish += [subjects.kv_events(ANY, ANY), *_stream_admin(KV_EVENT_STREAM)]
    if role == "prefill":
        subscribe += [_instance_verb("prefill", subjects.START_PREFILL),
                      subjects.shared_work(ANY, "prefill", subjects.START_PREFILL)]
    if role in DECODERS:
        publish.append(subjects.tokens_of_origin(ANY))
        subscribe.append(_instance_verb(role, subjects.RESEND))
    if role == "relay_decode":
        publish.append(_instance_verb("main_decode", subjects.HANDOFF))
        subscribe.append(subjects.REQUEST_EVENTS_ALL)
    if role == "main_decode":
        subscribe.append(_instance_verb("main_decode", subjects.HANDOFF))
    return publish, subscribe


def permissions(role: str) -> RolePermissions:
    """The subjects ``role`` may use; ValueError for an unknown role."""
    if role not in ROLES:
        raise ValueError(f"unknown role {role!r}; roles are {', '.join(ROLES)}")
    publish, subscribe = _role_subjects(role)
    every_role_publishes = [subjects.load(ANY, ANY), subjects.dead_letters(ANY, role),
                            *_stream_admin(DEAD_LETTER_STREAM)]
    every_role_subscribes = [subjects.CANCEL, subjects.LOAD_ALL, inbox_prefix(role) + ".>"]
    return RolePermissions(tuple(dict.fromkeys(publish + every_role_publishes)),
                           tuple(dict.fromkeys(subscribe + every_role_subscribes)))
