"""A service's stop ends its own tasks even when one loses a cancel, and never waits forever."""

import asyncio

from shared.service import cancel_and_wait


async def test_a_task_that_swallowed_a_cancel_is_cancelled_again_and_a_stuck_one_is_named():
    swallowed = asyncio.Event()

    async def loses_one_cancel():
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            swallowed.set()  # as a cancel lost in a wait_for race: it carries on waiting
        await asyncio.Event().wait()

    released = asyncio.Event()

    async def refuses_cancels():
        while not released.is_set():
            try:
                await released.wait()
            except asyncio.CancelledError:
                continue

    lossy = asyncio.create_task(loses_one_cancel(), name="kv-events")
    stuck = asyncio.create_task(refuses_cancels(), name="stuck")
    await asyncio.sleep(0)
    left = await cancel_and_wait([lossy, stuck], timeout_s=1.0)
    assert swallowed.is_set() and lossy.cancelled()
    assert left == ["stuck"] and not stuck.done()
    released.set()
    await stuck
