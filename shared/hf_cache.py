"""Place the served model's tokenizer in the Hugging Face cache under its hub id.

Benchmark clients (aiperf, guidellm) and eval harnesses load a tokenizer by the model id the
server reports. With the files in the hub cache's own layout, ``AutoTokenizer.from_pretrained
("HuggingFaceTB/SmolLM2-135M-Instruct")`` finds them with ``HF_HUB_OFFLINE=1``, on a machine
that cannot reach the hub.
"""

import hashlib
import os
import shutil
from pathlib import Path

SMOLLM2_HF_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
"""SmolLM2's Hugging Face id: the name the API serves it under (the tiny test model too, which
uses its tokenizer), so clients that load a tokenizer by model name find it."""
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "config.json",
    "generation_config.json",
)
"""What a tokenizer load reads (config.json names the tokenizer class for AutoTokenizer)."""


def hub_cache_dir() -> Path:
    """The hub cache transformers reads: ``$HF_HUB_CACHE``, else ``$HF_HOME/hub``, else ~/.cache/huggingface/hub."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = Path(os.environ.get("HF_HOME", Path.home() / ".cache" / "huggingface")).expanduser()
    return home / "hub"


def install_tokenizer(folder: Path, repo_id: str, hub_cache: Path | None = None) -> Path:
    """Copy ``folder``'s tokenizer files into the hub cache as ``repo_id``'s ``main`` revision.

    The revision is named by a digest of the files, so installing the same files twice is a
    no-op and a changed tokenizer gets a new snapshot.

    Returns:
        The snapshot folder.
    """
    files = [folder / name for name in TOKENIZER_FILES if (folder / name).is_file()]
    if not any(f.name == "tokenizer.json" for f in files):
        raise FileNotFoundError(f"{folder} holds no tokenizer.json")
    digest = hashlib.sha1()
    for path in files:
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    revision = digest.hexdigest()
    repo = (hub_cache or hub_cache_dir()) / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / revision
    snapshot.mkdir(parents=True, exist_ok=True)
    for path in files:
        shutil.copyfile(path, snapshot / path.name)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(revision)
    return snapshot


def model_cache_dir() -> Path:
    """The folder converted models are kept in (``$PDD_CACHE_DIR`` or ``~/.cache/pdd``)."""
    return Path(os.environ.get("PDD_CACHE_DIR", Path.home() / ".cache" / "pdd")).expanduser()
