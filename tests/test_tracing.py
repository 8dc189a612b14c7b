"""One trace per request, across every service and both KV transfers."""

from tests.helpers import SLOW_WAN, chat_body, post, until

EXPECTED_SPANS = {
    "router.route",
    "router.cache_index.query",
    "prefill.compute",
    "kv.transfer.local",
    "kv.transfer.wan",
    "relay.decode",
    "handoff",
    "main.recompute",
    "main.decode",
}


async def test_one_trace_spans_the_whole_relay_pipeline(make_stack, spans):
    stack = await make_stack(
        profile=SLOW_WAN,
        router_settings={"pipeline_policy": "P-RLD-MD"},
        relay_settings={"catch_up_threshold_tokens": 10_000},
    )
    status, body = await post(stack, "/chat/completions", chat_body("Tell me about owls. " * 20, 150))
    assert status == 200 and body["pdd"]["handoff_mode"] == "one-shot"
    request_id = body["id"]

    def request_spans():
        return [s for s in spans.get_finished_spans() if s.attributes.get("request_id") == request_id]

    await until(lambda: EXPECTED_SPANS <= {s.name for s in request_spans()}, 10, "all spans")
    found = request_spans()
    assert len({s.context.trace_id for s in found}) == 1, "spans of one request in several traces"
    root = [s for s in found if s.parent is None]
    assert [s.name for s in root] == ["router.route"]
    handoff = next(s for s in found if s.name == "handoff")
    assert handoff.attributes["mode"] == "one-shot" and handoff.attributes["tokens"] >= 1
    wan = next(s for s in found if s.name == "kv.transfer.wan")
    assert wan.attributes["kv_bytes"] == body["pdd"]["wan_kv_bytes"]


async def test_a_request_continues_the_clients_traceparent(make_stack, spans):
    import aiohttp

    stack = await make_stack(router_settings={"pipeline_policy": "P-MD"})
    trace_id, parent_id = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    async with aiohttp.ClientSession() as session:
        async with session.post(
            stack.base_url + "/chat/completions",
            json=chat_body("Tell me about owls.", 8),
            headers={"traceparent": f"00-{trace_id}-{parent_id}-01"},
        ) as response:
            body = await response.json()
    assert response.status == 200, body

    def request_spans():
        return [s for s in spans.get_finished_spans() if s.attributes.get("request_id") == body["id"]]

    await until(lambda: {"router.route", "main.decode"} <= {s.name for s in request_spans()}, 10, "spans")
    assert {f"{s.context.trace_id:032x}" for s in request_spans()} == {trace_id}
    route = next(s for s in request_spans() if s.name == "router.route")
    assert f"{route.parent.span_id:016x}" == parent_id and route.parent.is_remote
    attributes = route.attributes
    assert attributes["gen_ai.operation.name"] == "chat" and attributes["gen_ai.request.model"] == "tiny"
    assert attributes["gen_ai.request.max_tokens"] == 8 and attributes["gen_ai.usage.output_tokens"] == 8
    assert attributes["gen_ai.usage.input_tokens"] == body["usage"]["prompt_tokens"]
    assert tuple(attributes["gen_ai.response.finish_reasons"]) == ("length",)


def test_the_standard_otel_variables_choose_the_exporter():
    from shared.tracing import _otlp_exporter

    assert _otlp_exporter("", {}) is None
    exporter = _otlp_exporter("", {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"})
    assert exporter is not None and exporter._endpoint == "http://collector:4318/v1/traces"
    assert _otlp_exporter("http://jaeger:4318", {})._endpoint == "http://jaeger:4318/v1/traces"
    assert _otlp_exporter("", {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318", "OTEL_TRACES_EXPORTER": "none"}) is None


def test_a_process_exporting_nowhere_records_only_sampled_client_traces_and_still_passes_context_on():
    from opentelemetry.sdk.resources import Resource

    from shared.tracing import context_from, current_traceparent, tracer_provider

    tracer = tracer_provider(Resource.create({}), None).get_tracer("test")
    with tracer.start_as_current_span("router.route") as span:
        assert not span.is_recording()  # nothing would receive it
        traceparent = current_traceparent()
    assert traceparent is not None and int(traceparent.rsplit("-", 1)[1], 16) & 1 == 0  # goes on, unsampled
    client = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    with tracer.start_as_current_span("router.route", context=context_from(client)) as span:
        assert span.is_recording()  # the client asked for this trace
        assert span.get_span_context().trace_id == 0x0AF7651916CD43DD8448EB211C80319C
