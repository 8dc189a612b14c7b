"""Prefill's shipping plan: receivers per pipeline, the tokens that end each flow, shared exports."""

import pytest

from services.prefill.shipping_plan import ExportRange, ShippingPlan
from shared.engine.logprobs import TokenLogprobs
from shared.engine.sampling import SamplingParams
from shared.errors import InvalidRequestState
from shared.messages import InstanceRef, StartPrefill

RELAY = InstanceRef(instance_id="relay-decode-0", site="site-a", bulk_endpoint="127.0.0.1:1")
MAIN = InstanceRef(instance_id="main-decode-0", site="site-b", bulk_endpoint="127.0.0.1:2")
FIRST_LOGPROBS = TokenLogprobs(logprob=-0.5)


def command(
    pipeline: str, *, main=MAIN, relay=RELAY, resume: list[int] | None = None, wan_after_prompt: bool = False
) -> StartPrefill:
    return StartPrefill(
        request_id="router-0-abc",
        token_ids=list(range(100)),
        sampling=SamplingParams(),
        seed=7,
        pipeline=pipeline,
        main_decode=main,
        relay_decode=relay,
        deadline_unix_s=0.0,
        resume_token_ids=resume or [],
        wan_after_prompt=wan_after_prompt,
    )


def routes(plan: ShippingPlan) -> list[tuple[str, str, str]]:
    return [(p.path, p.receiver.instance_id, p.role) for p in plan.paths]


def test_only_a_flow_to_another_site_takes_the_wan():
    """What the prefill's flows are sized for and counted as (``pdd_kv_bytes_total{path}``)."""
    main_at_a = InstanceRef(instance_id="main-decode-1", site="site-a", bulk_endpoint="127.0.0.1:3")
    assert [p.network("site-a") for p in ShippingPlan(command("P-RLD-MD")).paths] == ["wan", "local"]
    assert [p.network("site-a") for p in ShippingPlan(command("P-MD", main=main_at_a)).paths] == ["local"]


def test_each_pipeline_ships_to_its_receivers():
    assert routes(ShippingPlan(command("P-MD", relay=None))) == [("wan", "main-decode-0", "main_decode")]
    assert routes(ShippingPlan(command("P-RLD-MD"))) == [
        ("wan", "main-decode-0", "main_decode"),
        ("local", "relay-decode-0", "relay_decode"),
    ]
    assert routes(ShippingPlan(command("P-RLD", main=None))) == [("local", "relay-decode-0", "relay_decode")]


def test_a_pipeline_without_its_decoder_is_refused():
    with pytest.raises(InvalidRequestState, match="needs a main decoder"):
        ShippingPlan(command("P-MD", main=None, relay=None))
    with pytest.raises(InvalidRequestState, match="needs a relay decoder"):
        ShippingPlan(command("P-RLD-MD", relay=None))


def test_the_first_token_rides_with_the_kv_except_to_a_main_decoder_behind_a_relay():
    plan = ShippingPlan(command("P-RLD-MD"))
    assert plan.end_tokens("relay_decode", 42, FIRST_LOGPROBS) == ([42], [FIRST_LOGPROBS])
    assert plan.end_tokens("main_decode", 42, FIRST_LOGPROBS) == ([], [])
    assert ShippingPlan(command("P-MD", relay=None)).end_tokens("main_decode", 42, None) == ([42], [])


def test_a_recovered_request_goes_on_from_the_tokens_the_client_has():
    plan = ShippingPlan(command("P-MD", relay=None, resume=[5, 6, 7]))
    assert plan.end_tokens("main_decode", 5, FIRST_LOGPROBS) == ([5, 6, 7], [])


def test_receivers_at_the_same_block_share_one_export_and_a_full_cache_needs_none():
    plan = ShippingPlan(command("P-RLD-MD"))
    assert plan.next_export("wan", 32, 0, True, 16) == plan.next_export("wan", 32, 0, True, 16) == ExportRange(32, 100)
    assert plan.next_export("wan", 0, 0, True, 16) != plan.next_export("wan", 32, 0, True, 16)
    assert plan.next_export("wan", 100, 100, True, 16) is None


def test_a_prompt_in_chunks_ships_complete_blocks_as_they_are_computed_then_the_rest():
    plan, block_size = ShippingPlan(command("P-MD", relay=None)), 16  # a 100-token prompt
    assert plan.next_export("wan", 0, 40, False, block_size) == ExportRange(0, 32)  # the partial block waits
    assert plan.next_export("wan", 32, 40, False, block_size) is None
    assert plan.next_export("wan", 32, 96, False, block_size) == ExportRange(32, 96)
    assert plan.next_export("wan", 48, 20, False, block_size) is None  # its receiver's cache is ahead
    assert plan.next_export("wan", 96, 100, True, block_size) == ExportRange(96, 100)  # the last, partial block


def test_odd_traffics_wan_copy_waits_for_the_whole_prompt_while_the_relay_gets_chunks():
    plan = ShippingPlan(command("P-RLD-MD", wan_after_prompt=True))
    assert plan.next_export("local", 0, 40, False, 16) == ExportRange(0, 32)
    assert plan.next_export("wan", 0, 40, False, 16) is None
    assert plan.next_export("wan", 0, 100, True, 16) == ExportRange(0, 100)
