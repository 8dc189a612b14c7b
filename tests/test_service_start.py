"""A service's start: its start-up heap frozen before it announces itself, and a start that
fails half-way still stops cleanly."""

import dataclasses
import gc
import socket
import threading

import pytest

from infra.wan_link import LinkProfile
from services.cache_index.service import CacheIndexService
from services.main_decode.service import MainDecodeService
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


async def test_a_decoder_whose_bulk_port_is_taken_fails_to_start_and_still_stops_cleanly(make_stack):
    """The failed start names the taken port; the stop after it (a stack's teardown) ends the
    engine thread instead of failing on the engine loop that never started."""
    stack = await make_stack(profile=LinkProfile(bandwidth_bps=0, rtt_ms=2, jitter_ms=0))
    old = stack.mains[0]
    await old.stop()
    threads_before = set(threading.enumerate())
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        service = MainDecodeService(dataclasses.replace(old.config, bulk_port=taken.getsockname()[1]), stack.loaded)
        stack.mains[0] = service
        with pytest.raises(OSError, match="in use"):
            await service.start()
    await service.stop()
    assert [t.name for t in set(threading.enumerate()) - threads_before if t.name.startswith("engine-")] == []
