"""The C heap held for a CPU engine's large, short-lived tensors (glibc's malloc only).

A forward pass on the CPU allocates and frees tensors of megabytes in every layer (a 1K-token
prefill of SmolLM2: 12 MB for each gate/up product). With glibc's defaults these go back to
the kernel when freed: as their own ``mmap`` (past the adaptive threshold, 128 KiB at first),
as a trimmed heap top, or, in a thread's own arena, as an extra heap unmapped once empty. The
next layer then faults every page in again, zero-filled (measured: docs/engine.md, "The C
heap").

:func:`keep_freed_memory` asks glibc, through ``mallopt``, to keep that memory: no new arena
for threads that first allocate from then on (where no other was made before, they use the
main one, where only the trim threshold returns memory), allocations below 32 MiB from the
heap, and the heap's top trimmed only past 256 MiB free. The resident peak does not grow: the
same tensors live at the same time, they are only not handed back between layers.

``PDD_HEAP_TUNING``: unset, empty or ``1`` tune; ``0`` leave glibc's defaults; any other value
is an error that names the setting.
"""

import ctypes
import ctypes.util
import functools
import os

import structlog

log = structlog.get_logger(__name__)

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
M_ARENA_MAX = -8
"""``mallopt`` parameters, as glibc's ``malloc.h`` numbers them."""

MMAP_THRESHOLD_BYTES = 32 << 20
"""Allocations from this size on get their own mapping (glibc's largest allowed threshold)."""

TRIM_THRESHOLD_BYTES = 256 << 20
"""Free memory at the heap's top kept before any is returned to the kernel."""


SETTING = "PDD_HEAP_TUNING"


def heap_setting() -> bool:
    """``PDD_HEAP_TUNING``, checked: True for ``1`` (also when unset or empty), False for ``0``."""
    choice = os.environ.get(SETTING, "").strip() or "1"
    if choice not in ("0", "1"):
        raise ValueError(f"{SETTING}={os.environ[SETTING]!r}: expected 1 or 0")
    return choice == "1"


def keep_freed_memory() -> bool:
    """Tune this process's malloc unless ``PDD_HEAP_TUNING=0``; True where it is tuned (glibc).

    Threads that have already allocated keep their arena, so call it before the threads that
    run forward passes start. Raises ValueError for a setting it does not know.
    """
    return heap_setting() and _tune_once()


@functools.cache
def _tune_once() -> bool:
    path = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(path)
        mallopt = libc.mallopt
        libc.gnu_get_libc_version  # noqa: B018 - only glibc has it, and only glibc's mallopt takes these
    except (OSError, AttributeError, TypeError):
        log.info("heap_tuning_skipped", reason="not glibc")
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    settings = {
        M_ARENA_MAX: 1,
        M_MMAP_THRESHOLD: MMAP_THRESHOLD_BYTES,
        M_TRIM_THRESHOLD: TRIM_THRESHOLD_BYTES,
    }
    applied = all(mallopt(param, value) == 1 for param, value in settings.items())
    log.info(
        "heap_tuned",
        applied=applied,
        mmap_threshold_bytes=MMAP_THRESHOLD_BYTES,
        trim_threshold_bytes=TRIM_THRESHOLD_BYTES,
    )
    return applied
