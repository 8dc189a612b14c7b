"""The router's view of one attempt's stream: who produces, who is needed, when it is quiet."""

from services.router.placement import Placement
from services.router.stream_watch import StreamWatch
from shared.messages import InstanceRef

PREFILL = InstanceRef(instance_id="prefill-0", site="site-a")
RELAY = InstanceRef(instance_id="relay-decode-0", site="site-a")
MAIN = InstanceRef(instance_id="main-decode-0", site="site-b")


def watch(pipeline: str, now: float = 0.0) -> StreamWatch:
    placement = Placement(
        pipeline=pipeline,
        prefill=PREFILL,
        main_decode=MAIN,
        relay_decode=RELAY if pipeline == "P-RLD-MD" else None,
        md_cached_blocks=0,
        md_load_blocks=0,
        num_prompt_blocks=4,
        missing_kv_bytes=0,
        predicted_wan_s=0.0,
    )
    return StreamWatch(placement, now, first_token_timeout_s=30.0, token_timeout_s=5.0, resend_after_s=1.0)


def ids(refs) -> list[str]:
    return [ref.instance_id for ref in refs]


def test_p_md_needs_prefill_until_main_decode_holds_the_kv():
    w = watch("P-MD")
    assert ids(w.needed()) == ["prefill-0", "main-decode-0"] and w.failure_matters("prefill-0")
    w.on_kv_ready()
    assert ids(w.needed()) == ["main-decode-0"] and not w.failure_matters("prefill-0")


def test_with_a_relay_the_relay_produces_until_the_final_handoff():
    w = watch("P-RLD-MD")
    assert w.producer() == RELAY and ids(w.needed()) == ["prefill-0", "relay-decode-0"]
    w.on_tokens_released(now=0.5)  # the relay's first token: prefill's work is done
    assert ids(w.needed()) == ["relay-decode-0"]
    assert not w.failure_matters("main-decode-0")  # main decode's import may break: the relay goes on
    w.on_handoff_accepted(final=False)
    assert w.producer() == RELAY
    w.on_handoff_accepted(final=True)
    w.on_handoff_accepted(final=False)  # a late, reordered catch-up reply changes nothing
    assert w.producer() == MAIN and ids(w.needed()) == ["main-decode-0"]


def test_only_placed_decoders_may_write_the_stream():
    w = watch("P-RLD-MD")
    assert w.may_write("relay-decode-0") and w.may_write("main-decode-0")
    assert not w.may_write("prefill-0") and not w.may_write("main-decode-9")


def test_the_first_token_gets_the_long_wait_later_tokens_the_short_one():
    w = watch("P-MD", now=100.0)
    assert w.timeout_exceeded(129.0) is None
    assert w.timeout_exceeded(131.0) == 30.0
    w.on_tokens_released(now=131.0)
    assert w.timeout_exceeded(135.0) is None
    assert w.timeout_exceeded(136.5) == 5.0


def test_a_quiet_stream_asks_for_a_resend_once_per_interval():
    w = watch("P-MD", now=0.0)
    assert not w.resend_due(0.5)
    assert w.resend_due(1.2)
    assert not w.resend_due(1.5)  # just asked
    assert w.resend_due(2.3)
    w.on_tokens_released(now=2.5)
    assert not w.resend_due(3.0)  # progress resets the wait
