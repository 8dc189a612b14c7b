"""docker-compose.yml checked against the launcher's topology (Docker cannot run here).

Same processes on the same sites, every ``pdd`` command accepted by the CLI, every ``PDD_*``
variable a known and valid setting of that service, NATS configs accepted by nats-server,
and WAN-link routes that lead to services that exist.
"""

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from infra.cli import build_parser
from infra.credentials import TLS_PEERS
from infra.launcher import SERVICE_OF, TOPOLOGY
from infra.nats_server import nats_server_binary
from infra.serve import SERVICE_CONFIGS
from infra.wan_link import parse_ms, parse_rate, parse_route
from shared.config import build_config, env_name, settings_of

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
SERVICES = COMPOSE["services"]
OBSERVABILITY = {"jaeger", "prometheus", "grafana"}
DEPLOYMENT_STEPS = {"streams-a": "site-a", "streams-b": "site-b"}
"""One-shot services: each site's JetStream streams, made as admin before the services start."""
SCALABLE = {"prefill", "relay-decode", "main-decode", "router"}
"""Services ``docker compose up --scale`` may run several of (no fixed name or address)."""
FRONT_DOOR = "router-lb"
"""HAProxy in front of the router replicas: compose's one address (``pdd up`` shares a port instead)."""


def pdd_services():
    return [(name, spec) for name, spec in SERVICES.items() if spec.get("command", [""])[0] == "pdd"]


SECRETS_MOUNT = "/run/secrets/pdd"


def resolved_env(spec, secrets_dir: Path | None = None) -> dict[str, str]:
    """Compose ``${VAR:-default}`` substitution with nothing set: the default; the mounted
    secrets folder read from ``secrets_dir`` when given."""
    env = {k: re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", str(v)) for k, v in (spec.get("environment") or {}).items()}
    if secrets_dir is not None:  # a path in the container: the file of the folder mounted there
        mounted = {
            target: source.rsplit("/", 1)[1]
            for source, target, _ in (
                v.rsplit(":", 2) for v in spec.get("volumes", []) if v.startswith("${PDD_SECRETS_DIR")
            )
        }
        env = {
            k: str(secrets_dir / mounted[v]) if v in mounted else v.replace(SECRETS_MOUNT, str(secrets_dir))
            for k, v in env.items()
        }
    return env


@pytest.fixture(scope="module")
def secrets_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("compose") / "secrets"
    assert (
        subprocess.run(
            [sys.executable, "-m", "infra.cli", "secrets", "--out", str(out)], capture_output=True, text=True, cwd=ROOT
        ).returncode
        == 0
    )
    return out


def test_same_processes_on_the_same_sites_as_the_launcher():
    assert set(SERVICES) - OBSERVABILITY - set(DEPLOYMENT_STEPS) - {FRONT_DOOR} == set(TOPOLOGY)
    for name, sites in TOPOLOGY.items():
        assert sorted(SERVICES[name]["networks"]) == sorted(sites), name


@pytest.mark.parametrize("name,spec", pdd_services(), ids=[n for n, _ in pdd_services()])
def test_every_command_is_accepted_by_the_cli(name, spec):
    args = build_parser().parse_args(spec["command"][1:])
    if name in DEPLOYMENT_STEPS:
        assert args.command == "streams" and args.site == DEPLOYMENT_STEPS[name]
        assert args.nats_url == f"tls://nats-{args.site[-1]}:4222" and args.seed_file.endswith("/admin.nk")
        return
    assert args.command == "serve"
    if name != "wan-link":
        assert args.service == SERVICE_OF[name]


@pytest.mark.parametrize("name", list(SERVICE_OF))
def test_every_variable_is_a_known_valid_setting(name, secrets_dir):
    cls = SERVICE_CONFIGS[SERVICE_OF[name]]
    env = resolved_env(SERVICES[name], secrets_dir)
    known = {env_name(f.name) for f in settings_of(cls)}
    assert set(env) <= known, f"{name}: unknown settings {sorted(set(env) - known)}"
    config = build_config(cls, {}, env, service=name)
    assert config.site == TOPOLOGY[name][0]
    assert config.nats_url == f"tls://nats-{config.site[-1]}:4222"
    assert config.nats_seed_file == str(secrets_dir / f"{SERVICE_OF[name]}.nk")
    assert Path(config.tls_ca_file).is_file()
    if name == "prefill":  # only prefill signs FlowOpens; the receivers hold the key that checks them
        assert config.bulk_secret == (secrets_dir / "bulk.secret").read_text().strip()
    else:
        assert not config.bulk_secret
    if name in ENGINE_FILES - {"prefill"}:
        assert config.bulk_verify_key == (secrets_dir / "bulk-verify.pub").read_text().strip()
    if name in ENGINE_FILES:  # only engines serve or dial bulk TLS
        assert Path(config.tls_cert_file).is_file() and Path(config.tls_key_file).is_file()
    else:
        assert not config.tls_cert_file and not config.tls_key_file


ENGINE_FILES = {"prefill", "relay-decode", "main-decode"}
MOUNTED_SECRETS = {  # each TLS peer its own certificate, for its own name; each server its site's users
    "nats-a": {"ca.pem", "nats-users-site-a.conf", "nats-a.pem", "nats-a.key"},
    "nats-b": {"ca.pem", "nats-users-site-b.conf", "nats-b.pem", "nats-b.key", "nats-leaf-remote.conf"},  # leaf seed
    "wan-link": {"link-route.key", "control.key"},
    "streams-a": {"ca.pem", "admin.nk"},
    "streams-b": {"ca.pem", "admin.nk"},  # admin: here only
    # /metrics checks the metrics key against its hash (only Prometheus holds the key)
    "cache-index": {"ca.pem", "metrics-key.sha256", "cache_index.nk"},
    "router": {"ca.pem", "metrics-key.sha256", "router.nk"},
    FRONT_DOOR: set(),
    "prefill": {"ca.pem", "metrics-key.sha256", "prefill.pem", "prefill.key", "bulk.secret", "prefill.nk"},
    **{
        name: {
            "ca.pem",
            "metrics-key.sha256",
            f"{name}.pem",
            f"{name}.key",
            "bulk-verify.pub",
            f"{SERVICE_OF[name]}.nk",
        }
        for name in ("relay-decode", "main-decode")
    },  # check them, cannot sign one
}
"""What each container holds of the secrets folder: its own nkey and nothing of anyone else's."""


def test_each_container_mounts_only_its_own_secrets_and_compose_refuses_to_start_without_them():
    """Every secret is one file of the folder that ``${PDD_SECRETS_DIR:?…}`` requires (compose
    stops with that message when it is unset); no secret has a default; no container mounts
    the folder whole or a file that is not its own."""
    text = (ROOT / "docker-compose.yml").read_text()
    assert "PDD_BULK_SECRET:" not in text and ":-change" not in text
    prefix = f"${{PDD_SECRETS_DIR:?{_SECRETS_HINT}}}/"
    for name in set(SERVICES) - OBSERVABILITY:
        mounts = [v for v in SERVICES[name].get("volumes", []) if v.startswith("${PDD_SECRETS_DIR")]
        files = set()
        for mount in mounts:
            source, target, mode = mount.rsplit(":", 2)
            assert source.startswith(prefix) and mode == "ro", (name, mount)
            file = source[len(prefix) :]
            stem, extension = file.rsplit(".", 1)
            own_certificate = stem in TLS_PEERS and extension in ("pem", "key")  # mounted as tls.pem, tls.key
            assert "/" not in file and target.endswith(
                "/" + ("tls." + file.rsplit(".", 1)[1] if own_certificate else file)
            ), (name, mount)
            files.add(file)
        assert files == MOUNTED_SECRETS[name], name


def test_nats_configs_are_valid_and_joined_through_the_wan_link(tmp_path, secrets_dir):
    routes = {r.name: r for r in (parse_route(t) for t in _wan_routes())}
    for site in ("site-a", "site-b"):
        text = (ROOT / "infra" / "nats" / f"{site}.conf").read_text()
        # The same file beside the secrets, as the container mounts them (includes are relative).
        mounted = tmp_path / site / "secrets"
        mounted.mkdir(parents=True)
        for volume in SERVICES[f"nats-{site[-1]}"]["volumes"]:
            source, target = volume.split(":")[-3:-1] if volume.endswith(":ro") else volume.split(":")[-2:]
            if target.startswith("/etc/nats/secrets/"):
                (mounted / target.rsplit("/", 1)[1]).symlink_to(secrets_dir / source.rsplit("/", 1)[1])
        conf = tmp_path / site / "site.conf"
        conf.write_text(text.replace("/etc/nats/secrets", str(mounted)))
        check = subprocess.run([nats_server_binary(), "-c", str(conf), "-t"], capture_output=True, text=True)
        assert check.returncode == 0, check.stderr
        assert f'domain: "{site}"' in text and "handshake_first: true" in text
        assert f'include "secrets/nats-users-{site}.conf"' in text
    leaf = routes["leafnode"]
    assert (leaf.target_host, leaf.target_port, leaf.from_site) == ("nats-a", 7422, "site-b")
    assert f"tls://wan-link:{leaf.listen_port}" in (ROOT / "infra/nats/site-b.conf").read_text()


def test_one_routed_link_port_leads_to_every_main_decoder_and_the_link_holds_only_the_route_key():
    """No per-instance route: each flow names its receiver, so replicas share one port."""
    routes = {r.name: r for r in (parse_route(t) for t in _wan_routes())}
    main_env = resolved_env(SERVICES["main-decode"])
    bulk = routes["bulk-main-decode"]
    assert bulk.routed and str(bulk.target_port) == main_env["PDD_BULK_PORT"] and bulk.from_site == "site-a"
    assert main_env["PDD_BULK_LINK"] == f"wan-link:{bulk.listen_port}" and main_env["PDD_BULK_HOST"] == "0.0.0.0"
    for name in SCALABLE:  # replicas share one configuration: nothing may name one instance
        env = resolved_env(SERVICES[name])
        assert "PDD_INSTANCE_ID" not in env and "PDD_BULK_ADVERTISE" not in env, name
    command = SERVICES["wan-link"]["command"]
    key = command[command.index("--route-key-file") + 1]
    control_key = command[command.index("--control-key-file") + 1]
    assert SERVICES["wan-link"]["volumes"] == [
        f"${{PDD_SECRETS_DIR:?{_SECRETS_HINT}}}/link-route.key:{key}:ro",
        f"${{PDD_SECRETS_DIR:?{_SECRETS_HINT}}}/control.key:{control_key}:ro",
    ]


_SECRETS_HINT = "run pdd secrets --out ./secrets and export PDD_SECRETS_DIR (docs/security.md)"


def test_the_default_profile_needs_only_our_images_and_runs_them_as_non_root():
    for name in [*TOPOLOGY, FRONT_DOOR]:
        spec = SERVICES[name]
        assert re.fullmatch(r"\$\{PDD_((NATS|LB)_)?IMAGE:-pdd(-nats|-lb)?:latest\}", spec["image"]), name
        assert spec["user"] == "${PDD_UID:-10001}:${PDD_GID:-10001}", name
        assert "profiles" not in spec, name
    for name in OBSERVABILITY:
        assert SERVICES[name]["profiles"] == ["observability"], name
    for spec in SERVICES.values():
        assert all(p.startswith("127.0.0.1:") for p in spec.get("ports", [])), spec["ports"]


def test_the_routers_scale_behind_one_published_address():
    """No router replica has a fixed name or host port; router-lb publishes the API port and
    sends it to every replica Docker's DNS lists, checking each one's /health."""
    router, front = SERVICES["router"], SERVICES[FRONT_DOOR]
    assert "PDD_INSTANCE_ID" not in router["environment"] and "ports" not in router
    assert front["ports"] == ["127.0.0.1:${PDD_ROUTER_PORT:-8000}:" + resolved_env(router)["PDD_HTTP_PORT"]]
    assert front["networks"] == router["networks"] and front["depends_on"] == {
        "router": {"condition": "service_healthy"}
    }
    source, target, _ = front["volumes"][0].split(":")
    config = (ROOT / source).read_text()
    assert front["image"] == "${PDD_LB_IMAGE:-pdd-lb:latest}" and front["command"] == ["-f", target]
    assert 'ENTRYPOINT ["/usr/sbin/haproxy", "-db"]' in (ROOT / "infra/haproxy/Dockerfile").read_text()
    assert re.search(r"^\s*server-template router \d+ router:8000\b", config, re.MULTILINE)
    assert re.search(r"^\s*nameserver \w+ 127\.0\.0\.11:53$", config, re.MULTILINE)  # Docker's DNS
    if shutil.which("haproxy"):  # the image's HAProxy (Debian's) reads it; so must this host's
        checked = subprocess.run(["haproxy", "-c", "-f", str(ROOT / source)], capture_output=True, text=True)
        assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "option httpchk GET /health" in config and re.search(r"^\s*bind :8000$", config, re.MULTILINE)


def test_router_and_prefill_are_told_the_links_rate_and_round_trip():
    """Placement's WAN estimate and prefill's stream sizing start from the link compose runs."""
    command = SERVICES["wan-link"]["command"]
    link = {flag: command[command.index(flag) + 1] for flag in ("--bandwidth", "--rtt")}
    for name in ("router", "prefill"):
        env = resolved_env(SERVICES[name])
        assert float(env["PDD_WAN_BANDWIDTH_MBIT"]) * 1e6 == parse_rate(link["--bandwidth"]), name
        assert float(env["PDD_WAN_RTT_MS"]) == parse_ms(link["--rtt"]), name


def _wan_routes() -> list[str]:
    command = SERVICES["wan-link"]["command"]
    return [command[i + 1] for i, arg in enumerate(command) if arg == "--route"]


def test_every_process_has_a_healthcheck_and_starts_after_what_it_needs_is_healthy():
    for name in TOPOLOGY:
        spec = SERVICES[name]
        assert spec["healthcheck"]["test"][0] == "CMD", name
        for dependency, condition in (spec.get("depends_on") or {}).items():
            done = "service_completed_successfully" if dependency in DEPLOYMENT_STEPS else "service_healthy"
            assert condition == {"condition": done}, (name, dependency)
    # What uses a site's streams starts after that site's deployment step.
    for name, steps in (
        ("prefill", {"streams-a"}),
        ("main-decode", {"streams-b"}),
        ("cache-index", {"streams-a", "streams-b"}),
    ):
        assert steps <= set(SERVICES[name]["depends_on"]), name
    assert set(SERVICES["router"]["depends_on"]) == set(SERVICE_OF) - {"router"} | {"nats-a"}
    for name in ("nats-a", "nats-b"):
        assert any(v.endswith(":/data/jetstream") and not v.startswith(".") for v in SERVICES[name]["volumes"]), name
        assert v_in(COMPOSE["volumes"], SERVICES[name]["volumes"])


def v_in(volumes: dict, mounts: list[str]) -> bool:
    return any(m.split(":")[0] in volumes for m in mounts)


def test_prometheus_scrapes_every_process_on_the_port_it_serves_metrics():
    """Singletons by name; scalable services through DNS, which lists every replica."""
    config = yaml.safe_load((ROOT / "infra/observability/prometheus.yml").read_text())
    targets = {
        t for job in config["scrape_configs"] for group in job.get("static_configs", []) for t in group["targets"]
    }
    replicas = {
        f"{name}:{sd['port']}"
        for job in config["scrape_configs"]
        for sd in job.get("dns_sd_configs", [])
        for name in sd["names"]
    }
    for name in SERVICE_OF:
        env = resolved_env(SERVICES[name])
        wanted = f"{name}:{env['PDD_METRICS_PORT']}"
        assert env["PDD_METRICS_HOST"] == "0.0.0.0" and wanted in (replicas if name in SCALABLE else targets), name
    assert "wan-link:8100" in targets
    assert set(SERVICES["prometheus"]["networks"]) == {"site-a", "site-b"}


def test_the_image_resolves_the_cpu_build_of_torch_and_no_cuda_package(tmp_path):
    """``pip install --dry-run --report`` on the image's requirements (the wheelhouse takes
    torch from the PyTorch CPU index or a local wheel store; here the local one)."""
    dockerfile = (ROOT / "infra/Dockerfile").read_text()
    assert (
        "--no-index --find-links /wheelhouse" in dockerfile
        and "-r /wheelhouse/infra/requirements-image.txt" in dockerfile
    )
    assert "\nUSER pdd" in dockerfile and "\nHEALTHCHECK " in dockerfile
    assert "download.pytorch.org/whl/cpu" in (ROOT / "infra/images.py").read_text()
    report = tmp_path / "report.json"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--dry-run",
            "--ignore-installed",
            "--quiet",
            "--report",
            str(report),
            "-r",
            str(ROOT / "infra/requirements-image.txt"),
        ],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    import json

    installs = {
        i["metadata"]["name"].lower(): i["metadata"]["version"] for i in json.loads(report.read_text())["install"]
    }
    assert installs["torch"] == "2.13.0+cpu"
    cuda = sorted(n for n in installs if n.startswith(("nvidia", "cuda")) or n == "triton")
    assert not cuda, cuda


def test_each_sites_server_admits_only_the_roles_that_run_there(secrets_dir):
    """One identity per role is shared by its replicas, but each server lists only the roles
    of its own site: a main decoder's nkey is not a user of site A's server (where a
    heartbeat naming site A would pass it off as a decoder beside the prefill), and no site A
    role's is one of site B's. Admin and the leafnode are users of both as before."""
    from infra.credentials import LEAF_ROLE, Credentials
    from shared.nats_roles import ADMIN, ROLES

    creds = Credentials(secrets_dir)
    users = {site: (secrets_dir / f"nats-users-{site}.conf").read_text() for site in ("site-a", "site-b")}
    for role in ROLES:
        home = "site-b" if role == "main_decode" else "site-a"
        away = "site-a" if home == "site-b" else "site-b"
        key = creds.public_key(role)
        assert key in users[home] and key not in users[away], role
    for shared in (ADMIN, LEAF_ROLE):
        assert all(creds.public_key(shared) in text for text in users.values()), shared
