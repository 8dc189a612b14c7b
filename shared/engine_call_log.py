"""A JSON-lines record of every call an engine thread runs: what queued behind what, and for
how long. It answers "where did this request's time go" at the engine (a KV export waiting
behind another prompt's whole prefill, an import waiting for decode steps), which traces of
the services' own spans do not show.

One line per call: ``{"instance", "call", "queued_s", "start_s", "end_s"}`` (Unix seconds),
plus ``"request"`` for a call about one request (the id the router gave it), and ``"batch"``
for a step on an engine that reports its last batch: ``[[new_tokens, cached_tokens], …]`` per
scheduled sequence. Several processes may append to one file (each
line is one ``write`` of an ``O_APPEND`` file).
"""

import json
import os
import time
from collections.abc import Callable

SKIPPED_CALLS = frozenset({"has_work"})
"""Asked before every step: recording them would double the log and tell nothing."""
STEP_IF_WORK = "step_if_work"
"""The engine loop's step (``shared.engine_loop.step_if_work``): recorded as ``step`` when it
stepped, not at all when the engine had no work."""


class EngineCallLog:
    """Appends one line per engine-thread call to ``path``."""

    def __init__(self, path: str, instance: str):
        self.instance = instance
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def wrap(self, name: str, fn: Callable[[], object], engine, request_id: str | None = None) -> Callable[[], object]:
        """``fn`` (the call ``name``, about ``request_id`` if one) as the engine thread should
        run it: timed and recorded, queued from now."""
        if name in SKIPPED_CALLS:
            return fn
        queued_s = time.time()
        call = "step" if name == STEP_IF_WORK else name

        def timed():
            start_s = time.time()
            idle = False
            try:
                result = fn()
                idle = name == STEP_IF_WORK and result is None
                return result
            finally:
                if not idle:
                    self._write(call, queued_s, start_s, request_id, engine)

        return timed

    def _write(self, call: str, queued_s: float, start_s: float, request_id: str | None, engine):
        record = {
            "instance": self.instance,
            "call": call,
            "queued_s": round(queued_s, 6),
            "start_s": round(start_s, 6),
            "end_s": round(time.time(), 6),
        }
        if request_id is not None:
            record["request"] = request_id
        if call == "step" and getattr(engine, "last_batch", None) is not None:
            record["batch"] = engine.last_batch
        os.write(self._fd, (json.dumps(record) + "\n").encode())

    def close(self):
        """Stop recording."""
        os.close(self._fd)
