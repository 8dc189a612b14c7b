"""Request leases: engine-side state lives only while its router runs the request."""

from shared.lease import RequestLeases
from shared.messages import InstanceRef, LoadReported


def router_heartbeat(*request_ids: str, router: str = "router-0") -> LoadReported:
    return LoadReported(
        instance=InstanceRef(instance_id=router, site="site-a"),
        service="router",
        live_request_ids=list(request_ids),
        unix_s=0.0,
    )


def prefill_heartbeat() -> LoadReported:
    return LoadReported(instance=InstanceRef(instance_id="prefill-0", site="site-a"), service="prefill", unix_s=0.0)


def test_a_silent_router_loses_all_its_requests_after_the_lease():
    leases = RequestLeases(lease_s=8, grace_s=2.5, now=0.0, cut_off_lease_s=30)
    leases.observe(router_heartbeat("router-0-a", "router-0-b"), now=1.0)
    assert leases.expired(["router-0-a", "router-0-b"], now=1.0) == []  # held since then
    leases.observe(prefill_heartbeat(), now=8.5)  # its site speaks: the router itself is gone
    assert leases.expired(["router-0-a", "router-0-b"], now=8.9) == []
    expired = leases.expired(["router-0-a", "router-0-b", "router-1-c"], now=9.1)
    assert {(e.request_id, e.kind) for e in expired} == {("router-0-a", "kill"), ("router-0-b", "kill")}
    assert leases.expired(["router-0-a", "router-1-c"], now=10) == []  # reported once
    # A router never heard from: its site is unknown, so it gets the cut-off lease, counted from
    # when its request arrived (9.1).
    assert leases.expired(["router-1-c"], now=30.5) == []
    assert [(e.request_id, e.kind) for e in leases.expired(["router-1-c"], now=39.2)] == [("router-1-c", "kill")]


def test_a_request_arriving_after_its_routers_silence_gets_a_whole_lease():
    """Site B back from a NATS outage: main decode gets a new request before the router's next
    heartbeat reaches it. The request is the router's word; it must not be killed at once."""
    leases = RequestLeases(lease_s=3, grace_s=2.5, now=0.0, cut_off_lease_s=3)
    leases.observe(router_heartbeat("router-0-a"), now=1.0)
    assert leases.expired(["router-0-a"], now=1.0) == []  # held since then
    assert [e.request_id for e in leases.expired(["router-0-a"], now=12.0)] == ["router-0-a"]
    assert leases.expired(["router-0-new"], now=12.5) == []  # arrived 11.5 s after the last heartbeat
    assert leases.expired(["router-0-new"], now=15.0) == []
    leases.observe(router_heartbeat("router-0-new"), now=15.2)
    assert leases.expired(["router-0-new"], now=18.0) == []
    # Still silent a whole lease after it arrived: the router is gone after all.
    assert [e.request_id for e in leases.expired(["router-0-new"], now=18.3)] == ["router-0-new"]


def test_a_request_its_live_router_no_longer_lists_is_freed_as_finished():
    leases = RequestLeases(lease_s=8, grace_s=2.5, now=0.0)
    leases.observe(router_heartbeat("router-0-a"), now=1.0)
    assert leases.expired(["router-0-a", "router-0-br1"], now=1.5) == []
    # A heartbeat sent before the new attempt was dispatched may not list it yet: grace.
    leases.observe(router_heartbeat("router-0-a"), now=3.0)
    assert leases.expired(["router-0-a", "router-0-br1"], now=3.0) == []
    leases.observe(router_heartbeat(), now=4.5)  # both ended; their cancels were lost
    expired = leases.expired(["router-0-a", "router-0-br1"], now=4.5)
    assert {(e.request_id, e.kind) for e in expired} == {("router-0-a", "finished"), ("router-0-br1", "finished")}


def test_a_restarted_router_kills_what_its_previous_incarnation_ran():
    leases = RequestLeases(lease_s=8, grace_s=2.5, now=0.0)
    leases.observe(router_heartbeat("router-0-a"), now=1.0)
    assert leases.expired(["router-0-a"], now=1.5) == []
    restarted = LoadReported(
        instance=InstanceRef(instance_id="router-0", site="site-a", incarnation="2"),
        service="router",
        live_request_ids=["router-0-new"],
        unix_s=0.0,
    )
    leases.observe(restarted, now=3.0)
    expired = leases.expired(["router-0-a", "router-0-new"], now=3.0)
    assert [(e.request_id, e.kind) for e in expired] == [("router-0-a", "kill")]


def test_a_whole_site_gone_silent_is_the_link_and_gets_the_cut_off_lease():
    leases = RequestLeases(lease_s=8, grace_s=2.5, now=0.0, cut_off_lease_s=30)
    leases.observe(router_heartbeat("router-0-a"), now=1.0)
    leases.observe(prefill_heartbeat(), now=1.0)
    assert leases.expired(["router-0-a"], now=1.0) == []  # held since then
    assert leases.expired(["router-0-a"], now=20.0) == []  # heartbeats queued on the WAN: wait
    assert [(e.request_id, e.kind) for e in leases.expired(["router-0-a"], now=31.5)] == [("router-0-a", "kill")]


def test_a_request_held_before_the_routers_first_heartbeat_is_not_taken_for_a_restart():
    # At a deployment's start a request can reach main decode before the router's first
    # heartbeat does (it crosses the WAN). When that request then ends on the relay, its KV
    # import must finish for the cache ("finished"), not be dropped as if the router had
    # restarted ("kill"): that once cost the next turn 29 MB of KV sent again.
    leases = RequestLeases(lease_s=8, grace_s=2.5, now=0.0)
    assert leases.expired(["router-0-a"], now=0.5) == []
    leases.observe(router_heartbeat("router-0-a"), now=1.0)
    assert leases.expired(["router-0-a"], now=1.5) == []
    leases.observe(router_heartbeat(), now=4.0)  # it ended; the cancel was lost
    assert [(e.request_id, e.kind) for e in leases.expired(["router-0-a"], now=4.0)] == [("router-0-a", "finished")]
