"""Prometheus metrics (prefix ``pdd_``), defined once per process and shared by its services."""

from prometheus_client import CONTENT_TYPE_LATEST, Counter, Gauge, Histogram, generate_latest

KV_BYTES = Counter("pdd_kv_bytes_total", "KV bytes moved on the bulk channel", ["path", "direction"])
KV_TRANSFER_SECONDS = Histogram(
    "pdd_kv_transfer_seconds", "Time to ship one request's KV on a path", ["path"],
    buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60))
REQUESTS = Counter("pdd_requests_total", "Requests finished by the router",
                   ["pipeline", "finished_on", "outcome"])
PIPELINE_CHOICES = Counter("pdd_pipeline_choices_total", "Pipeline decisions", ["pipeline"])
HANDOFFS = Counter("pdd_handoffs_total", "Completed handoffs relay → main decode", ["mode"])
HANDOFF_CHUNKS = Counter("pdd_handoff_chunks_total", "Handoff chunks absorbed by main decode", ["mode"])
PREFIX_HIT_BLOCKS = Counter("pdd_prefix_cache_hit_blocks_total",
                            "Prompt blocks found in an instance's prefix cache (DRC on main decode)", ["service"])
PREFIX_LOOKUP_BLOCKS = Counter("pdd_prefix_cache_lookup_blocks_total",
                               "Prompt blocks looked up in an instance's prefix cache", ["service"])
CACHE_INDEX_EVENTS = Counter("pdd_cache_index_events_total", "KV events seen by the cache-index",
                             ["outcome"])
EAGER_TOKENS = Counter("pdd_eager_tokens_total", "Tokens emitted by relay decode")
ACTIVE_SEQUENCES = Gauge("pdd_active_sequences", "Sequences held", ["service", "instance"])
KV_BLOCKS_USED = Gauge("pdd_kv_blocks_used", "KV blocks held by live sequences (cached idle blocks not counted)",
                       ["service", "instance"])
KV_BLOCKS_CACHE_FILL = Gauge(
    "pdd_kv_blocks_cache_fill", "KV blocks pinned by imports of requests that ended elsewhere; they "
    "land in the prefix cache (no request holds them) and are released when the transfer ends",
    ["service", "instance"])
REFUSED_MESSAGES = Counter(
    "pdd_refused_messages_total", "Well-formed messages refused because their sender or content does not fit "
    "the request (tokens from an instance it was not placed on, a handoff from another relay…)",
    ["service", "reason"])
PUBLISH_FAILURES = Counter("pdd_publish_failures_total", "NATS publishes that failed (dropped, counted)",
                           ["service", "kind"])
LEASES_EXPIRED = Counter("pdd_request_leases_expired_total",
                         "Requests freed because their router died or no longer ran them", ["service", "kind"])
QUEUE_SECONDS = Histogram("pdd_queue_seconds", "Time a request waited at the router for a slot",
                          buckets=(0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32))
REJECTED = Counter("pdd_requests_rejected_total", "Requests answered 429 (no slot, wait line full or "
                   "waited too long)", ["reason"])
TTFT_SECONDS = Histogram("pdd_ttft_seconds", "Time to first token at the router", ["pipeline"],
                         buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64))


def serve_metrics(host: str, port: int) -> int:
    """Expose this process's metrics on ``http://host:port/metrics``; return the port."""
    from prometheus_client import start_http_server

    server, _ = start_http_server(port, addr=host)
    return server.server_port


def exposition() -> tuple[bytes, str]:
    """The Prometheus text exposition of this process and its content type."""
    return generate_latest(), CONTENT_TYPE_LATEST
