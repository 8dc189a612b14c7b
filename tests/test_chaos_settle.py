"""``pdd chaos``'s leak reading: a block still held at the settle deadline is reported, and the
reading ends as soon as every engine answers and holds nothing (the whole-system scenarios
are in ``tests/faults/test_chaos.py``; this pins the timing rule they rely on)."""

import time

import pytest

from loadtest import chaos
from loadtest.chaos import HeldBlocks


@pytest.fixture
def gauges(monkeypatch):
    """Scripted gauge readings, one per call; the last one repeats."""
    readings: list[HeldBlocks] = []

    def read(ctx):
        read.calls += 1
        return readings.pop(0) if len(readings) > 1 else readings[0]

    read.calls = 0

    monkeypatch.setattr(chaos, "held_blocks", read)
    monkeypatch.setattr(chaos, "SETTLE_S", 1.5)
    monkeypatch.setattr(chaos, "HEARTBEAT_S", 0.01)
    return readings, read


async def test_a_leak_is_reported_at_the_deadline(gauges):
    readings, _ = gauges
    readings.extend([HeldBlocks(4, 0, 0), HeldBlocks(3, 0, 0)])
    started = time.monotonic()
    assert await chaos._settled_blocks(ctx=None) == (3, 0)
    assert time.monotonic() - started >= chaos.SETTLE_S


async def test_freed_blocks_end_the_wait_early(gauges):
    readings, read = gauges
    readings.extend([HeldBlocks(4, 2, 0), HeldBlocks(0, 0, 0), HeldBlocks(5, 0, 0)])
    assert await chaos._settled_blocks(ctx=None) == (0, 0)
    assert read.calls == 2  # the first all-zero reading ends it


async def test_an_engine_being_restarted_is_waited_for(gauges):
    # A killed engine's metrics do not answer while it restarts: its zero is not yet a reading.
    readings, _ = gauges
    readings.extend([HeldBlocks(0, 0, 1), HeldBlocks(0, 0, 1), HeldBlocks(2, 0, 0)])
    assert await chaos._settled_blocks(ctx=None) == (2, 0)
