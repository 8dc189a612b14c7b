"""The in-place paged attention kernel (``csrc/paged_attention.c``): built once, called by ctypes.

The kernel reads each sequence's K/V blocks where they lie in the pool, so a step copies no
K/V (the gather before SDPA cost more than the attention itself at batch 16). It is compiled
with the system's C compiler on first use into a cache folder keyed by the source's hash and
the flags (``PDD_KERNEL_CACHE``, default ``~/.cache/pdd/kernels``); the build goes to a
temporary name and is renamed into place, so concurrent processes never load a partial file.

One source, two builds (``ISAS``): AVX-512 (16-float vectors) where the CPU has ``avx512f``
and ``avx512vl`` and the head size is a multiple of 16, else AVX2 + FMA (8 floats).
``PDD_PAGED_KERNEL`` chooses: unset, empty or ``1`` the widest that fits, ``avx2`` or
``avx512`` that build only, ``0`` none; any other value is an error that names the setting.
Where no build can be had (no compiler, no AVX2/FMA, a head size neither handles, a pool not
on the CPU or not fp32, ``0``), ``kernel_for`` returns None and the engine keeps its gather +
SDPA path.
"""

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import structlog
import torch

log = structlog.get_logger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "paged_attention.c"
CFLAGS = ("-O3", "-fopenmp", "-fPIC", "-shared", "-std=c11")


@dataclass(frozen=True)
class Isa:
    """One build of the kernel: its compiler flags, the CPU flags it needs, its vector width."""

    name: str
    cflags: tuple[str, ...]
    cpu_flags: frozenset[str]
    lanes: int


ISAS = (
    Isa(
        name="avx512",
        cflags=("-mavx512f", "-mavx512vl", "-mavx2", "-mfma"),
        cpu_flags=frozenset({"avx512f", "avx512vl", "avx2", "fma"}),
        lanes=16,
    ),
    Isa(name="avx2", cflags=("-mavx2", "-mfma"), cpu_flags=frozenset({"avx2", "fma"}), lanes=8),
)
"""Widest first."""

CHUNK_CHOICES = (32, 16, 8)
"""New tokens per work unit, largest first (times the GQA group's query heads: the rows one
unit computes). A large unit amortises its transposed keys over more rows; small ones keep
every thread busy when a step has few new tokens (docs/engine.md, "AVX-512")."""


def chunk_tokens(new_tokens: list[int], kv_heads: int, threads: int) -> int:
    """Tokens per work unit for a batch whose sequences add ``new_tokens``: the largest choice
    that still gives every thread at least two units (the smallest when none does)."""
    for chunk in CHUNK_CHOICES:
        units = kv_heads * sum(-(-new // chunk) for new in new_tokens)
        if units >= 2 * threads:
            return chunk
    return CHUNK_CHOICES[-1]


@functools.cache
def _cpu_flags() -> frozenset[str]:
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        return frozenset()
    return frozenset(flags.split(":", 1)[1].split())


def cpu_isas() -> list[Isa]:
    """The builds this CPU can run, widest first."""
    return [isa for isa in ISAS if isa.cpu_flags <= _cpu_flags()]


def _cache_dir() -> Path:
    configured = os.environ.get("PDD_KERNEL_CACHE")
    return Path(configured) if configured else Path.home() / ".cache" / "pdd" / "kernels"


def _build(compiler: str, isa: Isa) -> Path:
    source = SOURCE.read_bytes()
    flags = (*CFLAGS, *isa.cflags)
    digest = hashlib.sha256(source + " ".join(flags).encode()).hexdigest()[:16]
    target = _cache_dir() / f"paged_attention-{isa.name}-{digest}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, partial = tempfile.mkstemp(dir=target.parent, suffix=".so.partial")
    os.close(fd)
    try:
        subprocess.run([compiler, *flags, str(SOURCE), "-o", partial, "-lm"], check=True, capture_output=True)
        os.replace(partial, target)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)
    return target


class PagedKernel:
    """The loaded kernel: ``attend`` runs one layer's attention for a whole packed batch.

    Attributes:
        isa: The build loaded.
    """

    def __init__(self, library: ctypes.CDLL, isa: Isa):
        lanes = library.pdd_paged_attention_lanes
        lanes.restype = ctypes.c_int
        if lanes() != isa.lanes:
            raise OSError(f"the {isa.name} build has {lanes()}-float vectors, not {isa.lanes}")
        self.isa = isa
        function = library.pdd_paged_attention
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        function.argtypes = [ptr, ptr, ptr, ptr, i64, i64, ptr, i64, ptr, i64, i64, i64, i64, ctypes.c_float, i64, i64]
        function.restype = ctypes.c_int
        self._function = function

    def supports(self, kv_pool_tensor: torch.Tensor, head_dim: int) -> bool:
        """Whether this build can read this pool (``KvPool.kv``) for this head size."""
        return (
            kv_pool_tensor.device.type == "cpu"
            and kv_pool_tensor.dtype == torch.float32
            and kv_pool_tensor.is_contiguous()
            and head_dim % self.isa.lanes == 0
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
        chunk: int = CHUNK_CHOICES[-1],
    ) -> torch.Tensor:
        """``[tokens, heads, head_dim]`` outputs of ``query`` (same shape, contiguous fp32).

        ``keys``/``values``: one layer's ``[kv_heads, num_blocks, block_size, head_dim]`` pool
        tensors; ``tables`` ``[sequences, width]`` and ``meta`` ``[sequences, 3]`` (query start,
        new tokens, context length), int64 and contiguous, checked by ``check_batch``; ``chunk``:
        new tokens per work unit (``chunk_tokens``). Rows of no sequence are left unset.
        """
        _, num_heads, head_dim = query.shape
        kv_heads, num_blocks, block_size = keys.shape[0], keys.shape[1], keys.shape[2]
        if not (
            query.is_contiguous()
            and query.dtype == torch.float32
            and all(t.dtype == torch.float32 and t.is_contiguous() for t in (keys, values))
            and keys.shape == values.shape
            and keys.shape[3] == head_dim
            and head_dim % self.isa.lanes == 0
        ):
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
    if tables.dim() != 2 or meta.dim() != 2 or meta.shape[1] != 3 or tables.shape[0] != meta.shape[0]:
        raise ValueError("paged kernel batch reads outside the pool or the packed tokens: tables and meta disagree")
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


SETTING = "PDD_PAGED_KERNEL"
CHOICES = ("1", "0", *(isa.name for isa in ISAS))


def kernel_setting() -> str:
    """``PDD_PAGED_KERNEL``, checked: ``1`` (also when unset or empty), ``0``, or a build's name."""
    choice = os.environ.get(SETTING, "").strip().lower() or "1"
    if choice not in CHOICES:
        raise ValueError(f"{SETTING}={os.environ[SETTING]!r}: expected one of {', '.join(CHOICES)}")
    return choice


def kernel_for(kv_pool_tensor: torch.Tensor, head_dim: int) -> PagedKernel | None:
    """The widest build ``PDD_PAGED_KERNEL`` allows that this CPU runs and that reads this pool
    at this head size; None if there is none (see the module docstring). Raises ValueError
    for a setting it does not know."""
    choice = kernel_setting()
    if choice == "0":
        return None
    for isa in cpu_isas():
        if choice not in ("1", isa.name):
            continue
        kernel = load(isa.name)
        if kernel is not None and kernel.supports(kv_pool_tensor, head_dim):
            return kernel
    # A pinned build that cannot run here is worth a warning; a CPU without AVX2 is not.
    report = log.info if choice == "1" else log.warning
    report("paged_kernel_unavailable", reason="no build fits", setting=choice, head_dim=head_dim)
    return None


@functools.cache
def load(isa_name: str) -> PagedKernel | None:
    """The build ``isa_name`` (``ISAS``), compiled if needed; None where the CPU lacks its
    instructions, there is no C compiler, or it does not compile."""
    isa = next((isa for isa in cpu_isas() if isa.name == isa_name), None)
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if compiler is None or isa is None:
        reason = "no C compiler" if compiler is None else f"the CPU lacks {isa_name}"
        log.info("paged_kernel_unavailable", reason=reason, isa=isa_name)
        return None
    try:
        kernel = PagedKernel(ctypes.CDLL(str(_build(compiler, isa))), isa)
    except (OSError, subprocess.CalledProcessError) as exc:
        stderr = getattr(exc, "stderr", b"") or b""
        log.warning(
            "paged_kernel_unavailable",
            isa=isa_name,
            reason=str(exc),
            compiler_output=stderr.decode(errors="replace")[-2000:],
        )
        return None
    log.info("paged_kernel_loaded", isa=isa_name)
    return kernel
