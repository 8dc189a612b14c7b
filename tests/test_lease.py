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
    leases.observe(prefill_heartbeat(), now=8.5)  # its site speaks: the router itself is gone
    assert leases.expired(["router-0-a", "router-0-b"], now=8.9) == []
    expired = leases.expired(["router-0-a", "router-0-b", "router-1-c"], now=9.1)
    assert {(e.request_id, e.kind) for e in expired} == {("router-0-a", "kill"), ("router-0-b", "kill")}
    assert leases.expired(["router-0-a", "router-1-c"], now=10) == []  # reported once
    # A router never heard from: its site is unknown, so it gets the cut-off lease.
    assert [(e.request_id, e.kind) for e in leases.expired(["router-1-c"], now=30.5)] == [("router-1-c", "kill")]


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
