"""The model runner's packed, paged forward pass gives transformers' own logits."""

import pytest
import torch
from transformers import LlamaForCausalLM
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from shared.engine import attention, llama_forward, paged_kernel
from shared.engine.block_manager import BlockManager
from shared.engine.hf_engine import HfEngine
from shared.engine.kv_pool import KvPool
from shared.engine.model_runner import ModelRunner, ScheduledSequence
from shared.engine.prefix_cache import PrefixCache
from shared.engine.sampling import SamplingParams
from shared.engine.sequence import Sequence
from shared.kv_layout import KvLayout
from shared.model_loader import LoadedModel, tiny_config
from tests.helpers import prompt_of_length, reference_greedy


def sequence_with_blocks(rid: str, prompt: list[int], blocks: BlockManager, block_size: int) -> Sequence:
    seq = Sequence(rid, prompt, len(prompt), SamplingParams(), seed=0)
    seq.block_ids = blocks.allocate(-(-len(prompt) // block_size))
    return seq


def test_two_prompts_packed_in_one_pass_match_separate_transformers_passes(tiny):
    layout = KvLayout.from_model(tiny.model, 16)
    pool = KvPool(layout, 32, tiny.device)
    blocks = BlockManager(32, PrefixCache())
    runner = ModelRunner(tiny, layout, pool)
    prompts = [prompt_of_length(tiny, 40, seed=1), prompt_of_length(tiny, 23, seed=2)]
    batch = [
        ScheduledSequence(sequence_with_blocks(f"r{i}", p, blocks, 16), len(p), samples=True)
        for i, p in enumerate(prompts)
    ]
    logits = runner.run(batch)
    for row, prompt in enumerate(prompts):
        with torch.inference_mode():
            reference = tiny.model(input_ids=torch.tensor([prompt])).logits[0, -1]
        torch.testing.assert_close(logits[row], reference, rtol=1e-4, atol=1e-4)


def test_a_chunk_that_does_not_sample_still_writes_the_kv_the_next_chunk_reads(tiny):
    layout = KvLayout.from_model(tiny.model, 16)
    pool = KvPool(layout, 16, tiny.device)
    runner = ModelRunner(tiny, layout, pool)
    prompt = prompt_of_length(tiny, 48, seed=3)
    seq = sequence_with_blocks("r", prompt, BlockManager(16, PrefixCache()), 16)
    runner.run([ScheduledSequence(seq, 32, samples=False)])
    seq.num_kv_tokens = 32
    logits = runner.run([ScheduledSequence(seq, 16, samples=True)])
    with torch.inference_mode():
        reference = tiny.model(input_ids=torch.tensor([prompt])).logits[0, -1]
    torch.testing.assert_close(logits[0], reference, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    ("in_place", "gather_budget_bytes", "lean"),
    [
        (True, attention.GATHER_BUDGET_BYTES, True),
        (True, attention.GATHER_BUDGET_BYTES, False),
        (False, attention.GATHER_BUDGET_BYTES, True),
        (False, 1, True),
        (False, attention.GATHER_BUDGET_BYTES, False),
    ],
)
def test_decodes_chunks_over_cached_context_and_a_fresh_prompt_in_one_pass_match_transformers(
    smollm2, in_place, gather_budget_bytes, lean, monkeypatch
):
    """One forward holds every kind of work a step can mix: decodes at different context lengths
    (padded to the longest), two chunks of different sizes over cached prefixes (queries padded),
    and a prompt with nothing cached; each sampling row gives transformers' last-token logits.
    SmolLM2, since the tiny model's near one-hot attention would pass with a wrong mask. Through
    the in-place kernel (one call for all) or gather + SDPA; with a 1-byte gather budget every
    sequence gets its own SDPA call; the logits are the same, and the same through HF's forward
    (``lean=False``) as through the lean one."""
    monkeypatch.setattr(attention, "GATHER_BUDGET_BYTES", gather_budget_bytes)
    if not in_place:
        monkeypatch.setenv("PDD_PAGED_KERNEL", "0")
    elif not any(paged_kernel.load(isa.name) for isa in paged_kernel.cpu_isas()):
        pytest.skip("the in-place kernel cannot be built here")
    layout = KvLayout.from_model(smollm2.model, 16)
    pool = KvPool(layout, 64, smollm2.device)
    blocks = BlockManager(64, PrefixCache())
    runner = ModelRunner(smollm2, layout, pool, lean=lean)
    assert (runner.lean is not None) == lean
    assert (runner.kernel is not None) == in_place
    # (prompt length, tokens already in the pool): decodes, chunks over cached context, a fresh prompt.
    shapes = [(37, 36), (70, 69), (50, 17), (61, 48), (29, 0)]
    prompts = [prompt_of_length(smollm2, length, seed=10 + i) for i, (length, _) in enumerate(shapes)]
    seqs = [sequence_with_blocks(f"r{i}", p, blocks, 16) for i, p in enumerate(prompts)]
    for seq, (_, cached) in zip(seqs, shapes, strict=True):
        if cached:
            runner.run([ScheduledSequence(seq, cached, samples=False)])
            seq.num_kv_tokens = cached
    logits = runner.run(
        [
            ScheduledSequence(seq, length - cached, samples=True)
            for seq, (length, cached) in zip(seqs, shapes, strict=True)
        ]
    )
    for row, prompt in enumerate(prompts):
        with torch.inference_mode():
            reference = smollm2.model(input_ids=torch.tensor([prompt])).logits[0, -1]
        torch.testing.assert_close(logits[row], reference, rtol=1e-4, atol=1e-4)


def test_a_llama_outside_the_lean_forward_runs_hf_forward_and_matches_generate(tiny):
    """A Llama with q/k/v biases is not what the lean forward computes: the engine runs the
    model's own HF forward with paged attention, and greedy output is still transformers'."""
    config = tiny_config(tiny.tokenizer)
    config.attention_bias = True
    torch.manual_seed(1)
    model = LlamaForCausalLM(config).eval()
    model.generation_config.pad_token_id = tiny.tokenizer.pad_token_id
    loaded = LoadedModel("tiny-bias", model, tiny.tokenizer, "bias", tiny.device, torch.float32)
    engine = HfEngine(loaded, num_blocks=32)
    prompt = prompt_of_length(loaded, 37, seed=4)
    output = engine.generate("r", prompt, SamplingParams(max_tokens=24, ignore_eos=True))
    assert engine.runner.lean is None
    assert output == reference_greedy(loaded, prompt, 24)


def test_the_lean_forwards_norm_and_rotation_give_hf_modules_bits(smollm2):
    """The lean forward's RMSNorm (torch's fused ``rms_norm``) and its one rotation over q's
    and k's heads together give the same bits as HF's ``LlamaRMSNorm`` and
    ``apply_rotary_pos_emb`` on q and k apart, at a decode's, an extend's and a prompt's rows."""
    model = smollm2.model
    layer = model.model.layers[0]
    config = model.config
    heads, kv_heads, dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    generator = torch.Generator().manual_seed(0)
    for tokens in (1, 100, 1024):
        hidden = torch.randn(tokens, config.hidden_size, generator=generator) * 4
        norm = layer.input_layernorm
        assert torch.equal(llama_forward._rms_norm(hidden, norm.weight, norm.variance_epsilon), norm(hidden))
        positions = torch.arange(tokens)[None]
        cos, sin = model.model.rotary_emb(hidden, positions)
        q = torch.randn(1, heads, tokens, dim, generator=generator)
        k = torch.randn(1, kv_heads, tokens, dim, generator=generator)
        hf_q, hf_k = apply_rotary_pos_emb(q, k, cos, sin)
        qk = torch.cat([q, k], dim=1)[0].transpose(0, 1)  # [tokens, heads + kv_heads, dim]
        ours = llama_forward._rotate(qk, cos[0, :, None, :], sin[0, :, None, :])
        assert torch.equal(ours[:, :heads], hf_q[0].transpose(0, 1))
        assert torch.equal(ours[:, heads:], hf_k[0].transpose(0, 1))


@pytest.mark.parametrize("over_parts", [True, False])
def test_one_row_products_either_way_stay_close_to_hf_projections_and_over_parts_give_their_bits(smollm2, over_parts):
    """A batch-1 decode step's q/k/v and gate/up products over the model's own weights give HF's
    ``nn.Linear`` bits; through the packed concatenation, as several rows always go, they stay
    within fp32 summation-order differences."""
    layer = smollm2.model.model.layers[0]
    attn, mlp = layer.self_attn, layer.mlp
    generator = torch.Generator().manual_seed(0)
    for parts in ([attn.q_proj, attn.k_proj, attn.v_proj], [mlp.gate_proj, mlp.up_proj], [attn.o_proj]):
        product = llama_forward.PackedLinear([part.weight for part in parts])
        product.one_row_over_parts = over_parts
        for rows in (1, 4, 100):
            x = torch.randn(rows, parts[0].in_features, generator=generator)
            with torch.inference_mode():
                hf = torch.cat([part(x) for part in parts], dim=-1)
                ours = product(x)
            if rows == 1 and over_parts:
                assert torch.equal(ours, hf)
            else:
                torch.testing.assert_close(ours, hf, rtol=1e-4, atol=1e-4)  # summation order


@pytest.mark.parametrize("over_parts", [True, False])
def test_batch_one_decoding_is_greedy_exact_on_either_one_row_path(smollm2, over_parts):
    """Whichever way the load-time timing picks for one-row products, a batch-1 decode gives
    transformers' greedy tokens; the timing's choice is what every product then uses."""
    engine = HfEngine(smollm2, num_blocks=32)
    lean = engine.runner.lean
    assert lean is not None
    chosen = lean.one_row_path
    assert chosen["over_parts"] == (chosen["parts_ms"] < chosen["packed_ms"])
    assert {p.one_row_over_parts for p in lean.products} == {chosen["over_parts"]}
    for product in lean.products:
        product.one_row_over_parts = over_parts
    prompt = prompt_of_length(smollm2, 45, seed=8)
    assert engine.generate("r", prompt, SamplingParams(max_tokens=24, ignore_eos=True)) == reference_greedy(
        smollm2, prompt, 24
    )
