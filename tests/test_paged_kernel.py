"""The in-place paged attention kernel against SDPA over the same K/V, gathered."""

import shutil

import pytest
import torch
import torch.nn.functional as F

from shared.engine import paged_kernel
from shared.engine.paged_kernel import check_batch


@pytest.fixture(scope="module", params=[isa.name for isa in paged_kernel.cpu_isas()] or ["none"])
def kernel(request):
    """Each build of the kernel this CPU can run (AVX-512 and AVX2 on an AVX-512 machine)."""
    if request.param == "none":
        pytest.skip("this CPU runs no build of the kernel (no AVX2/FMA): the engine runs gather + SDPA")
    loaded = paged_kernel.load(request.param)
    if loaded is None and shutil.which("cc"):
        pytest.fail(f"a C compiler and {request.param} are here, yet the kernel did not build (see the log)")
    if loaded is None:
        pytest.skip("no C compiler: the engine runs gather + SDPA (tested with the engine)")
    return loaded


def sdpa_reference(query, pool, tables, meta, block_size, scale):
    """Each sequence alone: its blocks gathered, SDPA with a bottom-right causal mask."""
    kv_heads, head_dim = pool.shape[1], pool.shape[4]
    out = torch.full_like(query, float("nan"))
    for row, (start, new, context) in enumerate(meta.tolist()):
        blocks = tables[row, : -(-context // block_size)]
        keys = pool[0][:, blocks].reshape(kv_heads, -1, head_dim)[:, :context]
        values = pool[1][:, blocks].reshape(kv_heads, -1, head_dim)[:, :context]
        visible = torch.arange(context)[None, :] <= (context - new + torch.arange(new))[:, None]
        attended = F.scaled_dot_product_attention(
            query[start : start + new].transpose(0, 1)[None],
            keys[None],
            values[None],
            attn_mask=visible,
            scale=scale,
            enable_gqa=True,
        )
        out[start : start + new] = attended[0].transpose(0, 1)
    return out


def batch_of(shapes, num_blocks, block_size, generator):
    """Shuffled block tables and (start, new, context) rows for ``shapes`` of (new, context)."""
    width = max(-(-context // block_size) for _, context in shapes)
    order = torch.randperm(num_blocks, generator=generator)[: len(shapes) * width]
    meta, start = [], 0
    for new, context in shapes:
        meta.append((start, new, context))
        start += new
    return order.view(len(shapes), width).contiguous(), torch.tensor(meta, dtype=torch.long), start


@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim"),
    [(9, 3, 64), (4, 2, 16), (8, 8, 32), (6, 2, 48), (4, 1, 24)],
)
@pytest.mark.parametrize(
    "shapes",
    [
        [(1, 1)],  # a first decode step over one token
        [(1, 1000), (1, 17), (1, 33)],  # decodes of different lengths, partial last blocks
        [(37, 37), (5, 5)],  # prompts with nothing cached (causal)
        [(3, 40), (1, 5), (100, 1124), (16, 16), (1, 300)],  # every kind of work in one batch
    ],
)
@pytest.mark.parametrize("chunk", [1, 8, 32])
def test_kernel_matches_sdpa_over_the_gathered_blocks(kernel, heads, kv_heads, head_dim, shapes, chunk):
    """Decodes read K rows in place, multi-token sequences a transposed copy of their unit's
    keys; either way, in units of any size, each row is SDPA's over the same keys. A head size
    that is not a whole number of the build's vectors is refused, never computed."""
    assert_matches_sdpa(kernel, heads, kv_heads, head_dim, shapes, chunk, block_size=16)


@pytest.mark.parametrize("block_size", [8, 12, 24, 32])
def test_kernel_matches_sdpa_whatever_the_block_size(kernel, block_size):
    """Keys are transposed eight at a time, each eight found through the block table, so blocks
    smaller or not a multiple of the vector width give the same rows; blocks that are not a
    multiple of eight (12) are read in place instead, and give them too."""
    shapes = [(3, 40), (1, 5), (100, 1124), (16, 16), (1, 300), (9, 9)]
    assert_matches_sdpa(kernel, 9, 3, 64, shapes, chunk=8, block_size=block_size)


def assert_matches_sdpa(kernel, heads, kv_heads, head_dim, shapes, chunk, block_size):
    generator = torch.Generator().manual_seed(len(shapes) * head_dim + heads + block_size)
    num_blocks = 12800 // block_size
    pool = torch.randn(2, kv_heads, num_blocks, block_size, head_dim, generator=generator)
    tables, meta, num_tokens = batch_of(shapes, num_blocks, block_size, generator)
    query = torch.randn(num_tokens, heads, head_dim, generator=generator)
    scale = head_dim**-0.5
    if not kernel.supports(pool[0], head_dim):
        assert head_dim % kernel.isa.lanes != 0
        with pytest.raises(ValueError, match="does not fit"):
            kernel.attend(query, pool[0], pool[1], tables, meta, scale, chunk)
        return
    out = kernel.attend(query, pool[0], pool[1], tables, meta, scale, chunk)
    torch.testing.assert_close(out, sdpa_reference(query, pool, tables, meta, block_size, scale), rtol=1e-5, atol=2e-6)


def test_kernel_result_is_the_same_alone_and_in_a_batch(kernel):
    """A sequence's rows do not depend on what else is in the step (bit for bit)."""
    generator = torch.Generator().manual_seed(7)
    pool = torch.randn(2, 3, 128, 16, 64, generator=generator)
    tables, meta, num_tokens = batch_of([(1, 500), (7, 90), (1, 64)], 128, 16, generator)
    query = torch.randn(num_tokens, 9, 64, generator=generator)
    together = kernel.attend(query, pool[0], pool[1], tables, meta, 0.125)
    alone = kernel.attend(query[1:8].contiguous(), pool[0], pool[1], tables[1:2], torch.tensor([[0, 7, 90]]), 0.125)
    assert torch.equal(together[1:8], alone)


def test_a_nan_in_the_context_comes_out_as_nan_as_sdpa_gives_it(kernel):
    """Corrupt K inside a sequence's context shows in its output, as through SDPA; the same
    value past the context (the rest of its last block) changes nothing."""
    generator = torch.Generator().manual_seed(3)
    pool = torch.randn(2, 3, 8, 16, 64, generator=generator)
    tables, meta = torch.tensor([[2, 5]]), torch.tensor([[0, 1, 20]])
    query = torch.randn(1, 9, 64, generator=generator)
    clean = kernel.attend(query, pool[0], pool[1], tables, meta, 0.125)
    pool[0, 1, 5, 10, 7] = float("nan")  # key 26 of kv head 1: past the context of 20
    assert torch.equal(kernel.attend(query, pool[0], pool[1], tables, meta, 0.125), clean)
    pool[0, 1, 5, 3, 7] = float("nan")  # key 19 of kv head 1: inside it
    out = kernel.attend(query, pool[0], pool[1], tables, meta, 0.125)
    reference = sdpa_reference(query, pool, tables, meta, 16, 0.125)
    assert torch.equal(out.isnan(), reference.isnan()) and out[0, 3:6].isnan().all()
    assert torch.equal(out[0, :3], clean[0, :3]) and torch.equal(out[0, 6:], clean[0, 6:])


@pytest.mark.parametrize(
    ("table", "row", "reason"),
    [
        ([[0, 1, 999]], [0, 1, 40], "block id past the pool"),
        ([[0, -1, 2]], [0, 1, 40], "negative block id"),
        ([[0, 1, 2]], [0, 1, 49], "context longer than the table"),
        ([[0, 1, 2]], [3, 2, 40], "queries past the packed tokens"),
        ([[0, 1, 2]], [0, 0, 40], "no query"),
        ([[0, 1, 2]], [0, 5, 4], "more new tokens than context"),
    ],
)
def test_a_batch_reading_outside_the_pool_is_refused_before_the_kernel_runs(table, row, reason):
    with pytest.raises(ValueError, match="outside"):
        check_batch(torch.tensor(table), torch.tensor([row]), num_tokens=4, num_blocks=64, block_size=16)


@pytest.mark.parametrize(
    ("tables", "meta"),
    [
        ([[0, 1]], [[0, 1, 20], [1, 1, 20]]),  # a sequence without a block table
        ([[0, 1], [2, 3]], [[0, 1, 20]]),  # a table without a sequence
        ([[0, 1]], [[0, 1]]),  # rows without a context length
    ],
)
def test_tables_and_rows_that_disagree_are_refused(tables, meta):
    with pytest.raises(ValueError, match="outside"):
        check_batch(torch.tensor(tables), torch.tensor(meta), num_tokens=2, num_blocks=4, block_size=16)


def test_keys_and_values_of_another_shape_or_type_are_refused(kernel):
    pool = torch.zeros(2, 3, 8, 16, 64)
    tables, meta, query = torch.tensor([[0]]), torch.tensor([[0, 1, 1]]), torch.zeros(1, 9, 64)
    with pytest.raises(ValueError, match="does not fit"):
        kernel.attend(query, pool[0], pool[1, :, :4].contiguous(), tables, meta, 0.125)
    with pytest.raises(ValueError, match="does not fit"):
        kernel.attend(query, pool[0], pool[1].double(), tables, meta, 0.125)
    with pytest.raises(ValueError, match="does not fit"):
        kernel.attend(query, pool[0].transpose(1, 2), pool[1], tables, meta, 0.125)


@pytest.mark.parametrize(
    ("new_tokens", "threads", "chunk"),
    [
        ([1, 1, 1, 1], 2, 32),  # decodes: one unit each whatever the size
        ([16], 2, 8),  # 3 kv heads x 2 units of 8 keep two threads busy, units of 16 would not
        ([32], 2, 16),
        ([64], 2, 32),
        ([16], 1, 32),  # one thread needs two units only: one per kv head is enough
        ([1], 2, 8),  # nothing fills two threads: the smallest units
    ],
)
def test_work_units_are_the_largest_that_keep_every_thread_busy(new_tokens, threads, chunk):
    assert paged_kernel.chunk_tokens(new_tokens, kv_heads=3, threads=threads) == chunk


@pytest.mark.parametrize("setting", ["", "1", "0", "avx2", "avx512", "AVX2", "2", "true"])
def test_the_setting_picks_a_build_or_names_itself_when_wrong(monkeypatch, setting):
    monkeypatch.setenv("PDD_PAGED_KERNEL", setting)
    pool, isas = torch.zeros(2, 1, 2, 16, 64), [isa.name for isa in paged_kernel.cpu_isas()]
    if setting.lower() not in ("", "1", "0", "avx2", "avx512"):
        with pytest.raises(ValueError, match="PDD_PAGED_KERNEL"):
            paged_kernel.kernel_for(pool[0], 64)
        return
    kernel = paged_kernel.kernel_for(pool[0], 64)
    if setting == "0" or not isas or (setting.lower() not in ("", "1") and setting.lower() not in isas):
        assert kernel is None
    elif setting in ("", "1"):
        assert kernel is not None and kernel.isa.name == isas[0]  # the widest this CPU has
    else:
        assert kernel is not None and kernel.isa.name == setting.lower()


def test_a_head_size_the_wide_build_cannot_take_falls_back_to_the_narrow_one(monkeypatch):
    monkeypatch.delenv("PDD_PAGED_KERNEL", raising=False)
    if [isa.name for isa in paged_kernel.cpu_isas()] != ["avx512", "avx2"]:
        pytest.skip("needs a CPU with both builds")
    pool = torch.zeros(2, 1, 2, 16, 24)
    assert paged_kernel.kernel_for(pool[0], 24).isa.name == "avx2"


def test_a_query_that_does_not_fit_the_pool_is_refused(kernel):
    pool = torch.zeros(2, 3, 8, 16, 64)
    tables, meta = torch.tensor([[0]]), torch.tensor([[0, 1, 1]])
    with pytest.raises(ValueError, match="does not fit"):
        kernel.attend(torch.zeros(1, 9, 32), pool[0], pool[1], tables, meta, 0.125)
    with pytest.raises(ValueError, match="does not fit"):
        kernel.attend(torch.zeros(1, 9, 64, dtype=torch.float64), pool[0], pool[1], tables, meta, 0.125)
