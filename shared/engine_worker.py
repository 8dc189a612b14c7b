"""Runs an engine backend on its own thread so a service's asyncio loop never blocks on torch."""

import asyncio
from concurrent.futures import ThreadPoolExecutor
from functools import partial

import torch

from shared.engine.backend import EngineBackend
from shared.engine_call_log import EngineCallLog


class EngineWorker:
    """Serialises every engine call on one thread (the engine is not thread-safe)."""

    def __init__(self, engine: EngineBackend, name: str, torch_threads: int = 0, call_log: str = ""):
        """``call_log``: a file to record every call in (see ``shared.engine_call_log``); empty: none."""
        self.engine = engine
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"engine-{name}")
        self._call_log = EngineCallLog(call_log, name) if call_log else None
        if torch_threads:
            torch.set_num_threads(torch_threads)

    def submit(self, fn, *args, **kwargs) -> asyncio.Future:
        """Queue ``fn(*args, **kwargs)`` on the engine thread now; its result is the future's.

        Calls run in the order they were submitted, so work submitted here before the engine
        loop asks for its next step runs before that step.
        """
        call = partial(fn, *args, **kwargs)
        if self._call_log is not None:
            # the engine's per-request calls take the request id first
            request_id = args[0] if args and isinstance(args[0], str) else None
            call = self._call_log.wrap(getattr(fn, "__name__", type(fn).__name__), call, self.engine, request_id)
        return asyncio.get_running_loop().run_in_executor(self._executor, call)

    async def call(self, fn, *args, **kwargs):
        """Run ``fn(*args, **kwargs)`` on the engine thread and await its result."""
        return await self.submit(fn, *args, **kwargs)

    def shutdown(self):
        """Stop the thread after the calls already queued."""
        self._executor.shutdown(wait=True, cancel_futures=True)
        if self._call_log is not None:
            self._call_log.close()
