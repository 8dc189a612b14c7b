"""The schema: every message exchanged over NATS and the bulk channel.

All messages are frozen msgspec Structs encoded as msgpack, tagged with a ``type`` field
so that each subject is decoded by one typed decoder over a tagged union. Events carry
``publisher_id`` and a per-publisher ``seq`` where a consumer must detect gaps. Sampling
parameters travel as the engine's own ``SamplingParams`` struct.
"""

from typing import Literal

import msgspec

from shared import subjects
from shared.engine.logprobs import TokenLogprobs
from shared.engine.sampling import SamplingParams

Pipeline = Literal["P-MD", "P-RLD-MD", "P-RLD"]
"""``P-RLD`` (the relay finishes the request at site A) only while no main decoder is reachable."""
Producer = Literal["P", "RLD", "MD"]
FlowRole = Literal["main_decode", "relay_decode"]


class _Message(msgspec.Struct, frozen=True, kw_only=True, tag_field="type", tag=str.lower):
    pass


class InstanceRef(msgspec.Struct, frozen=True, kw_only=True):
    """Where an instance is reached.

    Attributes:
        instance_id: Unique instance name (a subject token).
        site: Site the instance runs at.
        bulk_endpoint: ``host:port`` of its bulk KV receiver: as reachable from the sender's
            site, or, when ``bulk_link`` is set, as reachable from its own site.
        bulk_link: ``host:port`` of the WAN link a sender at the other site dials instead;
            the connection's first message (a ``LinkRoute``) names ``bulk_endpoint``, and the
            link forwards it there. Empty: dial ``bulk_endpoint`` directly.
        incarnation: Random id of the process behind the name, new at every start. A process
            restarted under the same name is another instance: what the old one held is gone.
            It is also the epoch of the instance's KV events.
    """

    instance_id: str
    site: str
    bulk_endpoint: str = ""
    bulk_link: str = ""
    incarnation: str = ""


# ----- commands ------------------------------------------------------------------------


class StartPrefill(_Message, kw_only=True):
    """Router → prefill: compute a prompt and ship its KV to the chosen decoders.

    Attributes:
        request_id: The request.
        attempt: 0 for the first dispatch, n for the n-th recovery (``request_id`` is then
            the attempt's own id, see ``subjects.attempt_request_id``).
        token_ids: The whole prompt.
        sampling: Sampling and stopping parameters.
        seed: Effective sampling seed, identical on every instance and every attempt.
        pipeline: ``P-MD``, ``P-RLD-MD``, or ``P-RLD`` while no main decoder is reachable.
        main_decode: Main decoder (None only for ``P-RLD``).
        relay_decode: Relay decoder for ``P-RLD-MD`` and ``P-RLD``; None for ``P-MD``.
        deadline_unix_s: Wall-clock time after which the request is abandoned.
        resume_token_ids: Output tokens the client already has (a recovery): the decoder that
            continues the stream receives them instead of the prefill's first token, computes
            their KV in one extend pass and samples from index ``len(resume_token_ids)`` on.
        wan_after_prompt: Ship the WAN path only once the whole prompt is computed, not chunk
            by chunk (odd traffic: the relay likely finishes first, and the router then
            cancels the WAN copy before most of it has crossed).
    """

    request_id: str
    attempt: int = 0
    token_ids: list[int]
    sampling: SamplingParams
    seed: int
    pipeline: Pipeline
    main_decode: InstanceRef | None = None
    relay_decode: InstanceRef | None = None
    deadline_unix_s: float
    resume_token_ids: list[int] = []
    wan_after_prompt: bool = False


class HandoffTokens(_Message, kw_only=True):
    """Relay → main decode: take over from ``start_index`` given these output token IDs.

    Attributes:
        request_id: The request.
        start_index: Output index of ``token_ids[0]`` (0 for the first handoff).
        token_ids: Output tokens the relay has emitted, in order.
        final: True when the relay stops after this handoff and the main decoder owns the
            request from ``start_index + len(token_ids)`` on; False for a catch-up chunk the
            main decoder only absorbs (computes KV, samples nothing).
        mode: ``one-shot`` or ``catch-up``.
        chunk: 1-based number of this chunk for the request.
        relay_instance_id: The relay sending it; main decode takes a handoff only from the
            relay the request's flow named.
    """

    request_id: str
    start_index: int
    token_ids: list[int]
    final: bool = True
    mode: Literal["one-shot", "catch-up"] = "one-shot"
    chunk: int = 1
    relay_instance_id: str = ""


class CancelRequest(_Message, kw_only=True):
    """Anyone → everyone: drop a request and free its KV.

    Attributes:
        request_id: The request.
        kind: ``finished`` (the request ended elsewhere: finish KV imports so caches stay
            aligned, then free), ``stop`` (client went away: drop everything now) or
            ``kill`` (failure elsewhere: drop everything now).
        reason: Human-readable cause, logged by each service.
    """

    request_id: str
    kind: Literal["finished", "stop", "kill"] = "stop"
    reason: str = ""


class ResendTokens(_Message, kw_only=True):
    """Router → the producer of a request's stream: publish its output again from an index.

    Core NATS loses what is published while a server restarts; the router, which sees the
    gap (or a stream gone quiet), asks for the tokens again. Producers answer from the live
    sequence, or from a short record of requests they finished recently.

    Attributes:
        request_id: The request (attempt) id.
        from_index: First output index the router lacks.
    """

    request_id: str
    from_index: int


class OverlapQuery(_Message, kw_only=True):
    """Router → cache-index: how many leading blocks does each instance hold?

    Attributes:
        block_hashes: Chained hashes of the prompt's full blocks.
        hash_scheme: Block-hash scheme version of ``block_hashes``; a cache-index hashing
            otherwise answers no hits rather than wrong ones.
    """

    block_hashes: list[int]
    hash_scheme: int


class OverlapReply(_Message, kw_only=True):
    """Cache-index → router.

    Attributes:
        hit_blocks: Leading blocks held, per instance id.
    """

    hit_blocks: dict[str, int]


# ----- events --------------------------------------------------------------------------


class TokensEmitted(_Message, kw_only=True):
    """A producer → the request's token stream.

    Attributes:
        request_id: The request.
        start_index: Output index of ``token_ids[0]``.
        token_ids: New output tokens, in order.
        producer: ``RLD`` or ``MD``.
        instance_id: The producing instance.
        finish_reason: ``stop`` or ``length`` on the message that ends the request, else None.
        logprobs: Per token, its log-probabilities when the request asked for them (None for
            a token this producer holds without them); None when not asked for.
    """

    request_id: str
    start_index: int
    token_ids: list[int]
    producer: Producer
    instance_id: str
    finish_reason: str | None = None
    logprobs: list[TokenLogprobs | None] | None = None


class StepTokens(_Message, kw_only=True):
    """A decoder → one router: every plain token one engine step gave that router's requests.

    Struct of arrays: entry ``i`` is token ``token_ids[i]`` at output index ``indices[i]`` of
    request ``request_ids[i]``. Only tokens that end no request and carry no log-probabilities
    travel here; a request's last token, tokens with log-probabilities and resends travel as
    ``TokensEmitted``. The sender is the instance its subject names (``subjects.step_tokens``,
    pinned by the servers); the body names none, and a receiver takes each entry only for a
    request placed on that sender.

    Attributes:
        producer: ``RLD`` or ``MD``.
        request_ids: One per entry.
        indices: Output index of each entry's token.
        token_ids: Each entry's token.
    """

    producer: Producer
    request_ids: list[str]
    indices: list[int]
    token_ids: list[int]

    def __post_init__(self):
        if not len(self.request_ids) == len(self.indices) == len(self.token_ids):
            raise ValueError("request_ids, indices and token_ids must be of one length")


class PrefillCompleted(_Message, kw_only=True):
    """Prefill → request events: prompt computed and KV shipped.

    Attributes:
        request_id: The request.
        instance_id: The prefill instance.
        first_token: Token it sampled (shipped with the KV, emitted by the decoder).
        prompt_tokens: Prompt length.
        cached_tokens: Prompt tokens the prefill's own prefix cache supplied.
        compute_s: Prefill forward time.
        bytes_per_path: KV bytes sent per path (``local``, ``wan``).
        wan_rtt_s: Handshake time of the WAN flow (FlowOpen → FlowAccepted): one round trip.
        computed_unix_s: Prefill's clock when the prompt was computed (its first token out).
    """

    request_id: str
    instance_id: str
    first_token: int
    prompt_tokens: int
    cached_tokens: int
    compute_s: float
    bytes_per_path: dict[str, int]
    wan_rtt_s: float = 0.0
    computed_unix_s: float = 0.0


class KvReady(_Message, kw_only=True):
    """Main decode → request events: it holds the request's whole prompt KV. Sent too when the
    relay already finished the request and the KV only filled main decode's cache (the router
    then takes the flow off its ledger of the link).

    Attributes:
        request_id: The request.
        instance_id: The main decode instance.
        site: Its site (to address its handoff subject).
        cached_tokens: Prompt tokens its decode-side cache already held.
        imported_tokens: Prompt tokens that came over the WAN.
        wan_kv_bytes: Bytes received on the WAN path for the request (frames included).
        transfer_s: From flow open to the last frame.
        throughput_bps: WAN throughput measured between its first and last frame, in bits/s
            (0 when the transfer was too small to tell).
        landed_unix_s: Main decode's clock when the flow's end arrived (the last KV byte).
    """

    request_id: str
    instance_id: str
    site: str
    cached_tokens: int
    imported_tokens: int
    wan_kv_bytes: int
    transfer_s: float
    throughput_bps: float = 0.0
    landed_unix_s: float = 0.0


class KvImportAborted(_Message, kw_only=True):
    """Main decode → request events: it dropped a request's KV import before completion.

    Attributes:
        request_id: The request.
        instance_id: The main decode instance.
        wan_kv_bytes: Bytes that had arrived on the WAN path (complete frames).
        reason: Why (e.g. odd traffic finished on the relay).
    """

    request_id: str
    instance_id: str
    wan_kv_bytes: int
    reason: str


class HandoffAccepted(_Message, kw_only=True):
    """Main decode → relay (reply), and → request events.

    Attributes:
        request_id: The request.
        instance_id: The main decode instance.
        next_index: Output index the main decoder holds KV up to (and produces next, after
            a final chunk).
        chunk: 1-based number of the chunk accepted.
        mode: ``one-shot`` or ``catch-up``.
        final: Whether the main decoder now owns the request.
    """

    request_id: str
    instance_id: str
    next_index: int
    chunk: int = 1
    mode: Literal["one-shot", "catch-up"] = "one-shot"
    final: bool = True


class RequestFailed(_Message, kw_only=True):
    """Any service → request events (or as a reply): the request cannot go on here.

    Attributes:
        request_id: The request.
        instance_id: Where it failed.
        code: Stable error code (``PddError.code`` or a service code).
        message: Human-readable cause.
        retryable: Whether trying again elsewhere may succeed.
    """

    request_id: str
    instance_id: str
    code: str
    message: str
    retryable: bool = False


class KvBlocksStored(_Message, kw_only=True):
    """An instance's prefix cache gained blocks.

    Attributes:
        publisher_id: The instance.
        epoch: The publisher's incarnation (a restart starts a new epoch, seq from 1 again).
        seq: Per-publisher, per-epoch sequence number, from 1, no gaps.
        block_hashes: Chained hashes added (parents before children).
    """

    publisher_id: str
    epoch: str = ""
    seq: int
    block_hashes: list[int]


class KvBlocksEvicted(_Message, kw_only=True):
    """An instance's prefix cache dropped blocks.

    Attributes:
        publisher_id: The instance.
        epoch: The publisher's incarnation.
        seq: Per-publisher, per-epoch sequence number.
        block_hashes: Chained hashes removed.
    """

    publisher_id: str
    epoch: str = ""
    seq: int
    block_hashes: list[int]


class LoadReported(_Message, kw_only=True):
    """Heartbeat: an instance is alive, where to reach it, and how loaded it is.

    Attributes:
        instance: Identity and bulk endpoint.
        service: ``prefill``, ``relay_decode``, ``main_decode`` or ``cache_index``.
        active_sequences: Requests it holds now.
        max_sequences: Requests it accepts at most.
        used_blocks: KV blocks held by the requests it runs now (shared prefix blocks once).
        total_blocks: Size of its KV pool.
        free_blocks: KV blocks neither held by a request nor caching a prefix (0: not
            reported). Routers break placement ties towards the most, so routers that do not
            talk to each other still spread cold prompts, and a prompt evicts the least cache.
        pending_tokens: Prompt and extend tokens it has taken on and not computed yet (a
            prefill's queued work).
        live_request_ids: For a router: the (attempt) ids of every request it still runs.
            Its heartbeat renews their leases; engines free what a router no longer lists.
        sequences_by_router: For an engine: of the requests it holds, how many each router
            minted (router instance id → count). Routers share an engine's ``max_sequences``
            and each reads here what the others hold (``services/router/capacity_share.py``).
        prefill_first_chunk_tokens: For a prefill: the tokens of a prompt's first chunk (a long
            prompt's KV ships chunk by chunk while the rest computes; the first leaves after it).
        prefill_chunk_tokens: For a prefill: the most tokens of each later chunk (0: not said;
            taken as the first's).
        prefill_tokens_per_s: For a prefill: its recent rate of computing prompt tokens (0:
            not measured yet).
        unix_s: Sender's clock when sent.
    """

    instance: InstanceRef
    service: str
    active_sequences: int = 0
    max_sequences: int = 0
    used_blocks: int = 0
    total_blocks: int = 0
    free_blocks: int = 0
    pending_tokens: int = 0
    live_request_ids: list[str] = []
    sequences_by_router: dict[str, int] = {}
    prefill_first_chunk_tokens: int = 0
    prefill_chunk_tokens: int = 0
    prefill_tokens_per_s: float = 0.0
    unix_s: float


# ----- bulk channel control (framed next to KV frames, never through NATS) --------------


class FlowOpen(_Message, kw_only=True):
    """Sender → receiver, first message of a per-request KV flow.

    Attributes:
        request_id: The request.
        role: Whether the receiver acts as ``main_decode`` or ``relay_decode``.
        token_ids: The prompt (the receiver checks every frame's tokens against it).
        sampling: Sampling parameters the receiver decodes with.
        seed: Effective sampling seed.
        relay_instance_id: For a main decoder in ``P-RLD-MD``: the relay that will hand over.
        main_decode_instance_id: For a relay in ``P-RLD-MD``: the main decoder it hands over to
            (only that instance's ``KvReady`` starts the handoff).
        traceparent: W3C trace context of the sender's transfer span.
        sender_id: Sending instance.
        sender_site: Its site: the receiver counts the flow's bytes as the WAN's when it is
            another site than its own (empty: as its listener's path).
        receiver_id: The instance this flow is for; another one refuses it.
        receiver_incarnation: That instance's incarnation (as in its heartbeats): a FlowOpen
            recorded before a restart is refused by the restarted process, whose replay
            memory is new.
        unix_s: Sender's clock (authentication freshness).
        nonce: Random hex, unique per flow (replay protection); a ``FlowJoin`` names the flow by it.
        streams: Connections the flow's frames are striped over: this one and ``streams - 1``
            that each join with a ``FlowJoin`` (1: frames only on this connection).
        mac: Ed25519 signature over the fields above (``shared.bulk.auth``).
    """

    request_id: str
    role: FlowRole
    token_ids: list[int]
    sampling: SamplingParams
    seed: int
    relay_instance_id: str | None = None
    main_decode_instance_id: str | None = None
    traceparent: str | None = None
    sender_id: str
    sender_site: str = ""
    receiver_id: str = ""
    receiver_incarnation: str = ""
    unix_s: float
    nonce: str
    streams: int = 1
    mac: str = ""


class FlowJoin(_Message, kw_only=True):
    """Sender → receiver, first message on each further connection of a striped flow, sent
    once the flow's ``FlowAccepted`` arrived. KV frames of the flow follow at once, then a
    ``StreamEnd``. The receiver answers with a ``FlowAccepted`` (or closes the connection), which
    the sender reads before its ``StreamEnd`` (so no TLS record is left unread when it closes).
    Signed like a ``FlowOpen``, so every connection authenticates on its own.

    Attributes:
        request_id: The request.
        flow_nonce: The ``nonce`` of the flow's ``FlowOpen``: the one flow this joins.
        stream: This connection's index among the flow's streams (1 .. ``streams - 1``).
        sender_id: Sending instance (the flow's).
        receiver_id: The instance the flow is for.
        receiver_incarnation: That instance's incarnation.
        unix_s: Sender's clock (freshness).
        nonce: Random hex, unique per join (replay protection).
        mac: Ed25519 signature over the fields above (``shared.bulk.auth``).
    """

    request_id: str
    flow_nonce: str
    stream: int
    sender_id: str
    receiver_id: str = ""
    receiver_incarnation: str = ""
    unix_s: float
    nonce: str
    mac: str = ""


class StreamEnd(_Message, kw_only=True):
    """Sender → receiver, on a joined connection: this stream carries no more of the flow's
    frames (the connection may then serve another flow).

    Attributes:
        request_id: The request.
    """

    request_id: str


class FlowAccepted(_Message, kw_only=True):
    """Receiver → sender: send KV from ``first_token_index`` on.

    Attributes:
        request_id: The request.
        first_token_index: Prompt tokens the receiver already holds (block aligned).
        queued_s: Time the receiver spent before answering (e.g. waiting for blocks another
            import is bringing), so the sender can tell the network round trip apart.
    """

    request_id: str
    first_token_index: int
    queued_s: float = 0.0


class FlowRejected(_Message, kw_only=True):
    """Receiver → sender: the flow is refused.

    Attributes:
        request_id: The request.
        code: Error code.
        message: Cause.
    """

    request_id: str
    code: str
    message: str


class FlowEnd(_Message, kw_only=True):
    """Sender → receiver: all frames are sent.

    Attributes:
        request_id: The request.
        output_token_ids: Output tokens to start from (the prefill's first token for a
            decoder that begins decoding; empty for a main decoder awaiting a handoff).
        output_logprobs: Their log-probabilities, aligned, when the request asked for them
            (empty otherwise, and for the tokens a recovered request resumes from).
    """

    request_id: str
    output_token_ids: list[int]
    output_logprobs: list[TokenLogprobs] = []


class FlowCancel(_Message, kw_only=True):
    """Sender → receiver: abandon the flow; discard what arrived.

    Attributes:
        request_id: The request.
        reason: Cause.
    """

    request_id: str
    reason: str = ""


class LinkRoute(_Message, kw_only=True):
    """Sender → WAN link, in clear before anything else on a connection to a routed link
    port: where to forward it. The TLS handshake and the FlowOpen follow, end to end.

    Attributes:
        target: ``host:port`` of the receiver, as reachable from the link's far side.
        unix_s: Sender's clock (freshness).
        nonce: Random hex, unique per connection (replay protection).
        mac: HMAC-SHA256 over the fields above with the link's route key, which is derived
            from the deployment's bulk secret (``shared.bulk.link_route.route_key``): the
            link can check a route without holding the secret that signs flows.
    """

    target: str
    unix_s: float
    nonce: str
    mac: str = ""


BulkControl = LinkRoute | FlowOpen | FlowJoin | FlowAccepted | FlowRejected | FlowEnd | FlowCancel | StreamEnd
RequestEvent = PrefillCompleted | KvReady | KvImportAborted | HandoffAccepted | RequestFailed
KvEvent = KvBlocksStored | KvBlocksEvicted
HandoffReply = HandoffAccepted | RequestFailed
PrefillReply = PrefillCompleted | RequestFailed

_encoder = msgspec.msgpack.Encoder()


def encode(message: msgspec.Struct) -> bytes:
    """msgpack bytes of any schema message."""
    return _encoder.encode(message)


def decoder(kind) -> msgspec.msgpack.Decoder:
    """A typed decoder for one message type or tagged union (make one per subject)."""
    return msgspec.msgpack.Decoder(kind)


def claimed_sender(message: msgspec.Struct) -> str | None:
    """The instance a message names as its sender (None: it names none).

    A receiver compares it with the subject's sender (``subjects.sender_of``), which the
    servers' permissions pin, and refuses the message when they differ.
    """
    if isinstance(message, LoadReported):
        return message.instance.instance_id
    if isinstance(message, (KvBlocksStored, KvBlocksEvicted)):
        return message.publisher_id
    if isinstance(message, HandoffTokens):
        return message.relay_instance_id
    if isinstance(message, CancelRequest):
        return subjects.origin_of(message.request_id)  # the router that minted the request
    return getattr(message, "instance_id", None)
