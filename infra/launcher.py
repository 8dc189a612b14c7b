"""``pdd up`` / ``pdd down`` / ``pdd status``: the two-site deployment as local processes.

Topology (the same as docker-compose.yml): site A runs nats-a, the router, prefill,
relay decode and the cache-index; site B runs nats-b and main decode; the WAN link process
carries the leafnode (B → A) and every P → MD bulk path. Each service instance is its own
process with its own log under the run folder; ``state.json`` there lets ``pdd down`` and
``pdd status`` find them. A supervisor process (``infra/supervisor.py``) restarts any of them
that exits, with back-off; ``pdd restart NAME`` restarts one by hand (the NATS servers and the
WAN link included).
"""

import asyncio
import contextlib
import fcntl
import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from infra.credentials import PEER_OF_ROLE, Credentials, ensure_credentials
from infra.http_probe import get_json, http_ok
from infra.nats_server import (
    SITE_A,
    SITE_B,
    NatsSite,
    free_port,
    leafnode_count,
    nats_server_binary,
    start_nats,
    wait_until,
)
from infra.streams import create_site_streams
from shared.errors import PddError
from shared.model_loader import model_cache_dir
from shared.nats_roles import ADMIN

TOPOLOGY = {
    "nats-a": (SITE_A,),
    "nats-b": (SITE_B,),
    "wan-link": (SITE_A, SITE_B),
    "cache-index": (SITE_A,),
    "prefill": (SITE_A,),
    "relay-decode": (SITE_A,),
    "main-decode": (SITE_B,),
    "router": (SITE_A,),
}
"""Process kinds (instances get a ``-N`` suffix) and the sites they sit in; docker-compose.yml
has one service per kind on the same networks."""

SERVICE_OF = {
    "cache-index": "cache_index",
    "prefill": "prefill",
    "relay-decode": "relay_decode",
    "main-decode": "main_decode",
    "router": "router",
}
"""The ``pdd serve`` service each process kind runs."""


class LauncherError(PddError):
    """The deployment could not be started, found or stopped."""

    code = "launcher_error"


@dataclass
class Deployment:
    """What ``state.json`` records about a running deployment.

    Attributes:
        run_dir: Folder with logs, NATS data and this state.
        router_url: OpenAI base URL.
        wan_control_url: URL of the WAN link's control API.
        processes: Name → pid of every process started.
        nats_urls: Site → client URL.
        metrics_urls: Service process name → its Prometheus endpoint.
        commands: Process name → how to start it again: ``argv``, ``env`` and ``program``
            (``pdd``: arguments of the pdd CLI; ``exec``: a binary and its arguments).
        restarts: Process name → times it was started again (supervisor or ``pdd restart``).
        paused: Processes being restarted by hand (the supervisor leaves them alone).
        supervisor_pid: The supervisor process (0: none).
        up_args: The ``pdd up`` options it was started with (``pdd chaos --scenario redeploy``
            starts it again with them).
    """

    run_dir: str
    router_url: str
    wan_control_url: str
    processes: dict[str, int] = field(default_factory=dict)
    nats_urls: dict[str, str] = field(default_factory=dict)
    metrics_urls: dict[str, str] = field(default_factory=dict)
    commands: dict[str, dict] = field(default_factory=dict)
    restarts: dict[str, int] = field(default_factory=dict)
    paused: list[str] = field(default_factory=list)
    supervisor_pid: int = 0
    up_args: dict = field(default_factory=dict)

    def control_key(self) -> str:
        """The WAN link control API's key ("" for a deployment without one)."""
        from infra.wan_control import control_key_in

        return control_key_in(Path(self.run_dir) / "secrets")


def default_run_dir() -> Path:
    """``$PDD_RUN_DIR`` or ``<model cache>/run``."""
    return Path(os.environ.get("PDD_RUN_DIR", model_cache_dir() / "run"))


def load_state(run_dir: Path) -> Deployment | None:
    """The recorded deployment, if any."""
    path = run_dir / "state.json"
    return Deployment(**json.loads(path.read_text())) if path.is_file() else None


def up(args) -> Deployment:
    """Start everything; return once the router reports every instance healthy."""
    run_dir = Path(args.run_dir)
    existing = load_state(run_dir)
    if existing and any(process_alive(pid) for pid in existing.processes.values()):
        raise LauncherError(f"a deployment is already running from {run_dir} (pdd down first)")
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    deployment = Deployment(
        str(run_dir),
        f"http://127.0.0.1:{args.http_port}/v1",
        f"http://127.0.0.1:{args.wan_control_port}",
        up_args={k: v for k, v in vars(args).items() if isinstance(v, (str, int, float, bool, type(None)))},
    )
    try:
        _start_all(args, run_dir, deployment)
        _save(run_dir, deployment)
        _wait_healthy(deployment, args)
        with locked_state(run_dir) as saved:
            saved.supervisor_pid = deployment.supervisor_pid = _spawn(
                run_dir, "supervisor", {"argv": ["supervise", "--run-dir", str(run_dir)], "env": {}}
            )
    except BaseException:
        _save(run_dir, deployment)
        down(run_dir, quiet=True)
        raise
    return deployment


def _admin_login(creds: Credentials | None) -> dict:
    """How the deployment step signs in: as ``admin`` (none without credentials: --insecure)."""
    if creds is None:
        return {}
    return {"seed_file": str(creds.seed_file(ADMIN)), "ca_file": str(creds.ca_file)}


def identities(args) -> tuple[tuple[str, str], ...]:
    """``(role, instance_id)`` of every service process ``pdd up`` starts with ``args``."""
    counts = {"cache-index": 1, "prefill": args.prefill, "relay-decode": args.rld, "main-decode": args.md, "router": 1}
    return tuple((SERVICE_OF[kind], f"{kind}-{i}") for kind, count in counts.items() for i in range(count))


def _start_all(args, run_dir: Path, deployment: Deployment):
    instances = identities(args)
    creds = ensure_credentials(run_dir / "secrets", instance_ids=tuple(i for _, i in instances))
    # --insecure (measuring what encryption costs, nothing else): no NATS identities, no TLS.
    locked = None if getattr(args, "insecure", False) else creds
    site_a = NatsSite(
        SITE_A,
        args.nats_a_port,
        free_port(),
        run_dir / "jetstream-a",
        leaf_listen_port=free_port(),
        credentials=locked,
        identities=instances,
    )
    deployment.processes["nats-a"] = start_nats(site_a, run_dir, run_dir / "logs" / "nats-a.log").pid
    deployment.commands["nats-a"] = _nats_command(run_dir, SITE_A)
    leaf_port, bulk_link_port = free_port(), free_port()
    bulk_ports = [free_port() for _ in range(args.md)]
    md_site = getattr(args, "md_site", SITE_B)
    routes = [f"leafnode=127.0.0.1:{leaf_port}>127.0.0.1:{site_a.leaf_listen_port}@{SITE_B}"]
    if md_site == SITE_B:  # main decode at site A (same-site baseline) needs no WAN path
        # One routed port for every main decoder: each flow names its receiver (no per-instance route).
        routes.append(f"bulk-main-decode=127.0.0.1:{bulk_link_port}>*@{SITE_A}")
    deployment.commands["wan-link"] = {
        "argv": [
            "serve",
            "wan_link",
            "--control-port",
            str(args.wan_control_port),
            "--bandwidth",
            args.bandwidth,
            "--rtt",
            args.rtt,
            "--jitter",
            args.jitter,
            "--seed",
            str(args.seed),
            "--route-key-file",
            str(creds.link_route_key_file),
            "--control-key-file",
            str(creds.control_key_file),
            *[arg for route in routes for arg in ("--route", route)],
        ],
        "env": {},
    }
    deployment.processes["wan-link"] = _spawn(run_dir, "wan-link", deployment.commands["wan-link"])
    wait_until(lambda: http_ok(deployment.wan_control_url + "/health"), 30, "WAN link did not start")
    deployment.metrics_urls["wan-link"] = deployment.wan_control_url + "/metrics"
    site_b = NatsSite(
        SITE_B,
        args.nats_b_port,
        free_port(),
        run_dir / "jetstream-b",
        leaf_remote_url=f"nats-leaf://127.0.0.1:{leaf_port}",
        credentials=locked,
        identities=instances,
    )
    deployment.processes["nats-b"] = start_nats(site_b, run_dir, run_dir / "logs" / "nats-b.log").pid
    deployment.commands["nats-b"] = _nats_command(run_dir, SITE_B)
    wait_until(lambda: leafnode_count(site_a) >= 1, 30, "leafnode between the sites did not connect")
    deployment.nats_urls = {SITE_A: site_a.url, SITE_B: site_b.url}
    for site in (site_a, site_b):  # the deployment step: streams, made by the admin identity alone
        asyncio.run(create_site_streams(site.url, site.site, **_admin_login(locked)))
    engines = role_engines(args)
    env = {
        "PDD_MODEL": args.model,
        "PDD_LOG_LEVEL": args.log_level,
        "PDD_KV_CACHE_MB": str(args.kv_cache_mb),
        "PDD_BLOCK_SIZE": str(block_size_of(args)),
    }
    # Only prefill signs FlowOpens; the receivers hold the key that checks them, nothing more.
    bulk_keys = {
        "prefill": {"PDD_BULK_SECRET_FILE": str(creds.bulk_secret_file)},
        **{
            kind: {"PDD_BULK_VERIFY_KEY_FILE": str(creds.bulk_verify_key_file)}
            for kind in ("relay-decode", "main-decode")
        },
    }
    if getattr(args, "served_model_name", None):
        env["PDD_SERVED_MODEL_NAME"] = args.served_model_name
    if locked:
        env["PDD_TLS_CA_FILE"] = str(creds.ca_file)
        for kind, keys in bulk_keys.items():  # each engine its own certificate
            peer = PEER_OF_ROLE[SERVICE_OF[kind]]
            keys.update(PDD_TLS_CERT_FILE=str(creds.cert_file(peer)), PDD_TLS_KEY_FILE=str(creds.key_file(peer)))
    site_env = {
        SITE_A: {"PDD_SITE": SITE_A, "PDD_NATS_URL": site_a.url},
        SITE_B: {"PDD_SITE": SITE_B, "PDD_NATS_URL": site_b.url},
    }

    def spawn(kind: str, index: int, *flags: str, site: str | None = None):
        name = kind if kind == "router" else f"{kind}-{index}"
        metrics_port = free_port()
        deployment.metrics_urls[name] = f"http://127.0.0.1:{metrics_port}/metrics"
        argv = [
            "serve",
            SERVICE_OF[kind],
            "--instance-id",
            f"{kind}-{index}",
            "--metrics-port",
            str(metrics_port),
            *flags,
        ]
        process_env = {**env, **site_env[site or TOPOLOGY[kind][0]], **bulk_keys.get(kind, {})}
        if kind in ENGINE_KINDS:
            # vLLM binds a port of its own for its (one-process) distributed group; left to the
            # kernel, it can take a bulk port handed out here but not bound yet.
            process_env["VLLM_PORT"] = str(free_port())
        if locked:
            process_env["PDD_NATS_SEED_FILE"] = str(creds.seed_file(f"{kind}-{index}"))  # its own identity
        deployment.commands[name] = {"argv": argv, "env": process_env}
        deployment.processes[name] = _spawn(run_dir, name, deployment.commands[name])

    spawn("cache-index", 0)
    for i in range(args.prefill):
        spawn("prefill", i, "--engine", engines["prefill"])
    for i in range(args.rld):
        spawn("relay-decode", i, "--engine", engines["relay"])
    for i, local in enumerate(bulk_ports):
        link = ["--bulk-link", f"127.0.0.1:{bulk_link_port}"] if md_site == SITE_B else []
        cache = [] if getattr(args, "md_prefix_cache", True) else ["--prefix-cache", "false"]
        spawn(
            "main-decode",
            i,
            "--bulk-port",
            str(local),
            "--bulk-advertise",
            f"127.0.0.1:{local}",
            *link,
            *cache,
            "--engine",
            engines["main"],
            site=md_site,
        )
    from infra.wan_link import parse_ms, parse_rate

    api_keys = getattr(args, "api_key", None) or os.environ.get("PDD_API_KEYS", "")
    env["PDD_API_KEYS"] = api_keys
    spawn(
        "router",
        0,
        "--http-port",
        str(args.http_port),
        "--wan-bandwidth-mbit",
        str(parse_rate(args.bandwidth) / 1e6 or 100000),
        "--wan-rtt-ms",
        str(parse_ms(args.rtt)),
        "--pipeline-policy",
        getattr(args, "pipeline_policy", "auto"),
    )


ENGINE_KINDS = ("prefill", "relay-decode", "main-decode")


def role_engines(args) -> dict[str, str]:
    """The engine backend of each engine role: its own flag, else ``--engine``, else ``hf``."""
    default = getattr(args, "engine", None) or "hf"
    return {role: getattr(args, f"{role}_engine", None) or default for role in ("prefill", "relay", "main")}


def block_size_of(args) -> int:
    """``--block-size``, else 32 when any role runs vLLM (its CPU attention takes multiples of 32),
    else 16."""
    given = getattr(args, "block_size", None)
    if given:
        return given
    return 32 if "vllm" in role_engines(args).values() else 16


def _nats_command(run_dir: Path, site: str) -> dict:
    # start_nats wrote the server's configuration there; a restart reuses it (same ports, store).
    return {"argv": [nats_server_binary(), "-c", str(run_dir / f"nats-{site}.conf")], "env": {}, "program": "exec"}


def _spawn(run_dir: Path, name: str, command: dict) -> int:
    """Start a recorded command with its log in the run folder; return its pid."""
    argv = command["argv"]
    if command.get("program", "pdd") == "pdd":
        argv = [sys.executable, "-m", "infra.cli", *argv]
    with open(run_dir / "logs" / f"{name}.log", "ab") as log:  # the child keeps its own copy
        process = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env={**os.environ, **command["env"]}
        )
    return process.pid


@contextlib.contextmanager
def locked_state(run_dir: Path):
    """The recorded deployment (None if there is none), saved back on exit, under a file lock:
    the supervisor and ``pdd restart``/``down`` change it from different processes."""
    with open(run_dir / "state.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            deployment = load_state(run_dir)
            before = asdict(deployment) if deployment is not None else None
            yield deployment
            if deployment is not None and asdict(deployment) != before and (run_dir / "state.json").exists():
                _save(run_dir, deployment)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


PROGRESS_EVERY_S = 5.0


def _wait_healthy(deployment: Deployment, args):
    """Wait until the router sees every instance; say what is still missing every few seconds
    (on stderr, unless ``args.progress`` is False: the benchmark starts deployments quietly)."""
    want = {"prefill": args.prefill, "relay_decode": args.rld, "main_decode": args.md, "cache_index": 1}
    started = last_report = time.monotonic()

    def healthy():
        nonlocal last_report
        dead = [name for name, pid in deployment.processes.items() if not process_alive(pid)]
        if dead:
            raise LauncherError(f"{', '.join(dead)} exited; see {deployment.run_dir}/logs/")
        health = get_json(deployment.router_url.removesuffix("/v1") + "/health")
        seen = {s: len(health["instances"].get(s, [])) if health else 0 for s in want}
        if getattr(args, "progress", True) and time.monotonic() - last_report >= PROGRESS_EVERY_S:
            last_report = time.monotonic()
            waiting = ", ".join(f"{s} {seen[s]}/{n}" for s, n in want.items() if seen[s] < n)
            print(
                f"waiting {last_report - started:.0f} s: {'router' if not health else waiting} "
                f"(loading the model; logs in {deployment.run_dir}/logs/)",
                file=sys.stderr,
                flush=True,
            )
        return bool(health) and all(seen[s] >= n for s, n in want.items())

    wait_until(
        healthy, args.timeout, f"services not healthy after {args.timeout:.0f} s; see {deployment.run_dir}/logs/"
    )


def down(run_dir: Path, quiet: bool = False) -> list[str]:
    """Stop the supervisor, then every recorded process (services first, then the link and NATS)."""
    deployment = load_state(run_dir)
    if deployment is None:
        if not quiet:
            raise LauncherError(f"no deployment recorded in {run_dir}")
        return []
    if deployment.supervisor_pid:
        _stop(deployment.supervisor_pid, timeout_s=5)
    order = sorted(deployment.processes, key=lambda n: (n.startswith(("nats", "wan")), n))
    for name in order:
        _signal(deployment.processes[name], signal.SIGTERM)
    deadline = time.monotonic() + 20
    for name in order:
        pid = deployment.processes[name]
        while process_alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        if process_alive(pid):
            _signal(pid, signal.SIGKILL)
    with locked_state(run_dir):
        (run_dir / "state.json").unlink(missing_ok=True)
    return order


def restart(run_dir: Path, name: str) -> int:
    """Stop one process (SIGTERM, then SIGKILL) and start it again; return its new pid.

    Works for every recorded process: services, the NATS servers (same ports and JetStream
    store) and the WAN link (back to the link profile ``pdd up`` was given).
    """
    with locked_state(run_dir) as deployment:
        if deployment is None or name not in deployment.commands:
            known = sorted(deployment.commands) if deployment else []
            raise LauncherError(f"no process {name!r} to restart (known: {', '.join(known)})")
        deployment.paused.append(name)
        pid, command = deployment.processes[name], deployment.commands[name]
    try:
        _stop(pid, timeout_s=20)
        new_pid = _spawn(run_dir, name, command)
    finally:
        with locked_state(run_dir) as deployment:
            if deployment is not None:
                deployment.paused.remove(name)
    with locked_state(run_dir) as deployment:
        deployment.processes[name] = new_pid
        deployment.restarts[name] = deployment.restarts.get(name, 0) + 1
    _wait_ready(deployment, name)
    return new_pid


def _wait_ready(deployment: Deployment, name: str, timeout_s: float = 30.0):
    """Until a restarted link or NATS server serves again (services report by heartbeat)."""
    if name == "wan-link":
        wait_until(lambda: http_ok(deployment.wan_control_url + "/health"), timeout_s, "WAN link did not come back")
    elif name.startswith("nats-"):
        host, port = deployment.nats_urls[TOPOLOGY[name][0]].split("://", 1)[1].rsplit(":", 1)
        wait_until(lambda: _accepts(host, int(port)), timeout_s, f"{name} did not come back")


def _accepts(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=1):
            return True
    except OSError:
        return False


def _stop(pid: int, timeout_s: float):
    _signal(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while process_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    if process_alive(pid):
        _signal(pid, signal.SIGKILL)


def status(run_dir: Path, detailed: bool = False) -> dict:
    """Each process alive or not, and the router's view of the instances.

    With ``detailed`` each process is an object: pid, state, metrics URL, restarts.
    """
    deployment = load_state(run_dir)
    if deployment is None:
        raise LauncherError(f"no deployment recorded in {run_dir}")
    states = {n: ("running" if process_alive(p) else "exited") for n, p in deployment.processes.items()}
    if detailed:
        processes = {
            n: {
                "pid": p,
                "state": states[n],
                "metrics_url": deployment.metrics_urls.get(n),
                "restarts": deployment.restarts.get(n, 0),
            }
            for n, p in deployment.processes.items()
        }
    else:
        processes = states
    return {
        "router_url": deployment.router_url,
        "wan_control_url": deployment.wan_control_url,
        "metrics_urls": deployment.metrics_urls,
        "processes": processes,
        "supervisor": "running" if process_alive(deployment.supervisor_pid) else "exited",
        "health": get_json(deployment.router_url.removesuffix("/v1") + "/health"),
    }


def _save(run_dir: Path, deployment: Deployment):
    # Atomic (readers such as `pdd status` take no lock); 0600: it holds the bulk secret.
    path, partial = run_dir / "state.json", run_dir / "state.json.partial"
    partial.unlink(missing_ok=True)
    with os.fdopen(os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as file:
        file.write(json.dumps(asdict(deployment), indent=2))
    partial.replace(path)


def process_alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, or a child already reaped here, does not)."""
    if pid <= 0:
        return False  # 0 and negatives name process groups, not a process
    try:
        waited, _ = os.waitpid(pid, os.WNOHANG)
        if waited == pid:
            return False
    except ChildProcessError:
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return not _is_zombie(pid)


def _is_zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1].startswith("Z")
    except (OSError, IndexError):
        return False


def _signal(pid: int, sig):
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass
