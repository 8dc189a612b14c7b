"""Model sources: the SmolLM2 cache, HF folders, the tiny test model, dtype and errors."""

import pytest
import torch

from shared.errors import ModelLoadError
from shared.model_loader import (
    ensure_smollm2_converted,
    load_model,
    model_cache_dir,
    smollm2_gguf_path,
)


def test_tiny_model_is_deterministic(tiny):
    again = load_model("tiny")
    assert again.fingerprint == tiny.fingerprint
    for a, b in zip(tiny.model.parameters(), again.model.parameters()):
        assert torch.equal(a, b)


def test_bfloat16_instance_has_same_fingerprint(tiny):
    bf16 = load_model("tiny", dtype="bfloat16")
    assert bf16.dtype == torch.bfloat16
    assert next(bf16.model.parameters()).dtype == torch.bfloat16
    assert bf16.fingerprint == tiny.fingerprint


@pytest.mark.real_model
def test_smollm2_comes_from_the_wheel_and_the_cache(smollm2):
    assert smollm2_gguf_path().name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    folder = ensure_smollm2_converted()
    assert folder.is_relative_to(model_cache_dir())
    assert (folder / "model.safetensors").is_file()
    assert smollm2.model.config.num_hidden_layers == 30
    assert smollm2.tokenizer.chat_template
    assert smollm2.eos_token_ids == {smollm2.tokenizer.convert_tokens_to_ids("<|im_end|>")}


@pytest.mark.real_model
def test_any_hf_folder_loads_like_smollm2(smollm2):
    from_folder = load_model(str(ensure_smollm2_converted()))
    assert from_folder.fingerprint == smollm2.fingerprint


@pytest.mark.real_model
def test_different_weights_have_different_fingerprints(tiny, smollm2):
    assert tiny.fingerprint != smollm2.fingerprint


def test_bad_sources_and_dtypes_are_named(tmp_path):
    with pytest.raises(ModelLoadError, match="not 'smollm2', 'tiny' or an HF folder"):
        load_model(str(tmp_path / "missing"))
    with pytest.raises(ModelLoadError, match="dtype"):
        load_model("tiny", dtype="float64")
