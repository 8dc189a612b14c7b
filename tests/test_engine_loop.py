"""The engine thread and the stepping loop: calls in order with their own results, and an
overlapped loop that keeps stepping while the service handles the last step's outputs, never
more than one step ahead, with the model's own tokens."""

import asyncio
import threading

import pytest

from shared.engine.hf_engine import HfEngine
from shared.engine.sampling import SamplingParams
from shared.engine_loop import EngineLoop
from shared.engine_worker import EngineWorker
from tests.helpers import prompt_of_length, reference_greedy, until


class CountedSteps:
    """A real engine whose steps are counted; ``stepped[n]`` is set once step n has ended, and
    ``handled_at_start[n - 1]`` is how many steps' outputs the service had handled when step n
    started."""

    def __init__(self, engine: HfEngine, fail_at_step: int = 0):
        self.engine, self.fail_at_step = engine, fail_at_step
        self.num_steps = self.num_handled = 0
        self.handled_at_start: list[int] = []
        self.stepped = [threading.Event() for _ in range(64)]

    def has_work(self) -> bool:
        return self.engine.has_work()

    def step(self):
        self.num_steps += 1
        self.handled_at_start.append(self.num_handled)
        if self.num_steps == self.fail_at_step:
            raise RuntimeError("the device fell over")
        outputs = self.engine.step()
        self.stepped[self.num_steps].set()
        return outputs


async def test_calls_run_in_order_and_each_caller_gets_its_own_result_or_error():
    ran: list[int] = []

    def record(i: int) -> int:
        ran.append(i)
        if i == 7:
            raise ValueError("seven")
        return i * i

    worker = EngineWorker(engine=None, name="t")
    try:
        futures = [worker.submit(record, i) for i in range(200)]  # one burst: handed back in batches
        results = await asyncio.gather(*futures, return_exceptions=True)
        assert ran == list(range(200))
        assert isinstance(results[7], ValueError) and str(results[7]) == "seven"
        assert [r for i, r in enumerate(results) if i != 7] == [i * i for i in range(200) if i != 7]
    finally:
        worker.shutdown()


async def test_calls_still_queued_at_shutdown_are_cancelled_and_a_base_exception_reaches_its_caller():
    worker = EngineWorker(engine=None, name="t")
    gate = threading.Event()

    def interrupt():
        raise KeyboardInterrupt

    interrupted = worker.submit(interrupt)
    with pytest.raises(KeyboardInterrupt):
        await interrupted
    assert await worker.call(lambda: 42) == 42  # the thread lives on
    started = threading.Event()

    def hold():
        started.set()
        return gate.wait(10)

    running = worker.submit(hold)
    queued = [worker.submit(lambda: 1) for _ in range(3)]
    assert await asyncio.to_thread(started.wait, 10)
    closing = asyncio.create_task(asyncio.to_thread(worker.shutdown))
    await until(lambda: worker._closed, 10, "the shutdown to begin")
    gate.set()  # the running call ends; the three behind it must not run
    await closing
    assert await running is True
    for future in queued:
        with pytest.raises(asyncio.CancelledError):
            await future
    with pytest.raises(RuntimeError, match="shut down"):
        worker.submit(lambda: 1)


async def test_a_call_cancelled_before_it_starts_never_runs():
    worker = EngineWorker(engine=None, name="t")
    gate, ran = threading.Event(), []
    try:
        blocker = worker.submit(gate.wait, 10)
        cancelled = worker.submit(ran.append, "cancelled")
        after = worker.submit(ran.append, "after")
        cancelled.cancel()
        gate.set()
        await asyncio.gather(blocker, after)
        assert ran == ["after"]
    finally:
        worker.shutdown()


async def test_a_built_engine_is_built_on_the_thread_that_runs_it_and_a_failed_build_stops_that_thread(tiny):
    built_on: list[threading.Thread] = []

    def make_engine() -> HfEngine:
        built_on.append(threading.current_thread())
        return HfEngine(tiny, num_blocks=64)

    worker = await EngineWorker.build(make_engine, "prefill-0")
    try:
        prompt = prompt_of_length(tiny, 12)
        assert await worker.call(threading.current_thread) is built_on[0] is not threading.current_thread()
        assert (await worker.call(worker.engine.generate, "g", prompt, SamplingParams(max_tokens=4))) == (
            reference_greedy(tiny, prompt, 4)
        )
    finally:
        worker.shutdown()
    assert not built_on[0].is_alive()

    def no_engine():
        built_on.append(threading.current_thread())
        raise RuntimeError("no model here")

    with pytest.raises(RuntimeError, match="no model here"):
        await EngineWorker.build(no_engine, "prefill-1")
    assert not built_on[-1].is_alive()  # nothing left running


async def test_an_overlapped_loop_steps_while_the_last_steps_outputs_are_handled_and_never_further(tiny):
    counted = CountedSteps(HfEngine(tiny, num_blocks=64))
    worker = EngineWorker(counted, "main-decode-0")
    prompt = prompt_of_length(tiny, 24)
    handling, release, finished = asyncio.Event(), asyncio.Event(), asyncio.Event()
    tokens: list[int] = []

    async def on_outputs(outputs):
        tokens.extend(o.token_id for o in outputs if o.token_id is not None)
        if any(o.finished for o in outputs):
            finished.set()
        if len(tokens) == 1:  # the service is slow with the first step's outputs
            handling.set()
            await release.wait()
        counted.num_handled += 1

    loop = EngineLoop(worker, on_outputs, overlap=True)
    try:
        await worker.call(counted.engine.add_request, "r", prompt, SamplingParams(max_tokens=12, ignore_eos=True))
        loop.start()
        await asyncio.wait_for(handling.wait(), 30)
        # The second step runs while the first one's outputs are still being handled ...
        assert await asyncio.to_thread(counted.stepped[2].wait, 30)
        assert tokens == [reference_greedy(tiny, prompt, 1)[0]]
        release.set()
        await asyncio.wait_for(finished.wait(), 30)
        assert tokens == reference_greedy(tiny, prompt, 12)  # every token once, in order
        # Step n started with the outputs of step n - 2 handled, never earlier: one step ahead.
        assert counted.handled_at_start[:2] == [0, 0]
        assert all(handled >= n - 2 for n, handled in enumerate(counted.handled_at_start, start=1))
    finally:
        await loop.stop()
        worker.shutdown()


async def test_an_overlapped_step_that_raises_ends_the_loop_with_its_error(tiny):
    counted = CountedSteps(HfEngine(tiny, num_blocks=64), fail_at_step=3)
    worker = EngineWorker(counted, "main-decode-0")

    async def on_outputs(outputs):
        pass

    loop = EngineLoop(worker, on_outputs, overlap=True)
    try:
        await worker.call(
            counted.engine.add_request, "r", prompt_of_length(tiny, 8), SamplingParams(max_tokens=8, ignore_eos=True)
        )
        with pytest.raises(RuntimeError, match="the device fell over"):
            await asyncio.wait_for(loop.start(), 30)
        assert counted.num_steps == 3  # no step after the failed one
    finally:
        worker.shutdown()


class Endless:
    """An engine that always has work and whose steps produce nothing; it counts them."""

    def __init__(self, has_work_fails: bool = False):
        self.num_steps, self.has_work_fails = 0, has_work_fails

    def has_work(self) -> bool:
        if self.has_work_fails:
            raise RuntimeError("has_work broke")
        return True

    def step(self):
        self.num_steps += 1
        return []


async def test_a_stream_of_calls_does_not_hold_off_the_overlapped_steps():
    engine = Endless()
    worker = EngineWorker(engine, "main-decode-0")

    async def on_outputs(outputs):
        pass

    loop = EngineLoop(worker, on_outputs, overlap=True)
    loop.start()
    try:
        # Four calls kept queued, as a flow's frame imports are: the queue seldom runs dry.
        queued = [worker.submit(sum, range(200_000)) for _ in range(4)]
        first_step = await worker.call(lambda: engine.num_steps)
        for _ in range(200):
            await queued.pop(0)
            queued.append(worker.submit(sum, range(200_000)))
        await asyncio.gather(*queued)
        steps = await worker.call(lambda: engine.num_steps) - first_step
        # A step after the (at most four) calls queued when the last one ended: about 40 or more.
        assert steps >= 30, f"{steps} steps beside 200 calls"
    finally:
        await loop.stop()
        worker.shutdown()


async def test_a_failing_has_work_ends_the_overlapped_loop_and_calls_still_run():
    worker = EngineWorker(Endless(has_work_fails=True), "main-decode-0")

    async def on_outputs(outputs):
        pass

    loop = EngineLoop(worker, on_outputs, overlap=True)
    try:
        with pytest.raises(RuntimeError, match="has_work broke"):
            await asyncio.wait_for(loop.start(), 30)
        assert await worker.call(lambda: 42) == 42
    finally:
        worker.shutdown()
