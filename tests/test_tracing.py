"""One trace per request, across every service and both KV transfers."""

from tests.helpers import until
from tests.test_pipeline_e2e import SLOW_WAN, chat_body, post

EXPECTED_SPANS = {"router.route", "router.cache_index.query", "prefill.compute",
                  "kv.transfer.local", "kv.transfer.wan", "relay.decode", "handoff",
                  "main.recompute", "main.decode"}


async def test_one_trace_spans_the_whole_relay_pipeline(make_stack, spans):
    stack = await make_stack(profile=SLOW_WAN, router_settings={"pipeline_policy": "P-RLD-MD"},
                             relay_settings={"catch_up_threshold_tokens": 10_000})
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
