"""A service in its own process freezes its start-up heap before it announces itself."""

import gc

from infra.wan_link import LinkProfile
from services.cache_index.service import CacheIndexService
from tests.helpers import until


async def test_the_start_up_collection_runs_before_the_first_heartbeat(make_stack):
    """The collection holds the interpreter for hundreds of ms: after the first heartbeat,
    routers would place requests on the instance while it runs."""
    stack = await make_stack(profile=LinkProfile(bandwidth_bps=0, rtt_ms=2, jitter_ms=0))
    old = stack.cache_index
    await old.stop()
    service = CacheIndexService(old.config)
    service.freeze_start_up_heap = True
    frozen_at_heartbeat = []
    report = service.load_report

    def recording_report():
        frozen_at_heartbeat.append(gc.get_freeze_count())
        return report()

    service.load_report = recording_report
    gc.unfreeze()
    try:
        await service.start()
        stack.cache_index = service
        await until(lambda: frozen_at_heartbeat, 10, "first heartbeat")
        assert frozen_at_heartbeat[0] > 0
    finally:
        gc.unfreeze()
