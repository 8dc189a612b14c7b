"""Runs an engine backend on its own thread so a service's asyncio loop never blocks on torch.

The thread hands results back in batches: a result finished while the loop has not yet taken
the previous one rides along with it, so a burst of short calls (a flow's imports queued
before a step) costs the loop one wake-up and the engine thread one hand-over of the GIL, not
one each. Each wake-up is a write to the loop's self-pipe, and each write makes the engine
thread give up the GIL and wait for it again (up to the switch interval while the loop is
busy), which is how a burst of imports used to delay the decode step queued behind them.

The thread can also step the engine by itself (``start_stepping``), for an engine loop that
overlaps a step with the handling of the last one's outputs (``shared.engine_loop``).
"""

import asyncio
import contextlib
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch

from shared.engine.backend import EngineBackend
from shared.engine_call_log import STEP_IF_WORK, EngineCallLog

_STOP = object()
_NUDGE = object()
MAX_STEPS_AHEAD = 2
"""Steps stepped on the engine thread whose outputs the loop has not handled yet, at most: the
next step runs while the loop handles the last one's outputs, never further ahead."""

Delivery = Callable[[list | BaseException, float], None]
"""``deliver(outputs, step_s)``: one step's outputs (or what it raised) and its duration."""


@dataclass
class _Stepping:
    loop: asyncio.AbstractEventLoop
    deliver: Delivery
    ahead: int = 0


class EngineWorker:
    """Serialises every engine call on one thread (the engine is not thread-safe)."""

    def __init__(self, engine: EngineBackend, name: str, torch_threads: int = 0, call_log: str = ""):
        """``call_log``: a file to record every call in (see ``shared.engine_call_log``); empty: none."""
        self.engine = engine
        self._call_log = EngineCallLog(call_log, name) if call_log else None
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._finished: list[tuple[asyncio.Future, BaseException | None, object]] = []
        self._handing_back = False  # a hand-back is scheduled on the loop and has not run yet
        self._closed = False
        self._stepping: _Stepping | None = None
        if torch_threads:
            torch.set_num_threads(torch_threads)
        self._thread = threading.Thread(target=self._serve, name=f"engine-{name}", daemon=True)
        self._thread.start()

    @classmethod
    async def build(
        cls, make_engine: Callable[[], EngineBackend], name: str, torch_threads: int = 0, call_log: str = ""
    ) -> "EngineWorker":
        """A worker whose engine ``make_engine`` builds (model load included) on the worker's own
        thread, the thread every later call and step runs on: no other thread then holds an
        OpenMP team of torch's, which slows an engine on several torch threads (docs/engine.md,
        "The engine built on the thread that runs it").

        Raises:
            Whatever ``make_engine`` raises (the thread is stopped first).
        """
        worker = cls(None, name, torch_threads, call_log)
        built = asyncio.get_running_loop().create_future()
        worker._calls.put((make_engine, built))  # not in the call log: it records engine calls
        try:
            worker.engine = await built
        except BaseException:
            worker.shutdown()
            raise
        return worker

    def submit(self, fn, *args, **kwargs) -> asyncio.Future:
        """Queue ``fn(*args, **kwargs)`` on the engine thread now; its result is the future's.

        Calls run in the order they were submitted, so work submitted here before the engine
        loop asks for its next step runs before that step. A call whose future is cancelled
        before it starts does not run. A worker serves one event loop.

        Raises:
            RuntimeError: the worker is shut down.
        """
        if self._closed:
            raise RuntimeError("the engine worker is shut down")
        future = asyncio.get_running_loop().create_future()
        call = partial(fn, *args, **kwargs)
        if self._call_log is not None:
            # the engine's per-request calls take the request id first
            request_id = args[0] if args and isinstance(args[0], str) else None
            call = self._call_log.wrap(getattr(fn, "__name__", type(fn).__name__), call, self.engine, request_id)
        self._calls.put((call, future))
        return future

    async def call(self, fn, *args, **kwargs):
        """Run ``fn(*args, **kwargs)`` on the engine thread and await its result."""
        return await self.submit(fn, *args, **kwargs)

    def shutdown(self):
        """Stop the thread after the call it is running; calls still queued are cancelled."""
        if self._closed:
            return
        self._closed = True
        self._stepping = None
        self._calls.put(_STOP)
        self._thread.join()
        while True:
            try:
                item = self._calls.get_nowait()
            except queue.Empty:
                break
            if item is not _STOP and item is not _NUDGE:
                _cancel_soon(item[1])
        if self._call_log is not None:
            self._call_log.close()

    # ----- stepping on the engine thread -----------------------------------------------------

    def start_stepping(self, deliver: Delivery):
        """From now on the engine thread steps the engine by itself whenever it has work, up
        to ``MAX_STEPS_AHEAD`` steps ahead of ``step_handled``: the calls queued when the last
        step ended run first, calls queued later wait for the next step (so a stream of calls
        cannot hold the steps off). ``deliver`` gets each step's outputs, or what its step
        raised, on the calling loop. The step's cadence then never waits for the loop."""
        self._stepping = _Stepping(asyncio.get_running_loop(), deliver)
        self.nudge()

    def step_handled(self):
        """On the loop: the outputs of the oldest step delivered are handled."""
        stepping = self._stepping
        if stepping is not None:
            with self._lock:
                stepping.ahead -= 1
            self.nudge()

    def stop_stepping(self):
        """No step starts after the one running (its outputs may still be delivered)."""
        self._stepping = None

    def nudge(self):
        """Have the engine thread look again whether it should step."""
        self._calls.put(_NUDGE)

    # ----- the engine thread ----------------------------------------------------------------

    def _serve(self):
        owed = 0  # calls queued when the last step ended: they run before the next step, later ones after
        while True:
            if (owed <= 0 or self._calls.empty()) and self._step():
                owed = self._calls.qsize()
                continue
            item = self._calls.get()
            owed -= 1
            if item is _STOP:
                return
            if item is _NUDGE:
                continue
            call, future = item
            if self._closed:  # shutting down: queued calls are cancelled, not run
                _cancel_soon(future)
                continue
            if future.cancelled():
                continue
            try:
                result, error = call(), None
            except BaseException as exc:  # noqa: BLE001 - whatever it is, the awaiting caller gets it
                result, error = None, exc
            self._hand_back(future, error, result)

    def _step(self) -> bool:
        """One step, if stepping is on, the engine has work and the loop is not too far behind."""
        stepping = self._stepping
        if stepping is None or stepping.ahead >= MAX_STEPS_AHEAD:
            return False
        started_s = time.perf_counter()
        try:
            if not self.engine.has_work():
                return False
            with self._lock:
                stepping.ahead += 1
            step = self.engine.step
            if self._call_log is not None:
                step = self._call_log.wrap(STEP_IF_WORK, step, self.engine)
            outputs = step()
        except BaseException as exc:  # noqa: BLE001 - raised on the loop, where the service watches it
            outputs = exc
            self._stepping = None  # as in lock-step, no step after a failed one
        try:
            stepping.loop.call_soon_threadsafe(stepping.deliver, outputs, time.perf_counter() - started_s)
        except RuntimeError:  # the loop is closed
            self._stepping = None
        return True

    def _hand_back(self, future: asyncio.Future, error: BaseException | None, result):
        """Give a result to the loop: with the batch already on its way, else in a new one."""
        with self._lock:
            self._finished.append((future, error, result))
            if self._handing_back:
                return
            self._handing_back = True
        try:
            future.get_loop().call_soon_threadsafe(self._settle)
        except RuntimeError:  # the loop is closed: nobody waits for these any more
            with self._lock:
                self._finished.clear()
                self._handing_back = False

    def _settle(self):
        """On the loop: resolve every future whose call has finished."""
        with self._lock:
            finished, self._finished = self._finished, []
            self._handing_back = False
        for future, error, result in finished:
            if future.cancelled():
                continue
            if error is not None:
                future.set_exception(error)
            else:
                future.set_result(result)


def _cancel_soon(future: asyncio.Future):
    """From any thread: cancel ``future`` on its loop (nothing if that loop is closed)."""
    with contextlib.suppress(RuntimeError):
        future.get_loop().call_soon_threadsafe(future.cancel)
