"""The stepping loop of a decoding or prefilling service.

Steps the engine whenever it has work, on the engine thread, and hands every step's outputs
to the service in the asyncio loop. Between two steps the service may add, extend, pause or
free sequences: those are the step boundaries continuous batching joins at.

Two ways to step. In lock-step (the default) the loop asks for each step after it handled the
last one's outputs and ran ``between_steps``: what the service does with a step's outputs is
in place before the next step. Overlapped (``overlap=True``), the engine thread starts the
next step as soon as the last ends, while the loop handles its outputs (at most one step
ahead): the step cadence no longer waits for a busy loop, and calls the service makes while
handling a step's outputs run after the step that has already started.
"""

import asyncio
import time
from collections.abc import Awaitable, Callable

import structlog
from prometheus_client import Histogram

from shared.engine.backend import StepOutput
from shared.engine_worker import EngineWorker

log = structlog.get_logger(__name__)


class EngineLoop:
    """Runs ``engine.step`` while there is work; sleeps until ``wake()`` otherwise."""

    def __init__(
        self,
        worker: EngineWorker,
        on_outputs: Callable[[list[StepOutput]], Awaitable[None]],
        between_steps: Callable[[], Awaitable[None]] | None = None,
        step_seconds: Histogram | None = None,
        overlap: bool = False,
    ):
        """``step_seconds``: a histogram (labels bound) that observes every step's duration;
        ``overlap``: step overlapped (no ``between_steps`` then)."""
        if overlap and between_steps is not None:
            raise ValueError("an overlapped engine loop has no between_steps")
        self._overlap = overlap
        self._worker = worker
        self._step_seconds = step_seconds
        self._on_outputs = on_outputs
        self._between_steps = between_steps
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task | None = None

    def start(self) -> asyncio.Task:
        """Start stepping in the background; return the task (it ends only by an exception or stop)."""
        run = self._run_overlapped() if self._overlap else self._run()
        self._task = asyncio.create_task(run, name="engine-loop")
        return self._task

    def wake(self):
        """Tell the loop there may be new work."""
        if self._overlap:
            self._worker.nudge()
        else:
            self._wakeup.set()

    async def stop(self):
        """Stop after the current step."""
        if self._task:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _run_overlapped(self):
        delivered: asyncio.Queue = asyncio.Queue()
        self._worker.start_stepping(lambda outputs, step_s: delivered.put_nowait((outputs, step_s)))
        try:
            while True:
                outputs, step_s = await delivered.get()
                if isinstance(outputs, BaseException):
                    log.error("engine_step_failed", error=repr(outputs))
                    raise outputs
                if self._step_seconds is not None:
                    self._step_seconds.observe(step_s)
                if outputs:
                    await self._on_outputs(outputs)
                self._worker.step_handled()
        finally:
            self._worker.stop_stepping()

    async def _run(self):
        engine = self._worker.engine
        while True:
            await self._wakeup.wait()
            self._wakeup.clear()
            while True:
                if self._between_steps:
                    await self._between_steps()
                try:
                    started = time.perf_counter()
                    outputs = await self._worker.call(step_if_work, engine)
                except Exception:
                    log.exception("engine_step_failed")
                    raise
                if outputs is None:
                    break
                if self._step_seconds is not None:
                    self._step_seconds.observe(time.perf_counter() - started)
                if outputs:
                    await self._on_outputs(outputs)


def step_if_work(engine) -> list[StepOutput] | None:
    """On the engine thread: one step if the engine has work, else None (one call, one loop
    turn per step instead of two)."""
    return engine.step() if engine.has_work() else None
