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
        return (
            [
                _instance_verb("prefill", subjects.START_PREFILL),
                subjects.cancel(me),
                subjects.shared_work(ANY, "cache_index", subjects.OVERLAP),
                *(_instance_verb(d, subjects.RESEND) for d in DECODERS),
                f"$JS.{ANY}.API.INFO",
            ],  # probing each site's JetStream domain
            [subjects.tokens_of_origin(me), subjects.step_tokens_of_origin(me), subjects.request_events_of_origin(me)],
        )
    if role == "cache_index":
        # It follows every site's KV event stream with ordered consumers. The local domain's API
        # is checked under its plain name, the others under $JS.<domain>.
        follow = [
            call
            for api in ("$JS.API", f"$JS.{ANY}.API")
            for call in (
                *_stream_lookup(KV_EVENT_STREAM, api),
                f"{api}.STREAM.NAMES",
                *_stream_consumers(KV_EVENT_STREAM, api),
            )
        ]
        return (
            [*(_instance_verb(e, subjects.DUMP) for e in ENGINES), *follow, "$JS.FC.>", "$JS.ACK.>"],
            [subjects.shared_work(ANY, "cache_index", subjects.OVERLAP)],
        )
    publish = [subjects.request_events_by(me)]
    subscribe = [_instance_verb(role, subjects.DUMP, me)]
    if role in ("prefill", "main_decode"):  # their caches are routing targets
        publish += [subjects.kv_events(ANY, me), *_stream_lookup(KV_EVENT_STREAM)]
    if role == "prefill":
        subscribe += [
            _instance_verb("prefill", subjects.START_PREFILL, me),
            subjects.shared_work(ANY, "prefill", subjects.START_PREFILL),
        ]
    if role in DECODERS:
        publish += [subjects.tokens_by(me), subjects.step_tokens_by(me)]
        subscribe.append(_instance_verb(role, subjects.RESEND, me))
    if role == "relay_decode":
        publish.append(subjects.handoff(ANY, ANY, me))
        subscribe.append(subjects.REQUEST_EVENTS_ALL)
    if role == "main_decode":
        subscribe.append(subjects.handoff(ANY, me, ANY))
    return publish, subscribe


def leafnode_permissions(spoke_site: str, main_decode_ids: tuple[str, ...] = (ANY,)) -> RolePermissions:
    """What the leafnode may carry, as the hub's permissions for its user (the spoke's view):
    ``publish`` is what site B may send into site A, ``subscribe`` what site A sends to site B.

    B to A: its main decoders' tokens (per request and per step), request events and heartbeats, and replies to site A's
    requests (handoffs, resends, dumps, JetStream lookups of B's domain). A to B: cancels,
    heartbeats, work addressed to those main decoders, the KV event stream's lookups and
    consumers in B's domain. Nothing else crosses: no prompt (``StartPrefill``), no other
    request's tokens, no JetStream administration, no dead letters. ``main_decode_ids``: the
    site's instances (``*``: any, for replicas sharing one credential).
    """
    site_api = f"$JS.{subjects.check_token(spoke_site, 'site')}.API"
    b_to_a = [
        _leaf_subject(subject, md)
        for md in main_decode_ids
        for subject in (
            subjects.tokens_by(md),
            subjects.step_tokens_by(md),
            subjects.request_events_by(md),
            subjects.load(spoke_site, "main_decode", md),
        )
    ]
    b_to_a += [inbox_prefix(role, ANY) + ".>" for role in ("router", "relay_decode", "cache_index")]
    a_to_b = [
        subjects.CANCEL_ALL,
        subjects.LOAD_ALL,
        *(subjects.instance_work(ANY, "main_decode", md, ">") for md in main_decode_ids),
        *_stream_lookup(KV_EVENT_STREAM, site_api),
        f"{site_api}.STREAM.NAMES",
        f"{site_api}.CONSUMER.>",  # a leafnode takes interest in whole API branches
        "$JS.FC.>",
        "$JS.ACK.>",
        inbox_prefix("main_decode", ANY) + ".>",
        "$LDS.>",
    ]
    return RolePermissions(tuple(dict.fromkeys(b_to_a)), tuple(dict.fromkeys(a_to_b)))


def _leaf_subject(subject: str, instance_id: str) -> str:
    """``subject`` as a leafnode permission: one ending in any instance (``*``) ends in ``>``.
    The hub offers a subscription's interest to the leafnode only where the permissions match
    it; measured on nats-server 2.15, an interest ending in ``*`` (``pdd.evt.*.load.*.*``) was
    never offered against a permission ending in ``*``, and no heartbeat crossed. Our subjects
    end at the instance id, so ``>`` there allows no other subject of ours."""
    if instance_id == ANY and subject.endswith(".*"):
        return subject[:-1] + ">"
    return subject


def spoke_denials(spoke_site: str) -> RolePermissions:
    """The spoke's own limits on the leafnode (``deny_exports``, ``deny_imports``), so that
    site B holds the line even against a compromised site A server: nothing administers B's
    JetStream from A, no dead letter or KV event leaves B, no work of site A's services crosses."""
    site_api = f"$JS.{subjects.check_token(spoke_site, 'site')}.API"
    admin_verbs = (
        "STREAM.CREATE",
        "STREAM.UPDATE",
        "STREAM.DELETE",
        "STREAM.PURGE",
        "STREAM.MSG",
        "STREAM.SNAPSHOT",
        "STREAM.RESTORE",
        "STREAM.PEER",
        "STREAM.LEADER",
        "META",
        "ACCOUNT",
        "SERVER",
    )
    admin = ["$JS.API.>", *(f"{site_api}.{verb}.>" for verb in admin_verbs)]
    exports = [
        "pdd.dlq.>",
        subjects.KV_EVENTS_ALL,
        "$JS.API.>",
        f"{subjects.PREFIX}.*.prefill.>",
        f"{subjects.PREFIX}.*.router.>",
        f"{subjects.PREFIX}.*.cache_index.>",
        f"{subjects.PREFIX}.cancel.>",
    ]
    # A denied import also refuses the hub's interest in it: nothing site B must send goes here.
    imports = [*admin, "pdd.dlq.>", f"{subjects.PREFIX}.*.prefill.>", f"{subjects.PREFIX}.*.router.>"]
    return RolePermissions(tuple(exports), tuple(imports))


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
    return RolePermissions(
        tuple(dict.fromkeys(publish + every_role_publishes)), tuple(dict.fromkeys(subscribe + every_role_subscribes))
    )
