"""The in-place paged attention kernel (``csrc/paged_attention.c``): built once, called by ctypes.

The kernel reads each sequence's K/V blocks where they lie in the pool, so a step copies no
K/V (the gather before SDPA cost more than the attention itself at batch 16). It is compiled
with the system's C compiler on first use, for AVX2 + FMA, into a cache folder keyed by the
source's hash (``PDD_KERNEL_CACHE``, default ``~/.cache/pdd/kernels``); the build goes to a
temporary name and is renamed into place, so concurrent processes never load a partial file.
Where it cannot be had (no compiler, no AVX2/FMA, a head size it does not handle, a pool not on
the CPU or not fp32, ``PDD_PAGED_KERNEL=0``), ``load()`` returns None and the engine keeps its
gather + SDPA path.
"""

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import structlog
import torch

log = structlog.get_logger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "paged_attention.c"
CFLAGS = ("-O3", "-mavx2", "-mfma", "-fopenmp", "-fPIC", "-shared", "-std=c11")
SMALL_CHUNK_TOKENS, LARGE_CHUNK_TOKENS = 8, 32
"""New tokens per work unit (times the GQA group's query heads: the rows one unit computes):
large units amortise a unit's transposed keys over more rows (1K-token prefill attention 8.0
against 8.9 ms a layer on 2 threads), small ones keep both threads busy when a step has few new
tokens (a 16-token extend: 0.29 against 0.35 ms a layer)."""


def chunk_tokens(max_new_tokens: int) -> int:
    """Tokens per work unit for a batch whose longest sequence adds ``max_new_tokens``."""
    return LARGE_CHUNK_TOKENS if max_new_tokens >= 8 * LARGE_CHUNK_TOKENS else SMALL_CHUNK_TOKENS


def _cpu_has_avx2_fma() -> bool:
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        return False
    return {"avx2", "fma"} <= set(flags.split(":", 1)[1].split())


def _cache_dir() -> Path:
    configured = os.environ.get("PDD_KERNEL_CACHE")
    return Path(configured) if configured else Path.home() / ".cache" / "pdd" / "kernels"


def _build(compiler: str) -> Path:
    source = SOURCE.read_bytes()
    digest = hashlib.sha256(source + " ".join(CFLAGS).encode()).hexdigest()[:16]
    target = _cache_dir() / f"paged_attention-{digest}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, partial = tempfile.mkstemp(dir=target.parent, suffix=".so.partial")
    os.close(fd)
    try:
        subprocess.run([compiler, *CFLAGS, str(SOURCE), "-o", partial, "-lm"], check=True, capture_output=True)
        os.replace(partial, target)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)
    return target


class PagedKernel:
    """The loaded kernel: ``attend`` runs one layer's attention for a whole packed batch."""

    def __init__(self, library: ctypes.CDLL):
        function = library.pdd_paged_attention
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        function.argtypes = [ptr, ptr, ptr, ptr, i64, i64, ptr, i64, ptr, i64, i64, i64, i64, ctypes.c_float, i64, i64]
        function.restype = ctypes.c_int
        self._function = function

    @staticmethod
    def supports(kv_pool_tensor: torch.Tensor, head_dim: int) -> bool:
        """Whether the kernel can read this pool (``KvPool.kv``) for this head size."""
        return (
            kv_pool_tensor.device.type == "cpu"
            and kv_pool_tensor.dtype == torch.float32
            and kv_pool_tensor.is_contiguous()
            and head_dim % 8 == 0
            and head_dim <= 256
        )

    def attend(
        self,
        query: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        tables: torch.Tensor,
        meta: torch.Tensor,
        scale: float,
        chunk: int = SMALL_CHUNK_TOKENS,
    ) -> torch.Tensor:
        """``[tokens, heads, head_dim]`` outputs of ``query`` (same shape, contiguous fp32).

        ``keys``/``values``: one layer's ``[kv_heads, num_blocks, block_size, head_dim]`` pool
        tensors; ``tables`` ``[sequences, width]`` and ``meta`` ``[sequences, 3]`` (query start,
        new tokens, context length), int64 and contiguous, checked by ``check_batch``; ``chunk``:
        new tokens per work unit (``chunk_tokens``). Rows of no sequence are left unset.
        """
        _, num_heads, head_dim = query.shape
        kv_heads, num_blocks, block_size = keys.shape[0], keys.shape[1], keys.shape[2]
        if not (query.is_contiguous() and query.dtype == torch.float32 and keys.shape[3] == head_dim):
            raise ValueError(f"query {tuple(query.shape)} {query.dtype} does not fit the pool {tuple(keys.shape)}")
        out = torch.empty_like(query)
        status = self._function(
            query.data_ptr(),
            out.data_ptr(),
            keys.data_ptr(),
            values.data_ptr(),
            num_blocks * block_size * head_dim,
            block_size,
            tables.data_ptr(),
            tables.shape[1],
            meta.data_ptr(),
            meta.shape[0],
            num_heads,
            kv_heads,
            head_dim,
            scale,
            chunk,
            torch.get_num_threads(),
        )
        if status != 0:
            raise RuntimeError(f"paged attention kernel failed with status {status}")
        return out


def check_batch(tables: torch.Tensor, meta: torch.Tensor, num_tokens: int, num_blocks: int, block_size: int):
    """Raise ValueError unless every read the kernel would make from ``tables``/``meta`` stays
    inside a pool of ``num_blocks`` blocks and a batch of ``num_tokens`` packed tokens (the C
    code trusts them: an out-of-range block id would read outside the pool)."""
    starts, new, context = meta[:, 0], meta[:, 1], meta[:, 2]
    bad = (
        tables.dtype != torch.long
        or meta.dtype != torch.long
        or not (tables.is_contiguous() and meta.is_contiguous())
        or bool((tables < 0).any() or (tables >= num_blocks).any())
        or bool((starts < 0).any() or (new < 1).any() or (starts + new > num_tokens).any())
        or bool((context < new).any() or (context > tables.shape[1] * block_size).any())
    )
    if bad:
        raise ValueError("paged kernel batch reads outside the pool or the packed tokens")


@functools.cache
def load() -> PagedKernel | None:
    """The kernel, built if needed; None where it cannot be had (see the module docstring)."""
    if os.environ.get("PDD_PAGED_KERNEL", "1") == "0":
        return None
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if compiler is None or not _cpu_has_avx2_fma():
        log.info("paged_kernel_unavailable", reason="no C compiler" if compiler is None else "no AVX2/FMA")
        return None
    try:
        library = ctypes.CDLL(str(_build(compiler)))
    except (OSError, subprocess.CalledProcessError) as exc:
        stderr = getattr(exc, "stderr", b"") or b""
        log.warning(
            "paged_kernel_unavailable", reason=str(exc), compiler_output=stderr.decode(errors="replace")[-2000:]
        )
        return None
    return PagedKernel(library)
