"""The engine's C heap tuning: freed tensors stay mapped, so the next layer does not fault
their pages in again (``shared/engine/heap.py``)."""

import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from shared.engine import heap

REPO = Path(__file__).resolve().parent.parent
GATE_UP_FLOATS = 1024 * 3072
"""A 1K-token prefill's gate/up product in SmolLM2 (12.6 MB)."""
GATE_UP_PAGES = GATE_UP_FLOATS * 4 // os.sysconf("SC_PAGE_SIZE")
LAYERS = 30

# A process that tunes (or not) as an engine does, then, on a thread started afterwards as the
# engine's is, runs a layer's allocations (hidden rows, gate/up, activation, output; filled,
# then freed) LAYERS times to settle, and prints the minor page faults of LAYERS more.
PROBE = f"""
import json, resource, threading, torch
from shared.engine import heap
tuned = heap.keep_freed_memory()
faults = []
def layer():
    hidden = torch.empty(1024 * 576).fill_(1.0)
    gate_up = torch.empty({GATE_UP_FLOATS}).fill_(1.0)
    activation = torch.empty({GATE_UP_FLOATS // 2}).fill_(1.0)
    del gate_up
    out = torch.empty(1024 * 576).fill_(1.0)
    del activation, hidden, out
def work():
    for _ in range({LAYERS}):
        layer()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range({LAYERS}):
        layer()
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
thread = threading.Thread(target=work)
thread.start()
thread.join()
print(json.dumps({{"tuned": tuned, "faults": faults[0]}}))
"""


def _probe(setting: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(REPO), heap.SETTING: setting}
    done = subprocess.run(
        [sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=120, check=True
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the tuning is glibc's mallopt")
def test_freed_tensors_are_not_faulted_in_again():
    untuned, tuned = _probe("0"), _probe("1")
    assert (untuned["tuned"], tuned["tuned"]) == (False, True)
    # glibc's defaults hand the gate/up product's pages back every layer and fault them in again.
    assert untuned["faults"] > LAYERS * GATE_UP_PAGES // 2
    # Tuned, the settled layers reuse the pages they had.
    assert tuned["faults"] < GATE_UP_PAGES


def test_an_unknown_setting_is_an_error_that_names_it(monkeypatch):
    monkeypatch.setenv(heap.SETTING, "yes")
    with pytest.raises(ValueError, match="PDD_HEAP_TUNING"):
        heap.keep_freed_memory()
