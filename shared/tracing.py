"""OpenTelemetry: one tracer provider per process, W3C trace context in NATS headers and bulk frames."""

from collections.abc import Mapping

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor, SpanExporter
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

_propagator = TraceContextTextMapPropagator()
TRACEPARENT = "traceparent"


def configure_tracing(service_name: str, otlp_endpoint: str = "",
                      exporter: SpanExporter | None = None, batch: bool = True) -> bool:
    """Install a tracer provider for this process, once.

    Args:
        service_name: ``service.name`` resource attribute.
        otlp_endpoint: OTLP/HTTP collector base URL (``http://jaeger:4318``); empty for none.
        exporter: An explicit exporter (tests pass an in-memory one).
        batch: Export in batches (False: each span as it ends, for tests).

    Returns:
        False if a provider was already installed (the first one stays).
    """
    if isinstance(trace.get_tracer_provider(), TracerProvider):
        return False
    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    if exporter is None and otlp_endpoint:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        exporter = OTLPSpanExporter(endpoint=otlp_endpoint.rstrip("/") + "/v1/traces")
    if exporter is not None:
        provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=200)
                                    if batch else SimpleSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    return True


def tracer(name: str) -> trace.Tracer:
    """The tracer for a component."""
    return trace.get_tracer(name)


def current_traceparent() -> str | None:
    """W3C ``traceparent`` of the active span, or None outside any span."""
    carrier: dict[str, str] = {}
    _propagator.inject(carrier)
    return carrier.get(TRACEPARENT)


def trace_headers() -> dict[str, str] | None:
    """NATS headers carrying the active span's context (None when there is none)."""
    traceparent = current_traceparent()
    return {TRACEPARENT: traceparent} if traceparent else None


def context_from(traceparent: str | None = None,
                 headers: Mapping[str, str] | None = None) -> otel_context.Context:
    """The remote parent context from a ``traceparent`` value or NATS headers."""
    if traceparent is None and headers:
        traceparent = headers.get(TRACEPARENT)
    if not traceparent:
        return otel_context.Context()
    return _propagator.extract({TRACEPARENT: traceparent})
