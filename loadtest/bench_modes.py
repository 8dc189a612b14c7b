"""The benchmark's modes and the fresh deployment each runs on (``pdd bench run``, and the
profile's calibration runs, which must deploy exactly as the benchmark does)."""

import argparse
import tempfile
from contextlib import contextmanager
from pathlib import Path

from infra import launcher
from infra.nats_server import free_port

MODES = {
    "same-site": {"md_site": "site-a", "pipeline_policy": "P-MD", "md_prefix_cache": True},
    "cross-site-pd": {"md_site": "site-b", "pipeline_policy": "P-MD", "md_prefix_cache": False},
    "cross-site-pd-drc": {"md_site": "site-b", "pipeline_policy": "P-MD", "md_prefix_cache": True},
    "pdd": {"md_site": "site-b", "pipeline_policy": "auto", "md_prefix_cache": True},
    "pdd-plaintext": {"md_site": "site-b", "pipeline_policy": "auto", "md_prefix_cache": True, "insecure": True},
}
DEFAULT_MODES = ["same-site", "cross-site-pd", "cross-site-pd-drc", "pdd"]
"""The paper's comparison; ``pdd-plaintext`` (PDD without TLS or NATS identities) is run on
request, beside ``pdd``, to measure what encryption costs."""


@contextmanager
def mode_deployment(mode: str, args):
    """A fresh deployment for ``mode`` (one instance of each service, ``args``' model, pool and
    link), stopped on exit."""
    run_dir = Path(tempfile.mkdtemp(prefix=f"pdd-bench-{mode}-"))
    up_args = argparse.Namespace(
        run_dir=str(run_dir),
        prefill=1,
        rld=1,
        md=1,
        model=args.model,
        kv_cache_mb=args.kv_cache_mb,
        http_port=free_port(),
        nats_a_port=free_port(),
        nats_b_port=free_port(),
        wan_control_port=free_port(),
        bandwidth=args.bandwidth,
        rtt=args.rtt,
        jitter=args.jitter,
        seed=args.seed,
        log_level="warning",
        timeout=600.0 if getattr(args, "engine", "hf") == "vllm" else 300.0,
        progress=False,
        engine=getattr(args, "engine", "hf"),
        **MODES[mode],
    )
    deployment = launcher.up(up_args)
    try:
        yield deployment
    finally:
        launcher.down(run_dir, quiet=True)
