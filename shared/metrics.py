"""Prometheus metrics (prefix ``pdd_``), defined once per process and shared by its services.

Request-level families carry ``model_name`` (the served model id), as vLLM's and Dynamo's do;
``docs/metrics.md`` maps each family to their names for the same thing.
"""

from prometheus_client import CONTENT_TYPE_LATEST, Counter, Gauge, Histogram, generate_latest

from shared.loop_histogram import LoopHistogram

KV_BYTES = Counter("pdd_kv_bytes_total", "KV bytes moved on the bulk channel", ["path", "direction"])
_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64, 128)
_STEP_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1, 2.5, 5)
KV_TRANSFER_SECONDS = Histogram(
    "pdd_kv_transfer_seconds",
    "Time to ship one request's KV on a path",
    ["model_name", "path"],
    buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60),
)
KV_TRANSFER_BYTES = Histogram(
    "pdd_kv_transfer_bytes",
    "KV bytes one request shipped on a path",
    ["model_name", "path"],
    buckets=tuple(2**i for i in range(16, 34, 2)),
)
REQUESTS = Counter(
    "pdd_requests_total",
    "Requests finished by the router",
    ["model_name", "pipeline", "finished_on", "finish_reason", "outcome"],
)
E2E_SECONDS = Histogram(
    "pdd_e2e_request_latency_seconds",
    "Arrival at the router to the last token",
    ["model_name", "pipeline"],
    buckets=_LATENCY_BUCKETS,
)
ITL_SECONDS = LoopHistogram(  # observed once per token delivered: no lock per observation
    "pdd_inter_token_latency_seconds",
    "Time between successive token deliveries to the client (one observation per delivery)",
    ["model_name", "pipeline"],
    buckets=_STEP_BUCKETS,
)
PROMPT_TOKENS = Counter("pdd_prompt_tokens_total", "Prompt tokens of finished requests", ["model_name"])
GENERATION_TOKENS = Counter(
    "pdd_generation_tokens_total",
    "Output tokens delivered, by the producer that sent each first (RLD: the relay's eager tokens)",
    ["model_name", "producer"],
)
REQUESTS_RUNNING = Gauge("pdd_requests_running", "Requests the router is serving", ["model_name"])
REQUESTS_WAITING = Gauge("pdd_requests_waiting", "Requests waiting at the router for a slot", ["model_name"])
WAN_ESTIMATE_BANDWIDTH = Gauge("pdd_wan_estimate_bandwidth_bps", "Router's smoothed WAN bandwidth estimate")
WAN_ESTIMATE_RTT = Gauge("pdd_wan_estimate_rtt_seconds", "Router's smoothed WAN round-trip estimate")
SITE_STATE = Gauge("pdd_site_state", "1 for the state each remote site is in", ["site", "state"])
ODD_TRAFFIC = Counter("pdd_odd_traffic_total", "Odd-traffic filter transitions", ["state"])
PREFILL_SECONDS = Histogram(
    "pdd_prefill_seconds",
    "Prefill compute time of one request (to its first token)",
    ["model_name"],
    buckets=_LATENCY_BUCKETS,
)
ENGINE_STEP_SECONDS = Histogram(
    "pdd_engine_step_seconds",
    "One engine step (a packed forward pass: decode, prefill chunks and extends)",
    ["model_name", "service"],
    buckets=_STEP_BUCKETS,
)
HANDOFF_SECONDS = Histogram(
    "pdd_handoff_seconds",
    "Relay → main decode handoff, first chunk sent to the relay released",
    ["model_name", "mode"],
    buckets=_STEP_BUCKETS,
)
KV_CACHE_USAGE = Gauge(
    "pdd_kv_cache_usage_ratio", "Fraction of the KV pool held by live sequences", ["service", "instance"]
)
KV_IMPORTS_WAITING = Gauge(
    "pdd_kv_imports_waiting", "KV flows waiting for blocks or a sequence slot", ["service", "instance"]
)
PIPELINE_CHOICES = Counter("pdd_pipeline_choices_total", "Pipeline decisions", ["pipeline"])
HANDOFFS = Counter("pdd_handoffs_total", "Completed handoffs relay → main decode", ["mode"])
RECOVERIES = Counter("pdd_recoveries_total", "Requests resumed elsewhere by token replay", ["reason"])
HANDOFF_CHUNKS = Counter("pdd_handoff_chunks_total", "Handoff chunks absorbed by main decode", ["mode"])
PREFIX_HIT_BLOCKS = Counter(
    "pdd_prefix_cache_hit_blocks_total",
    "Prompt blocks found in an instance's prefix cache (DRC on main decode)",
    ["service"],
)
PREFIX_LOOKUP_BLOCKS = Counter(
    "pdd_prefix_cache_lookup_blocks_total", "Prompt blocks looked up in an instance's prefix cache", ["service"]
)
CACHE_INDEX_EVENTS = Counter("pdd_cache_index_events_total", "KV events seen by the cache-index", ["outcome"])
EAGER_TOKENS = Counter("pdd_eager_tokens_total", "Tokens emitted by relay decode")
ACTIVE_SEQUENCES = Gauge("pdd_active_sequences", "Sequences held", ["service", "instance"])
KV_BLOCKS_USED = Gauge(
    "pdd_kv_blocks_used", "KV blocks held by live sequences (cached idle blocks not counted)", ["service", "instance"]
)
KV_BLOCKS_CACHE_FILL = Gauge(
    "pdd_kv_blocks_cache_fill",
    "KV blocks pinned by imports of requests that ended elsewhere; they "
    "land in the prefix cache (no request holds them) and are released when the transfer ends",
    ["service", "instance"],
)
REFUSED_MESSAGES = Counter(
    "pdd_refused_messages_total",
    "Well-formed messages refused because their sender or content does not fit "
    "the request (tokens from an instance it was not placed on, a handoff from another relay…)",
    ["service", "reason"],
)
PUBLISH_FAILURES = Counter(
    "pdd_publish_failures_total", "NATS publishes that failed (dropped, counted)", ["service", "kind"]
)
LEASES_EXPIRED = Counter(
    "pdd_request_leases_expired_total",
    "Requests freed because their router died or no longer ran them",
    ["service", "kind"],
)
QUEUE_SECONDS = Histogram(
    "pdd_queue_seconds",
    "Time a request waited at the router for a slot",
    ["model_name"],
    buckets=(0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32),
)
SLOW_CLIENTS = Counter(
    "pdd_slow_clients_dropped_total",
    "Streaming clients dropped because one event waited longer than --sse-write-timeout-s to be accepted",
)
REJECTED = Counter(
    "pdd_requests_rejected_total", "Requests answered 429 (no slot, wait line full or waited too long)", ["reason"]
)
TTFT_SECONDS = Histogram(
    "pdd_ttft_seconds",
    "Time to first token at the router",
    ["model_name", "pipeline"],
    buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64),
)


def exposition() -> tuple[bytes, str]:
    """The Prometheus text exposition of this process and its content type."""
    return generate_latest(), CONTENT_TYPE_LATEST
