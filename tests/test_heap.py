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
TENSOR_PAGES = (12 << 20) // os.sysconf("SC_PAGE_SIZE")
ROUNDS = 20

# A process that tunes (or not) as an engine does, then, on a thread started afterwards as the
# engine's is, allocates, fills and frees a 12 MiB tensor (a 1K-token gate/up product's size)
# ROUNDS times, and prints the minor page faults the thread caused.
PROBE = f"""
import json, resource, threading, torch
from shared.engine import heap
tuned = heap.keep_freed_memory()
faults = []
def work():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range({ROUNDS}):
        tensor = torch.empty(3 << 20)
        tensor.fill_(1.0)
        del tensor
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
    # glibc's defaults hand most of the rounds' pages back and fault them in again.
    assert untuned["faults"] > ROUNDS // 2 * TENSOR_PAGES
    # Tuned, the pages are faulted in for the first rounds only.
    assert tuned["faults"] < 3 * TENSOR_PAGES


def test_an_unknown_setting_is_an_error_that_names_it(monkeypatch):
    monkeypatch.setenv(heap.SETTING, "yes")
    with pytest.raises(ValueError, match="PDD_HEAP_TUNING"):
        heap.keep_freed_memory()
