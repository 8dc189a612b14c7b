"""CPU time of running processes, read from ``/proc`` (Linux): what a benchmark charges each
process of a deployment for the work it measured."""

import os
from pathlib import Path

CLOCK_TICKS_PER_S = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds the process (all its threads) has used; None when it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()  # the command name may hold spaces
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS_PER_S  # utime, stime


def snapshot(pids: dict[str, int]) -> dict[str, float]:
    """Name → CPU seconds so far, for every process still running."""
    found = {name: cpu_seconds(pid) for name, pid in pids.items()}
    return {name: seconds for name, seconds in found.items() if seconds is not None}


def us_per_unit(before: dict[str, float], after: dict[str, float], units: int) -> dict[str, float]:
    """Name → CPU microseconds each process spent per unit of work between two snapshots."""
    return {
        name: round((after[name] - before[name]) * 1e6 / max(1, units), 1) for name in sorted(after) if name in before
    }
