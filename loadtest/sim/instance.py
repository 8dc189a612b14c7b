"""A simulated engine instance: continuous batching with chunked prefill, as the engine does it.

Each step runs one token of every decoding sequence, then prompt and extend chunks under the
token budget; KV export and import run on the engine's thread between steps, in the order the
engine worker runs them (see ``_Call``). Steps of pure
decode repeat unchanged until a sequence ends, so they run as one macro step (cut short when
new work arrives, which joins at the next step boundary). Engines on one host share its cores
(this machine: every process on 2 cores); on a GPU deployment each instance has its own chip.
"""

import math
import random
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from loadtest.sim.events import EventQueue
from loadtest.sim.kv_pool import SimKvPool
from loadtest.sim.step_speeds import kind_of


class Host:
    """Cores shared by engines.

    With ``step_speeds`` (``pdd profile``'s ``deployment_steps``), a step runs at the speed
    measured for its kind inside a deployment, alone or beside another engine's step, and with
    ``rng`` each step's time is drawn around it with the spread measured there. Otherwise (and
    for engine-thread calls that are not steps), with ``busy`` engines computing each runs at the
    speed measured for that many (``shared_host_speed``), or, unmeasured, at
    ``min(1, cores / (threads_per_engine * busy))`` of its full speed. An idle engine's loop
    starts a step ``wake_s`` after work arrives (what arrives meanwhile shares the step)."""

    def __init__(
        self,
        cores: int,
        threads_per_engine: int,
        measured: dict | None = None,
        step_speeds: dict | None = None,
        rng: random.Random | None = None,
        wake_s: float = 0.0,
    ):
        self.cores, self.threads_per_engine = cores, threads_per_engine
        self.measured = {int(k): v for k, v in (measured or {}).items()}
        self.step_speeds = step_speeds or {}
        self.rng = rng
        self.wake_s = wake_s
        self.engines: list[SimEngine] = []

    def step_speed(self, engine: "SimEngine") -> float:
        """Speed of ``engine``'s step (or call) now."""
        row = self.step_speeds.get(engine.step_kind)
        if row:
            beside = any(other is not engine and other.computing for other in self.engines)
            first, second = ("beside", "alone") if beside else ("alone", "beside")
            factor = row.get(first) or row.get(second)  # one unmeasured: the other stands in
            if factor:
                return 1.0 / factor
        return self.speed()

    def step_noise(self, kind: str, count: int) -> float:
        """A factor drawn for a (macro) step of ``count`` steps of ``kind``: 1 without ``rng``."""
        row = self.step_speeds.get(kind) or {}
        spread = row.get("spread") or 0.0
        if self.rng is None or not spread:
            return 1.0
        return math.exp(self.rng.gauss(0.0, spread / math.sqrt(count)))

    def speed(self) -> float:
        """Speed of a busy engine now."""
        busy = max(1, sum(1 for engine in self.engines if engine.busy))
        if busy in self.measured:
            return self.measured[busy]
        if self.measured:  # beyond what was measured: the same total throughput, shared further
            most = max(self.measured)
            return self.measured[most] * most / busy
        return min(1.0, self.cores / (self.threads_per_engine * busy))

    def changed(self, source: "SimEngine"):
        """An engine started or stopped computing: the others' speeds change."""
        for engine in self.engines:
            if engine is not source and engine.busy:
                engine.rebase()


@dataclass(eq=False)
class DecodeSeq:
    """A sequence decoding on an instance.

    Attributes:
        request: The simulated request's state (owned by the simulator).
        remaining: Tokens it still produces here.
        context_tokens: Tokens its KV covers.
        on_tokens: ``(seq, count, first_s, gap_s)`` after each (macro) step that produced tokens.
        on_done: When ``remaining`` reaches 0.
        emitted: Tokens produced here so far.
        paused: Held (a final handoff is on its way): not scheduled.
        one_token_steps: Report every token (a relay in catch-up decides per token).
        last_token_s: When its latest token was produced.
    """

    request: object
    remaining: int
    context_tokens: int
    on_tokens: Callable
    on_done: Callable
    blocks: int = 0
    emitted: int = 0
    paused: bool = False
    one_token_steps: bool = False
    last_token_s: float = 0.0


@dataclass(eq=False)
class Chunked:
    """Prompt or extend tokens to compute: ``remaining`` over ``context`` cached tokens."""

    remaining: int
    context: int
    on_done: Callable[[], None]


@dataclass
class _Call:
    """Engine-thread work that is not a step (``EngineWorker.submit``).

    Attributes:
        seconds: Its compute time at full speed.
        on_done: Called when it ends.
        before_next_step: It runs before the next step. The worker runs calls in the order they
            were submitted, and the engine loop asks for its next step only after it has handed
            out the last step's outputs (and the prefill has queued the exports they made due).
            So a call queued during a step, or by that step's outputs, runs before the next one;
            a call queued once the loop has asked (while earlier calls run) waits for that step.
    """

    seconds: float
    on_done: Callable[[], None]
    before_next_step: bool


@dataclass
class _Step:
    started_s: float
    step_s: float
    count: int
    decodes: list
    chunks: list = field(default_factory=list)
    serial: Callable | None = None
    work_done: float = 0.0
    kind: str = ""


class SimEngine:
    """One instance's engine thread."""

    def __init__(
        self,
        events: EventQueue,
        name: str,
        role: str,
        site: str,
        cost,
        pool: SimKvPool,
        *,
        max_sequences: int,
        host: Host | None = None,
    ):
        self.events, self.name, self.role, self.site = events, name, role, site
        self.cost, self.pool, self.max_sequences, self.host = cost, pool, max_sequences, host
        self.running: list[DecodeSeq] = []
        self.waiting: deque[DecodeSeq] = deque()
        self.chunks: deque[Chunked] = deque()
        self.serial: deque[_Call] = deque()
        self.requests = 0
        self.busy_s = 0.0
        self._step: _Step | None = None
        self._speed = 1.0
        self._ending: _Step | None = None
        self._waking = False
        self._last_s = 0.0
        self._version = 0
        if host:
            host.engines.append(self)

    @property
    def busy(self) -> bool:
        """Computing a step or running an engine-thread call now."""
        return self._step is not None

    @property
    def computing(self) -> bool:
        """Computing a step (not a call) now."""
        return self._step is not None and self._step.serial is None

    @property
    def step_kind(self) -> str:
        """The kind of the step computing now (``step_speeds.kind_of``); "" for none or a call."""
        return self._step.kind if self._step is not None else ""

    # ----- work in ------------------------------------------------------------------------

    def add_decode(self, seq: DecodeSeq):
        """Decode ``seq`` once its blocks fit the pool."""
        self.waiting.append(seq)
        self._admit()
        self._kick()

    def add_chunked(self, work: Chunked):
        """Compute prompt or extend tokens (FIFO with others, under the step budget)."""
        self.chunks.append(work)
        self._kick()

    def add_serial(self, seconds: float, on_done: Callable[[], None]):
        """Engine-thread work that is not a step (KV export or import, a prefix lookup): it
        runs once the current step ends, before or after the next step as ``_Call`` says."""
        ending, step = self._ending, self._step
        if ending is not None:  # queued by what just ended: a step's outputs, or a call's result
            before = not ending.serial
        else:  # idle, or queued while a step or a call runs
            before = step is None or not step.serial
        self.serial.append(_Call(seconds, on_done, before))
        self._kick()

    def drop(self, seq: DecodeSeq):
        """``seq`` leaves (finished elsewhere, paused for good or cancelled)."""
        if seq in self.waiting:
            self.waiting.remove(seq)
            return
        self.settle()
        if seq in self.running:
            self.running.remove(seq)
        self._admit()

    # ----- stepping -----------------------------------------------------------------------

    def _admit(self):
        while self.waiting and len(self.running) < self.max_sequences and self.pool.fits(self.waiting[0].blocks):
            seq = self.waiting.popleft()
            seq.last_token_s = self.events.now
            self.running.append(seq)

    def _kick(self):
        """New work: start a step if idle (after the loop's wake-up, unless it is an engine-thread
        call, which the worker runs at once), else end the current macro step at its next boundary."""
        if self._step is None:
            wake_s = self.host.wake_s if self.host else 0.0
            if self._waking:
                return
            if wake_s > 0 and not self.serial:
                self._waking = True
                self.events.after(wake_s, self._woken)
                return
            self._start()
            return
        step = self._step
        if step.count > 1:
            self._progress()
            step.count = min(step.count, math.floor(step.work_done) + 1)
            self._schedule_end()

    def _woken(self):
        self._waking = False
        if self._step is None:
            self._start()

    def _compose(self) -> _Step | None:
        now = self.events.now
        decodes = [s for s in self.running if not s.paused and s.remaining > 0]
        if self.serial and (self.serial[0].before_next_step or not (decodes or self.chunks)):
            call = self.serial.popleft()
            return _Step(now, call.seconds, 1, [], serial=call.on_done)
        for call in self.serial:  # queued behind this step: they run before the one after it
            call.before_next_step = True
        budget = max(0, self.cost.max_batch_tokens - len(decodes))
        chunks = []
        most = self.cost.max_prefill_requests or len(self.chunks)
        for work in self.chunks:
            if budget <= 0 or len(chunks) >= most:
                break
            take = min(work.remaining, budget)
            chunks.append((work, take))
            budget -= take
        if not decodes and not chunks:
            return None
        count = 1
        if not chunks and not self.serial and not any(s.one_token_steps for s in decodes):
            count = min(s.remaining for s in decodes)
        context = sum(s.context_tokens for s in decodes) + len(decodes) * (count - 1) / 2
        step_s = self.cost.step_s([(take, w.context) for w, take in chunks], len(decodes), int(context))
        kind = kind_of(bool(chunks), len(decodes))
        if self.host:
            step_s *= self.host.step_noise(kind, count)
        return _Step(now, step_s, count, decodes, chunks, kind=kind)

    def _start(self):
        self._step = self._compose()
        self._last_s = self.events.now
        if self._step is None:
            if self.host:
                self.host.changed(self)
            return
        if self.host:
            self.host.changed(self)
            self._speed = self.host.step_speed(self)
        self._schedule_end()

    def _progress(self):
        now = self.events.now
        step = self._step
        step.work_done += (now - self._last_s) * self._speed / step.step_s if step.step_s > 0 else step.count
        self.busy_s += now - self._last_s
        self._last_s = now

    def rebase(self):
        """The host's speed changed: account progress so far at the old speed."""
        if self._step is None:
            return
        self._progress()
        self._speed = self.host.step_speed(self) if self.host else 1.0
        self._schedule_end()

    def _schedule_end(self):
        self._version += 1
        version, step = self._version, self._step
        left = max(0.0, step.count - step.work_done) * step.step_s / self._speed
        self.events.after(left, lambda: self._end(version))

    def settle(self):
        """Apply the whole steps a macro step has finished by now, so their tokens are seen
        (by the client, and by a handoff that asks how many were emitted)."""
        step = self._step
        if step is None or step.count <= 1 or step.serial:
            return
        self._progress()
        done = min(step.count - 1, math.floor(step.work_done))
        if done <= 0:
            return
        wall_per_step = (self.events.now - step.started_s) / step.work_done
        callbacks = []
        for seq in step.decodes:
            if seq in self.running:  # count = the fewest remaining, so none ends here
                seq.remaining -= done
                seq.emitted += done
                seq.context_tokens += done
                callbacks.append(
                    lambda seq=seq, first=step.started_s + wall_per_step: seq.on_tokens(seq, done, first, wall_per_step)
                )
        step.count -= done
        step.work_done -= done
        step.started_s += done * wall_per_step
        for callback in callbacks:
            callback()

    def _end(self, version: int):
        if version != self._version or self._step is None:
            return
        self._progress()
        step, now = self._step, self.events.now
        callbacks = [step.serial] if step.serial else []
        gap = (now - step.started_s) / step.count
        for seq in step.decodes:
            if seq not in self.running:
                continue
            produced = min(step.count, seq.remaining)
            seq.remaining -= produced
            seq.emitted += produced
            seq.context_tokens += produced
            seq.last_token_s = now
            callbacks.append(lambda seq=seq, n=produced: seq.on_tokens(seq, n, step.started_s + gap, gap))
            if seq.remaining <= 0:
                self.running.remove(seq)
                callbacks.append(lambda seq=seq: seq.on_done(seq))
        for work, take in step.chunks:
            work.remaining -= take
            work.context += take
            if work.remaining <= 0:
                self.chunks.remove(work)
                callbacks.append(work.on_done)
        # the step is over before anyone hears of it: work they add goes into the next one
        self._step = None
        self._admit()
        self._ending = step
        try:
            for callback in callbacks:
                callback()
        finally:
            self._ending = None
        if self._step is None:
            self._start()
