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
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from infra.credentials import PEER_OF_ROLE, Credentials, ensure_credentials
from infra.deployment_spec import DeploymentSpec
from infra.http_probe import get_json, http_ok
from infra.nats_server import (
    SITE_A,
    SITE_B,
    NatsSite,
    free_port,
    instances_away,
    leafnode_count,
    nats_server_binary,
    start_nats,
    wait_until,
)
from infra.streams import create_site_streams
from shared.errors import PddError
from shared.hf_cache import model_cache_dir
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
ENGINE_KINDS = ("prefill", "relay-decode", "main-decode")


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
        spec: What it was started with, its run folder filled in (``pdd chaos --scenario
            redeploy`` starts it again from it; None: a state file that does not record it).
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
    spec: DeploymentSpec | None = None

    def control_key(self) -> str:
        """The WAN link control API's key ("" for a deployment without one)."""
        from infra.wan_control import control_key_in

        return control_key_in(Path(self.run_dir) / "secrets")


def default_run_dir() -> Path:
    """``$PDD_RUN_DIR`` or ``<model cache>/run``."""
    return Path(os.environ.get("PDD_RUN_DIR", model_cache_dir() / "run"))


def load_state(run_dir: Path) -> Deployment | None:
    """The recorded deployment, if any.

    The spec is recorded as a dict; a ``state.json`` written before there was one records the
    ``pdd up`` options instead (``up_args``), read as the spec they describe."""
    path = run_dir / "state.json"
    if not path.is_file():
        return None
    recorded = json.loads(path.read_text())
    spec, legacy = recorded.pop("spec", None), recorded.pop("up_args", None)
    spec = spec or legacy
    return Deployment(**recorded, spec=DeploymentSpec.from_dict(spec) if spec else None)


def run_dir_of(given: str | None) -> Path:
    """The run folder a command was given (``--run-dir``), else :func:`default_run_dir`."""
    return Path(given) if given else default_run_dir()


def up(spec: DeploymentSpec) -> Deployment:
    """Start everything; return once every router reports every instance healthy.

    The deployment records ``spec`` with its run folder filled in (``pdd chaos --scenario
    redeploy`` starts it again from there)."""
    _check_link(spec)
    _check_http_port_free(spec.http_port)
    run_dir = run_dir_of(spec.run_dir)
    spec = replace(spec, run_dir=str(run_dir))
    existing = load_state(run_dir)
    if existing and any(process_alive(pid) for pid in existing.processes.values()):
        raise LauncherError(f"a deployment is already running from {run_dir} (pdd down first)")
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    deployment = Deployment(
        str(run_dir), f"http://127.0.0.1:{spec.http_port}/v1", f"http://127.0.0.1:{spec.wan_control_port}", spec=spec
    )
    try:
        _start_all(spec, run_dir, deployment)
        _save(run_dir, deployment)
        _wait_healthy(deployment, spec)
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


def identities(spec: DeploymentSpec) -> tuple[tuple[str, str], ...]:
    """``(role, instance_id)`` of every service process ``pdd up`` starts for ``spec``."""
    counts = {
        "cache-index": spec.cache_index,
        "prefill": spec.prefill,
        "relay-decode": spec.rld,
        "main-decode": spec.md,
        "router": spec.routers,
    }
    return tuple((SERVICE_OF[kind], f"{kind}-{i}") for kind, count in counts.items() for i in range(count))


def _start_all(spec: DeploymentSpec, run_dir: Path, deployment: Deployment):
    instances = identities(spec)
    creds = ensure_credentials(run_dir / "secrets", instance_ids=tuple(i for _, i in instances))
    # --insecure (measuring what encryption costs, nothing else): no NATS identities, no TLS.
    locked = None if spec.insecure else creds
    site_a = NatsSite(
        SITE_A,
        spec.nats_a_port,
        free_port(),
        run_dir / "jetstream-a",
        leaf_listen_port=free_port(),
        credentials=locked,
        identities=instances,
        away=instances_away(SITE_A, instances, spec.md_site),
    )
    _start_nats(run_dir, deployment, "nats-a", site_a)
    leaf_port, bulk_link_port = free_port(), free_port()
    routes = [f"leafnode=127.0.0.1:{leaf_port}>127.0.0.1:{site_a.leaf_listen_port}@{SITE_B}"]
    if spec.md_site == SITE_B:  # main decode at site A (same-site baseline) needs no WAN path
        # One routed port for every main decoder: each flow names its receiver (no per-instance route).
        routes.append(f"bulk-main-decode=127.0.0.1:{bulk_link_port}>*@{SITE_A}")
    _start_wan_link(spec, run_dir, deployment, creds, routes)
    site_b = NatsSite(
        SITE_B,
        spec.nats_b_port,
        free_port(),
        run_dir / "jetstream-b",
        leaf_remote_url=f"nats-leaf://127.0.0.1:{leaf_port}",
        credentials=locked,
        identities=instances,
        away=instances_away(SITE_B, instances, spec.md_site),
    )
    _start_nats(run_dir, deployment, "nats-b", site_b)
    wait_until(lambda: leafnode_count(site_a) >= 1, 30, "leafnode between the sites did not connect")
    deployment.nats_urls = {SITE_A: site_a.url, SITE_B: site_b.url}
    for site in (site_a, site_b):  # the deployment step: streams, made by the admin identity alone
        asyncio.run(create_site_streams(site.url, site.site, **_admin_login(locked)))
    services = _Services(run_dir, deployment, locked, _service_env(spec, creds, locked))
    _start_services(spec, services, bulk_link_port)


def _start_nats(run_dir: Path, deployment: Deployment, name: str, site: NatsSite):
    deployment.processes[name] = start_nats(site, run_dir, run_dir / "logs" / f"{name}.log").pid
    deployment.commands[name] = _nats_command(run_dir, site.site)


def _check_http_port_free(port: int):
    """The routers share ``port`` (SO_REUSEPORT): refuse to start beside a stranger already
    listening there, which the kernel would otherwise hand a share of the connections."""
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT is not a listener
        try:
            probe.bind(("127.0.0.1", port))
        except OSError as exc:
            raise LauncherError(f"--http-port {port} is in use ({exc.strerror}); choose another") from None


def _check_link(spec: DeploymentSpec):
    """The link's settings read as the link will read them (before anything starts)."""
    from infra.wan_link import parse_bytes, parse_ms, parse_rate

    try:
        parse_rate(spec.bandwidth), parse_ms(spec.rtt), parse_ms(spec.jitter), parse_bytes(spec.window)
    except ValueError as exc:
        raise LauncherError(str(exc)) from None


def _start_wan_link(spec: DeploymentSpec, run_dir: Path, deployment: Deployment, creds: Credentials, routes: list):
    deployment.commands["wan-link"] = {
        "argv": [
            "serve",
            "wan_link",
            "--control-port",
            str(spec.wan_control_port),
            "--bandwidth",
            spec.bandwidth,
            "--rtt",
            spec.rtt,
            "--jitter",
            spec.jitter,
            "--window",
            spec.window,
            "--seed",
            str(spec.seed),
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


def _service_env(spec: DeploymentSpec, creds: Credentials, locked: Credentials | None) -> dict[str, dict[str, str]]:
    """Process kind → the environment its services start with (their site's comes on top)."""
    env = {
        "PDD_MODEL": spec.model,
        "PDD_LOG_LEVEL": spec.service_log_level,
        "PDD_KV_CACHE_MB": str(spec.kv_cache_mb),
        "PDD_BLOCK_SIZE": str(spec.kv_block_size()),
    }
    if spec.served_model_name:
        env["PDD_SERVED_MODEL_NAME"] = spec.served_model_name
    # Only prefill signs FlowOpens, the receivers hold the key that checks them, nothing more;
    # only the router holds the API keys.
    own = {
        "router": {"PDD_API_KEYS": spec.api_key or os.environ.get("PDD_API_KEYS", "")},
        "prefill": {"PDD_BULK_SECRET_FILE": str(creds.bulk_secret_file)},
        **{
            kind: {"PDD_BULK_VERIFY_KEY_FILE": str(creds.bulk_verify_key_file)}
            for kind in ("relay-decode", "main-decode")
        },
    }
    own_threads = _torch_threads(spec)
    for kind, role in zip(ENGINE_KINDS, ("prefill", "relay", "main"), strict=True):
        if own_threads and spec.role_engines()[role] == "hf":
            own[kind]["PDD_TORCH_THREADS"] = own_threads
    if locked:
        env["PDD_TLS_CA_FILE"] = str(creds.ca_file)
        for kind in ENGINE_KINDS:  # each engine its own certificate
            peer = PEER_OF_ROLE[SERVICE_OF[kind]]
            own[kind].update(PDD_TLS_CERT_FILE=str(creds.cert_file(peer)), PDD_TLS_KEY_FILE=str(creds.key_file(peer)))
    return {kind: {**env, **own.get(kind, {})} for kind in SERVICE_OF}


def _torch_threads(spec: DeploymentSpec) -> str:
    """Torch threads per HF engine process: the cores shared out among the engine processes
    (at least one each), unless ``PDD_TORCH_THREADS`` is set already ("": leave it). Measured
    on 2 cores (docs/engine.md): three engines at torch's default of 2 threads each decoded at
    8.2-8.3 s per step and prefilled 26 tok/s; at 1 thread each, 226-244 ms and 172 tok/s."""
    if "PDD_TORCH_THREADS" in os.environ:
        return ""
    engines = spec.prefill + spec.rld + spec.md
    return str(max(1, (os.cpu_count() or 1) // max(1, engines)))


@dataclass
class _Services:
    """Starts service processes into a deployment being brought up."""

    run_dir: Path
    deployment: Deployment
    locked: Credentials | None
    env: dict[str, dict[str, str]]

    def spawn(self, kind: str, index: int, *flags: str, site: str | None = None):
        name = f"{kind}-{index}"
        metrics_port = free_port()
        self.deployment.metrics_urls[name] = f"http://127.0.0.1:{metrics_port}/metrics"
        argv = ["serve", SERVICE_OF[kind], "--instance-id", f"{kind}-{index}", "--metrics-port", str(metrics_port)]
        site = site or TOPOLOGY[kind][0]
        process_env = {**self.env[kind], "PDD_SITE": site, "PDD_NATS_URL": self.deployment.nats_urls[site]}
        if kind in ENGINE_KINDS:
            # vLLM binds a port of its own for its (one-process) distributed group; left to the
            # kernel, it can take a bulk port handed out here but not bound yet.
            process_env["VLLM_PORT"] = str(free_port())
        if self.locked:
            process_env["PDD_NATS_SEED_FILE"] = str(self.locked.seed_file(f"{kind}-{index}"))  # its own identity
        self.deployment.commands[name] = {"argv": [*argv, *flags], "env": process_env}
        self.deployment.processes[name] = _spawn(self.run_dir, name, self.deployment.commands[name])


def _start_services(spec: DeploymentSpec, services: _Services, bulk_link_port: int):
    from infra.wan_link import parse_ms, parse_rate

    engines = spec.role_engines()
    for i in range(spec.cache_index):
        services.spawn("cache-index", i)
    wan = [
        "--wan-bandwidth-mbit",
        str(parse_rate(spec.bandwidth) / 1e6 or 100000),
        "--wan-rtt-ms",
        str(parse_ms(spec.rtt)),
    ]
    for i in range(spec.prefill):  # the WAN's rate and RTT size prefill's bulk streams per flow
        services.spawn("prefill", i, "--engine", engines["prefill"], *wan)
    for i in range(spec.rld):
        services.spawn("relay-decode", i, "--engine", engines["relay"])
    link = ["--bulk-link", f"127.0.0.1:{bulk_link_port}"] if spec.md_site == SITE_B else []
    cache = [] if spec.md_prefix_cache else ["--prefix-cache", "false"]
    for i in range(spec.md):  # each receiver listens on a port the kernel gives it and advertises it
        services.spawn("main-decode", i, *link, *cache, "--engine", engines["main"], site=spec.md_site)
    for i in range(spec.routers):  # every router on the one port: the kernel spreads connections
        services.spawn(
            "router",
            i,
            "--http-port",
            str(spec.http_port),
            "--http-reuse-port",
            "true",
            *wan,
            "--pipeline-policy",
            spec.pipeline_policy,
        )


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


def _wait_healthy(deployment: Deployment, spec: DeploymentSpec):
    """Wait until every router sees every instance and every other router; say what is still
    missing every few seconds (on stderr, unless ``spec.progress`` is False: the benchmark
    starts deployments quietly)."""
    want = {"prefill": spec.prefill, "relay_decode": spec.rld, "main_decode": spec.md, "cache_index": spec.cache_index}
    started = last_report = time.monotonic()

    def healthy():
        nonlocal last_report
        dead = [name for name, pid in deployment.processes.items() if not process_alive(pid)]
        if dead:
            raise LauncherError(f"{', '.join(dead)} exited; see {deployment.run_dir}/logs/")
        missing = {name: _router_missing(health, want, spec.routers) for name, health in _router_healths(deployment)}
        if spec.progress and time.monotonic() - last_report >= PROGRESS_EVERY_S:
            last_report = time.monotonic()
            waiting = "; ".join(f"{name}: {what}" for name, what in missing.items() if what)
            print(
                f"waiting {last_report - started:.0f} s: {waiting} (loading the model; logs in {deployment.run_dir}/logs/)",
                file=sys.stderr,
                flush=True,
            )
        return not any(missing.values())

    wait_until(
        healthy, spec.timeout_s, f"services not healthy after {spec.timeout_s:.0f} s; see {deployment.run_dir}/logs/"
    )


def _router_healths(deployment: Deployment) -> list[tuple[str, dict | None]]:
    """Each router process's own ``/health`` (on its metrics port: the shared HTTP port reaches
    whichever router the kernel picks)."""
    return [
        (name, get_json(url.removesuffix("/metrics") + "/health"))
        for name, url in deployment.metrics_urls.items()
        if name.startswith("router-")
    ]


def _router_missing(health: dict | None, want: dict[str, int], routers: int) -> str:
    """What one router does not see yet ("" once it sees every instance and router)."""
    if not health or health.get("status") != "ok":
        return "not serving yet"
    seen = {s: len(health.get("instances", {}).get(s, [])) for s in want}
    missing = [f"{s} {seen[s]}/{n}" for s, n in want.items() if seen[s] < n]
    if len(health.get("routers", [])) < routers:
        missing.append(f"router {len(health.get('routers', []))}/{routers}")
    return ", ".join(missing)


def down(run_dir: Path, quiet: bool = False) -> list[str]:
    """Stop the supervisor, then every recorded process (services first, then the link and NATS)."""
    deployment = load_state(run_dir)
    if deployment is None:
        if not quiet:
            raise LauncherError(f"no deployment recorded in {run_dir}")
        return []
    if deployment.supervisor_pid:
        _stop(deployment.supervisor_pid, timeout_s=5)
    carriers = sorted(name for name in deployment.processes if name.startswith(("nats", "wan")))
    services = sorted(name for name in deployment.processes if name not in carriers)
    # Services stop while NATS and the link still carry what their graceful stop sends (the
    # drain, a prefill's resume-elsewhere notices); then the link and NATS.
    _stop_all([deployment.processes[name] for name in services], timeout_s=20)
    _stop_all([deployment.processes[name] for name in carriers], timeout_s=10)
    order = services + carriers
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


def _stop_all(pids: list[int], timeout_s: float):
    """SIGTERM every one of ``pids`` at once, wait for them together, SIGKILL those left."""
    for pid in pids:
        _signal(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    for pid in pids:
        while process_alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        if process_alive(pid):
            _signal(pid, signal.SIGKILL)


def _stop(pid: int, timeout_s: float):
    _stop_all([pid], timeout_s)


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
