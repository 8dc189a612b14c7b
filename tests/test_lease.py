"""Request leases: engine-side state lives only while its router runs the request."""

from shared.lease import RequestLeases
from shared.messages import InstanceRef, LoadReported


def router_heartbeat(*request_ids: str, router: str = "router-0") -> LoadReported:
    return LoadReported(instance=InstanceRef(instance_id=router, site="site-a"), service="router",
                        live_request_ids=list(request_ids), unix_s=0.0)


def test_a_silent_router_loses_all_its_requests_after_the_lease():
    leases = RequestLeases(lease_s=8, grace_s=2.5, now=0.0)
    leases.observe(router_heartbeat("router-0-a", "router-0-b"), now=1.0)
    assert leases.expired(["router-0-a", "router-0-b"], now=8.9) == []
    expired = leases.expired(["router-0-a", "router-0-b", "router-1-c"], now=9.1)
    assert {(e.request_id, e.kind) for e in expired} == {("router-0-a", "kill"), ("router-0-b", "kill"),
                                                          ("router-1-c", "kill")}
    assert leases.expired(["router-0-a"], now=10) == []  # reported once


def test_a_request_its_live_router_no_longer_lists_is_freed_as_finished():
    leases = RequestLeases(lease_s=8, grace_s=2.5, now=0.0)
    leases.observe(router_heartbeat("router-0-a"), now=1.0)
    assert leases.expired(["router-0-a", "router-0-br1"], now=1.5) == []
    # A heartbeat sent before the new attempt was dispatched may not list it yet: grace.
    leases.observe(router_heartbeat("router-0-a"), now=3.0)
    assert leases.expired(["router-0-a", "router-0-br1"], now=3.0) == []
    leases.observe(router_heartbeat(), now=4.5)  # both ended; their cancels were lost
    expired = leases.expired(["router-0-a", "router-0-br1"], now=4.5)
    assert {(e.request_id, e.kind) for e in expired} == {("router-0-a", "finished"),
                                                         ("router-0-br1", "finished")}
