"""The benchmark's modes and the fresh deployment each runs on (``pdd bench run``, and the
profile's calibration runs, which must deploy exactly as the benchmark does)."""

import tempfile
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

from infra import launcher
from infra.deployment_spec import DeploymentSpec
from infra.nats_server import free_port

MODES = {
    "same-site": {"md_site": "site-a", "pipeline_policy": "P-MD", "md_prefix_cache": True},
    "cross-site-pd": {"md_site": "site-b", "pipeline_policy": "P-MD", "md_prefix_cache": False},
    "cross-site-pd-drc": {"md_site": "site-b", "pipeline_policy": "P-MD", "md_prefix_cache": True},
    "pdd": {"md_site": "site-b", "pipeline_policy": "auto", "md_prefix_cache": True},
    "pdd-plaintext": {"md_site": "site-b", "pipeline_policy": "auto", "md_prefix_cache": True, "insecure": True},
}
"""Mode → the spec fields it sets on :data:`BENCH_SPEC` (or a variant of it)."""
DEFAULT_MODES = ["same-site", "cross-site-pd", "cross-site-pd-drc", "pdd"]
"""The paper's comparison; ``pdd-plaintext`` (PDD without TLS or NATS identities) is run on
request, beside ``pdd``, to measure what encryption costs."""

BENCH_SPEC = DeploymentSpec(service_log_level="warning", timeout_s=300.0, progress=False, window="4MiB")
"""What every benchmark deployment shares: one instance of each service, ``pdd up``'s model,
pool and link unless a run says otherwise, with a 4 MiB window per connection on the link (one
TCP stream's cap over a real long path: this host's ``tcp_wmem`` maximum), quiet services, five
minutes to become healthy."""


def bench_spec(args) -> DeploymentSpec:
    """:data:`BENCH_SPEC` with ``pdd bench run``'s model, engine, pool and link (vLLM gets ten
    minutes to become healthy)."""
    return replace(
        BENCH_SPEC,
        model=args.model,
        engine=args.engine,
        kv_cache_mb=args.kv_cache_mb,
        bandwidth=args.bandwidth,
        rtt=args.rtt,
        jitter=args.jitter,
        window=getattr(args, "window", BENCH_SPEC.window),
        seed=args.seed,
        timeout_s=600.0 if args.engine == "vllm" else BENCH_SPEC.timeout_s,
    )


def mode_spec(mode: str, base: DeploymentSpec) -> DeploymentSpec:
    """``base`` deployed as ``mode``, in a fresh run folder, on free ports."""
    return replace(
        base,
        run_dir=tempfile.mkdtemp(prefix=f"pdd-bench-{mode}-"),
        http_port=free_port(),
        nats_a_port=free_port(),
        nats_b_port=free_port(),
        wan_control_port=free_port(),
        **MODES[mode],
    )


@contextmanager
def deployed(spec: DeploymentSpec):
    """``spec`` up (its deployment yielded), stopped on exit."""
    deployment = launcher.up(spec)
    try:
        yield deployment
    finally:
        launcher.down(Path(deployment.run_dir), quiet=True)


@contextmanager
def mode_deployment(mode: str, args):
    """A fresh deployment for ``mode`` with ``pdd bench run``'s ``args`` (:func:`bench_spec`),
    stopped on exit."""
    with deployed(mode_spec(mode, bench_spec(args))) as deployment:
        yield deployment
