"""OpenTelemetry: one tracer provider per process, W3C trace context in NATS headers and bulk frames.

The standard ``OTEL_*`` variables are honoured: ``OTEL_EXPORTER_OTLP_ENDPOINT`` /
``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` (and the exporter's other ``OTEL_EXPORTER_OTLP_*``
settings), ``OTEL_SERVICE_NAME``, ``OTEL_RESOURCE_ATTRIBUTES``, ``OTEL_TRACES_EXPORTER=none``
and ``OTEL_SDK_DISABLED``. ``PDD_OTLP_ENDPOINT`` (``--otlp-endpoint``) is an alias of the
endpoint and wins when both are set.

A process that exports nowhere records no span of its own (``ParentBased(ALWAYS_OFF)``): what it
recorded would go nowhere, and a recording span costs ~60 µs against ~6 µs. Its spans still carry
trace context on (a valid traceparent in NATS headers and bulk frames), and a client's sampled
trace context is still followed.
"""

import os
from collections.abc import Mapping

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor, SpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ParentBased
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

_propagator = TraceContextTextMapPropagator()
TRACEPARENT = "traceparent"


def configure_tracing(
    service_name: str,
    otlp_endpoint: str = "",
    exporter: SpanExporter | None = None,
    batch: bool = True,
    instance_id: str = "",
    environ: Mapping[str, str] = os.environ,
) -> bool:
    """Install a tracer provider for this process, once.

    Args:
        service_name: ``service.name`` resource attribute, unless ``OTEL_SERVICE_NAME`` is set.
        otlp_endpoint: OTLP/HTTP collector base URL (``http://jaeger:4318``); empty: the
            standard variables decide (none set: no export).
        exporter: An explicit exporter (tests pass an in-memory one).
        batch: Export in batches (False: each span as it ends, for tests).
        instance_id: ``service.instance.id`` (the instance's name in this deployment).
        environ: Where the ``OTEL_*`` variables are read.

    Returns:
        False if a provider was already installed (the first one stays).
    """
    if isinstance(trace.get_tracer_provider(), TracerProvider):
        return False
    attributes = {"service.instance.id": instance_id} if instance_id else {}
    if not environ.get("OTEL_SERVICE_NAME"):
        attributes["service.name"] = service_name
    if exporter is None:
        exporter = _otlp_exporter(otlp_endpoint, environ)
    trace.set_tracer_provider(tracer_provider(Resource.create(attributes), exporter, batch))
    return True


def tracer_provider(resource: Resource, exporter: SpanExporter | None, batch: bool = True) -> TracerProvider:
    """A provider exporting to ``exporter``; without one, it records only spans whose parent
    (a client's trace context) is sampled."""
    if exporter is None:
        return TracerProvider(resource=resource, sampler=ParentBased(ALWAYS_OFF))
    provider = TracerProvider(resource=resource)
    provider.add_span_processor(
        BatchSpanProcessor(exporter, schedule_delay_millis=200) if batch else SimpleSpanProcessor(exporter)
    )
    return provider


def _otlp_exporter(otlp_endpoint: str, environ: Mapping[str, str]) -> SpanExporter | None:
    """The OTLP/HTTP exporter the settings ask for, or None."""
    if environ.get("OTEL_SDK_DISABLED", "").lower() == "true" or environ.get("OTEL_TRACES_EXPORTER") == "none":
        return None
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    # The spec: a signal-specific endpoint is used as given; the general one gets /v1/traces.
    base = otlp_endpoint or environ.get("OTEL_EXPORTER_OTLP_ENDPOINT", "")
    endpoint = environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "") if not otlp_endpoint else ""
    if not endpoint and base:
        endpoint = base.rstrip("/") + "/v1/traces"
    # The exporter reads the other OTEL_EXPORTER_OTLP_* settings (headers, timeout, TLS) itself.
    return OTLPSpanExporter(endpoint=endpoint) if endpoint else None


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


def context_from(traceparent: str | None = None, headers: Mapping[str, str] | None = None) -> otel_context.Context:
    """The remote parent context from a ``traceparent`` value or NATS headers."""
    if traceparent is None and headers:
        traceparent = headers.get(TRACEPARENT)
    if not traceparent:
        return otel_context.Context()
    return _propagator.extract({TRACEPARENT: traceparent})
