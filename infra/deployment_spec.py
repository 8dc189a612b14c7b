"""What ``pdd up`` deploys: one typed, immutable description of a two-site deployment.

``pdd up`` and ``pdd demo`` build it from their flags (:meth:`DeploymentSpec.from_args`, the
flags from :func:`add_up_arguments`, whose defaults are the spec's own). The benchmark, the
profile's calibration runs and ``pdd chaos --scenario redeploy`` build it directly and vary
a base with :func:`dataclasses.replace`. ``state.json`` records the spec a deployment was
started with (:meth:`~DeploymentSpec.to_dict`, read back by :meth:`~DeploymentSpec.from_dict`)
so that it can be started again as it was.
"""

import argparse
from dataclasses import asdict, dataclass, fields

from infra.cli_args import RUN_DIR_HELP
from infra.nats_server import SITE_A, SITE_B

PIPELINE_POLICIES = ("auto", "P-MD", "P-RLD-MD")
ENGINE_ROLES = ("prefill", "relay", "main")
"""The engine roles a backend can be chosen for: ``--prefill-engine``, ``--relay-engine``,
``--main-engine``."""
RENAMED = {"log_level": "service_log_level", "timeout": "timeout_s"}
"""Old names → fields: ``state.json`` written before the spec recorded ``pdd up``'s argparse
options (``up_args``) under their flag destinations."""


@dataclass(frozen=True)
class DeploymentSpec:
    """Everything ``pdd up`` is told: instance counts, model, engines, ports, link, placement.

    Attributes:
        run_dir: Folder for logs, NATS data and ``state.json`` (None: ``$PDD_RUN_DIR`` or
            ``<model cache>/run``; ``launcher.up`` records the folder it chose).
        prefill: Prefill instances.
        rld: Relay decode instances.
        md: Main decode instances.
        routers: Router instances, all on ``http_port`` (SO_REUSEPORT: the kernel spreads new
            connections over them; one address, no proxy).
        cache_index: Cache-index instances (a queue group: each holds the whole index and
            answers a share of the overlap queries; the others answer while one is down).
        model: ``smollm2``, ``tiny`` (random test model) or an HF model folder.
        kv_cache_mb: KV pool per engine instance, in MiB.
        engine: Engine backend of every engine service (``hf``, ``vllm``).
        prefill_engine: Backend of the prefill services only (None: ``engine``).
        relay_engine: Backend of the relay decode services only (None: ``engine``).
        main_engine: Backend of the main decode services only (None: ``engine``).
        block_size: Tokens per KV block on every instance (None: :meth:`kv_block_size` picks).
        http_port: The router's API port.
        nats_a_port: Site A's NATS client port.
        nats_b_port: Site B's NATS client port.
        wan_control_port: The WAN link's control API (and ``/metrics``) port.
        bandwidth: WAN bandwidth as the link reads it (``100mbit``, ``1gbit``, ``unlimited``).
        rtt: WAN round trip (``40ms``).
        jitter: WAN jitter (``5ms``).
        window: Most bytes one connection may have in flight across the link per direction
            (``4MiB``; ``0``: no limit), as TCP's window caps one stream over a long path.
        seed: The link's jitter and stall seed.
        service_log_level: The services' log level.
        timeout_s: How long ``launcher.up`` waits for every instance to be healthy.
        md_site: Where main decode runs (``site-a``: the same-site baseline, no WAN).
        pipeline_policy: ``auto`` (the router chooses per request), ``P-MD`` or ``P-RLD-MD``.
        md_prefix_cache: Main decode keeps its decode-side cache (False: the baseline without).
        insecure: No NATS identities and no TLS (only to measure what encryption costs).
        served_model_name: Model id the API serves (None: the services' default).
        api_key: API key(s), comma-separated, clients must send (None: ``$PDD_API_KEYS``).
        progress: Report what is still starting on stderr while waiting (the benchmark
            starts deployments quietly; no flag sets it).
    """

    run_dir: str | None = None
    prefill: int = 1
    rld: int = 1
    md: int = 1
    routers: int = 1
    cache_index: int = 1
    model: str = "smollm2"
    kv_cache_mb: int = 512
    engine: str = "hf"
    prefill_engine: str | None = None
    relay_engine: str | None = None
    main_engine: str | None = None
    block_size: int | None = None
    http_port: int = 8000
    nats_a_port: int = 4222
    nats_b_port: int = 4223
    wan_control_port: int = 8100
    bandwidth: str = "100mbit"
    rtt: str = "40ms"
    jitter: str = "5ms"
    window: str = "0"
    seed: int = 0
    service_log_level: str = "info"
    timeout_s: float = 180.0
    md_site: str = SITE_B
    pipeline_policy: str = "auto"
    md_prefix_cache: bool = True
    insecure: bool = False
    served_model_name: str | None = None
    api_key: str | None = None
    progress: bool = True

    def __post_init__(self):
        for name in ("routers", "cache_index"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} {getattr(self, name)!r}: expected at least 1 instance")
        if self.md_site not in (SITE_A, SITE_B):
            raise ValueError(f"md_site {self.md_site!r}: expected {SITE_A} or {SITE_B}")
        if self.pipeline_policy not in PIPELINE_POLICIES:
            raise ValueError(
                f"pipeline_policy {self.pipeline_policy!r}: expected one of {', '.join(PIPELINE_POLICIES)}"
            )

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "DeploymentSpec":
        """The spec ``pdd up``'s (or ``pdd demo``'s) parsed flags describe."""
        names = {f.name for f in fields(cls)}
        return cls(**{name: value for name, value in vars(args).items() if name in names})

    def to_dict(self) -> dict:
        """The spec as JSON-ready values (what ``state.json`` records)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, recorded: dict) -> "DeploymentSpec":
        """A spec from :meth:`to_dict`'s values, or from the ``up_args`` of an older
        ``state.json`` (old names renamed; what is not a field, such as ``detach``, is left out)."""
        names = {f.name for f in fields(cls)}
        renamed = {RENAMED.get(key, key): value for key, value in recorded.items()}
        return cls(**{name: value for name, value in renamed.items() if name in names})

    def role_engines(self) -> dict[str, str]:
        """The engine backend of each engine role: its own field, else ``engine``, else ``hf``."""
        default = self.engine or "hf"
        own = {"prefill": self.prefill_engine, "relay": self.relay_engine, "main": self.main_engine}
        return {role: own[role] or default for role in ENGINE_ROLES}

    def kv_block_size(self) -> int:
        """``block_size``, else 32 when any role runs vLLM (its CPU attention takes multiples of
        32), else 16."""
        if self.block_size:
            return self.block_size
        return 32 if "vllm" in self.role_engines().values() else 16


DEFAULT = DeploymentSpec()


def add_up_arguments(parser: argparse.ArgumentParser):
    """The flags of ``pdd up`` and ``pdd demo``: one per spec field but ``progress``, plus
    ``--detach`` (how ``pdd up`` itself behaves, not the deployment)."""
    parser.add_argument("--detach", action="store_true", help="return once healthy (up)")
    parser.add_argument("--prefill", type=int, default=DEFAULT.prefill, help="prefill instances")
    parser.add_argument("--rld", type=int, default=DEFAULT.rld, help="relay decode instances")
    parser.add_argument("--md", type=int, default=DEFAULT.md, help="main decode instances")
    parser.add_argument(
        "--routers",
        type=int,
        default=DEFAULT.routers,
        help="router instances, all behind --http-port (SO_REUSEPORT; they share the decoders' capacity)",
    )
    parser.add_argument(
        "--cache-index", type=int, default=DEFAULT.cache_index, help="cache-index instances (a queue group)"
    )
    parser.add_argument(
        "--model", default=DEFAULT.model, help="smollm2, tiny (random test model) or an HF model folder"
    )
    parser.add_argument("--kv-cache-mb", type=int, default=DEFAULT.kv_cache_mb, help="KV pool per engine instance")
    parser.add_argument("--engine", default=DEFAULT.engine, help="engine backend of every engine service (hf, vllm)")
    for role in ENGINE_ROLES:
        parser.add_argument(
            f"--{role}-engine", default=None, help=f"engine backend of the {role} services only (default: --engine)"
        )
    parser.add_argument(
        "--block-size",
        type=int,
        default=DEFAULT.block_size,
        help="tokens per KV block, on every instance (default 16; 32 when a vLLM engine runs: "
        "its CPU attention takes multiples of 32)",
    )
    parser.add_argument("--http-port", type=int, default=DEFAULT.http_port, help="the router's API port")
    parser.add_argument("--nats-a-port", type=int, default=DEFAULT.nats_a_port, help="site A's NATS client port")
    parser.add_argument("--nats-b-port", type=int, default=DEFAULT.nats_b_port, help="site B's NATS client port")
    parser.add_argument(
        "--wan-control-port",
        type=int,
        default=DEFAULT.wan_control_port,
        help="the WAN link's control API (and /metrics) port",
    )
    parser.add_argument("--bandwidth", default=DEFAULT.bandwidth, help="WAN bandwidth (default 100mbit)")
    parser.add_argument("--rtt", default=DEFAULT.rtt, help="WAN round trip (default 40ms)")
    parser.add_argument("--jitter", default=DEFAULT.jitter, help="WAN jitter (default 5ms)")
    parser.add_argument(
        "--window",
        default=DEFAULT.window,
        help="most bytes one connection may have in flight across the link per direction, e.g. 4MiB "
        "(default 0: no limit)",
    )
    parser.add_argument("--seed", type=int, default=DEFAULT.seed, help="jitter seed")
    parser.add_argument("--service-log-level", default=DEFAULT.service_log_level, help="the services' log level")
    parser.add_argument(
        "--timeout",
        dest="timeout_s",
        metavar="SECONDS",
        type=float,
        default=DEFAULT.timeout_s,
        help="seconds to wait for health",
    )
    parser.add_argument(
        "--md-site",
        default=DEFAULT.md_site,
        choices=[SITE_A, SITE_B],
        help="where main decode runs (site-a: the same-site baseline, no WAN)",
    )
    parser.add_argument(
        "--pipeline-policy",
        default=DEFAULT.pipeline_policy,
        choices=list(PIPELINE_POLICIES),
        help="auto: the router chooses per request; or force one pipeline",
    )
    parser.add_argument(
        "--no-md-prefix-cache",
        dest="md_prefix_cache",
        action="store_false",
        help="main decode without its decode-side cache (baseline)",
    )
    parser.add_argument(
        "--insecure",
        action="store_true",
        help="no NATS identities and no TLS (only to measure what encryption costs; "
        "never across networks you do not own)",
    )
    parser.add_argument(
        "--served-model-name",
        default=DEFAULT.served_model_name,
        help="model id the API serves (default: HuggingFaceTB/SmolLM2-135M-Instruct)",
    )
    parser.add_argument(
        "--api-key",
        default=DEFAULT.api_key,
        help="API key(s), comma-separated, clients must send (default: $PDD_API_KEYS; none)",
    )
    parser.add_argument("--run-dir", default=DEFAULT.run_dir, help=RUN_DIR_HELP)
