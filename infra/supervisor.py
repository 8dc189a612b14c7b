"""``pdd up``'s supervisor: starts a process that exited again, with back-off, like a restart policy.

It runs as its own process beside the deployment, reading and updating ``state.json`` under
its lock. A process that exits (a crash, a failed service exiting non-zero, a SIGKILL) is
started again from its recorded command after 1 s, then 2, 4 … up to 30 s while it keeps
exiting; a process that stayed up for a minute starts from 1 s again. Processes being
restarted by hand (``pdd restart``) are left alone. ``pdd down`` stops the supervisor first.
"""

import signal
import time
from dataclasses import dataclass
from pathlib import Path

import structlog

from infra.launcher import _spawn, locked_state, process_alive

log = structlog.get_logger(__name__)
BACKOFF_FIRST_S = 1.0
BACKOFF_MAX_S = 30.0
STEADY_AFTER_S = 60.0
POLL_S = 0.5


@dataclass
class _Restarts:
    consecutive: int = 0
    due: float | None = None
    started: float = 0.0

    def backoff_s(self) -> float:
        return min(BACKOFF_MAX_S, BACKOFF_FIRST_S * 2**self.consecutive)


def supervise(run_dir: Path) -> int:
    """Watch the deployment in ``run_dir`` until SIGTERM or until it is gone."""
    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(True))
    restarts: dict[str, _Restarts] = {}
    while not stopping:
        with locked_state(run_dir) as deployment:
            if deployment is None:
                return 0
            for name, pid in deployment.processes.items():
                if name not in deployment.paused and name in deployment.commands:
                    _check(run_dir, deployment, name, pid, restarts.setdefault(name, _Restarts()))
        time.sleep(POLL_S)
    return 0


def _check(run_dir: Path, deployment, name: str, pid: int, state: _Restarts):
    now = time.monotonic()
    if process_alive(pid):
        if state.consecutive and now - state.started > STEADY_AFTER_S:
            state.consecutive = 0
        return
    if state.due is None:
        state.due = now + state.backoff_s()
        log.warning("process_exited", process=name, pid=pid, restart_in_s=state.backoff_s())
        return
    if now < state.due:
        return
    new_pid = _spawn(run_dir, name, deployment.commands[name])
    deployment.processes[name] = new_pid
    deployment.restarts[name] = deployment.restarts.get(name, 0) + 1
    state.consecutive, state.due, state.started = state.consecutive + 1, None, now
    log.warning("process_restarted", process=name, pid=new_pid, restarts=deployment.restarts[name])
