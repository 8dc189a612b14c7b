"""Shared fixtures: models are loaded once per session; references come from HF generate."""

import json

import pytest
import pytest_asyncio
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from shared.model_loader import LoadedModel, ModelMetadata, load_metadata, load_model
from shared.tracing import configure_tracing

_SPANS = InMemorySpanExporter()
configure_tracing("pdd-tests", exporter=_SPANS, batch=False)


@pytest.fixture(scope="session")
def tiny() -> LoadedModel:
    """The tiny random-weight Llama (fp32, fixed seed)."""
    return load_model("tiny")


@pytest.fixture(scope="session")
def tiny_metadata() -> ModelMetadata:
    """Tokenizer and geometry of the tiny model, as the router loads them."""
    return load_metadata("tiny")


@pytest.fixture(scope="session")
def smollm2() -> LoadedModel:
    """SmolLM2-135M-Instruct in fp32, from the converted cache."""
    return load_model("smollm2")


@pytest.fixture
def spans() -> InMemorySpanExporter:
    """Every span finished in this process (cleared before the test)."""
    _SPANS.clear()
    return _SPANS


@pytest_asyncio.fixture
async def make_stack(tiny, tiny_metadata):
    """Start two-site stacks on the tiny model; all are stopped after the test."""
    from infra.local_stack import LocalStack

    stacks = []

    async def start(**kwargs) -> LocalStack:
        kwargs.setdefault("router_settings", {})
        kwargs["router_settings"].setdefault("served_model_name", "tiny")
        stack = LocalStack(kwargs.pop("loaded", tiny), kwargs.pop("metadata", tiny_metadata), **kwargs)
        stacks.append(stack)
        return await stack.start()

    yield start
    for stack in stacks:
        await stack.stop()


@pytest.fixture(scope="session")
def tiny_deployment(tmp_path_factory):
    """``pdd up --detach --md 2 --routers 2`` on the tiny model (separate processes, locked down as shipped,
    serving SmolLM2's model id), started once for the tests that drive a real deployment; yields
    its run folder and ports (``--http-port``… → port). Tests may kill and restart its
    processes (the supervisor brings them back) but leave it serving."""
    import subprocess
    import sys
    from pathlib import Path

    from infra.launcher import load_state
    from infra.nats_server import free_port

    pdd = str(Path(sys.executable).parent / "pdd")
    run_dir = tmp_path_factory.mktemp("tiny-deployment")
    ports = {flag: free_port() for flag in ("--http-port", "--nats-a-port", "--nats-b-port", "--wan-control-port")}
    result = subprocess.run(
        [
            pdd,
            "up",
            "--detach",
            "--model",
            "tiny",
            "--md",
            "2",
            "--routers",
            "2",
            "--window",
            "4MiB",
            "--kv-cache-mb",
            "64",
            "--run-dir",
            str(run_dir),
            *[str(x) for kv in ports.items() for x in kv],
        ],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, result.stderr + result.stdout
    assert f"http://127.0.0.1:{ports['--http-port']}/v1" in result.stdout
    yield run_dir, ports
    # ``pdd down`` stops the services while NATS still serves their graceful stop: none logs an error.
    logged = {
        path: path.stat().st_size for path in (run_dir / "logs").glob("*.log") if not path.name.startswith("nats-")
    }
    stopped = subprocess.run([pdd, "down", "--run-dir", str(run_dir)], capture_output=True, text=True, timeout=120)
    assert stopped.returncode == 0, stopped.stderr
    assert load_state(run_dir) is None
    for path, size in logged.items():
        with path.open() as log:
            log.seek(size)
            lines = [json.loads(line) for line in log.read().splitlines() if line.strip()]
        errors = [line["event"] for line in lines if line.get("level") == "error"]
        assert not errors, f"{path.name} while stopping: {errors}"
