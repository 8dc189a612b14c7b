"""docker-compose.yml checked against the launcher's topology (Docker cannot run here).

Same processes on the same sites, every ``pdd`` command accepted by the CLI, every ``PDD_*``
variable a known and valid setting of that service, NATS configs accepted by nats-server,
and WAN-link routes that lead to services that exist.
"""

import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from infra.launcher import SERVICE_OF, TOPOLOGY
from infra.nats_server import nats_server_binary
from infra.serve import SERVICE_CONFIGS, parse_route
from shared.cli import build_parser
from shared.config import build_config, env_name, settings_of

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
SERVICES = COMPOSE["services"]


def pdd_services():
    return [(name, spec) for name, spec in SERVICES.items() if spec.get("command", [""])[0] == "pdd"]


SECRETS_MOUNT = "/run/secrets/pdd"


def resolved_env(spec, secrets_dir: Path | None = None) -> dict[str, str]:
    """Compose ``${VAR:-default}`` substitution with nothing set: the default; the mounted
    secrets folder read from ``secrets_dir`` when given."""
    env = {k: re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", str(v)) for k, v in (spec.get("environment") or {}).items()}
    if secrets_dir is not None:
        env = {k: v.replace(SECRETS_MOUNT, str(secrets_dir)) for k, v in env.items()}
    return env


@pytest.fixture(scope="module")
def secrets_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("compose") / "secrets"
    assert subprocess.run([sys.executable, "-m", "shared.cli", "secrets", "--out", str(out)],
                          capture_output=True, text=True, cwd=ROOT).returncode == 0
    return out


def test_same_processes_on_the_same_sites_as_the_launcher():
    assert set(SERVICES) - {"jaeger"} == set(TOPOLOGY)
    for name, sites in TOPOLOGY.items():
        assert sorted(SERVICES[name]["networks"]) == sorted(sites), name


@pytest.mark.parametrize("name,spec", pdd_services(), ids=[n for n, _ in pdd_services()])
def test_every_command_is_accepted_by_the_cli(name, spec):
    args = build_parser().parse_args(spec["command"][1:])
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
    assert config.bulk_secret == (secrets_dir / "bulk.secret").read_text().strip()
    assert Path(config.tls_ca_file).is_file() and Path(config.tls_cert_file).is_file()


def test_compose_refuses_to_start_without_its_secrets():
    """Every secret comes from the mounted folder, which ``${PDD_SECRETS_DIR:?…}`` requires
    (compose stops with that message when it is unset); no secret has a default."""
    text = (ROOT / "docker-compose.yml").read_text()
    assert "PDD_BULK_SECRET:" not in text and ":-change" not in text
    for name, spec in SERVICES.items():
        if name in ("jaeger", "wan-link"):  # the link forwards bytes it cannot read: it holds no secret
            continue
        mounts = [v for v in spec.get("volumes", []) if v.endswith((f":{SECRETS_MOUNT}:ro", ":/etc/nats/secrets:ro"))]
        assert len(mounts) == 1 and mounts[0].startswith("${PDD_SECRETS_DIR:?"), name


def test_nats_configs_are_valid_and_joined_through_the_wan_link(tmp_path, secrets_dir):
    routes = {r.name: r for r in (parse_route(t) for t in _wan_routes())}
    for site in ("site-a", "site-b"):
        text = (ROOT / "infra" / "nats" / f"{site}.conf").read_text()
        # The same file beside the secrets, as the container mounts them (includes are relative).
        (tmp_path / "secrets").is_symlink() or (tmp_path / "secrets").symlink_to(secrets_dir)
        conf = tmp_path / f"{site}.conf"
        conf.write_text(text.replace("/etc/nats/secrets", str(tmp_path / "secrets")))
        check = subprocess.run([nats_server_binary(), "-c", str(conf), "-t"], capture_output=True, text=True)
        assert check.returncode == 0, check.stderr
        assert f'domain: "{site}"' in text and "handshake_first: true" in text
        assert 'include "secrets/nats-users.conf"' in text
    leaf = routes["leafnode"]
    assert (leaf.target_host, leaf.target_port, leaf.from_site) == ("nats-a", 7422, "site-b")
    assert f"tls://wan-link:{leaf.listen_port}" in (ROOT / "infra/nats/site-b.conf").read_text()


def test_bulk_paths_lead_to_the_decoders():
    routes = {r.name: r for r in (parse_route(t) for t in _wan_routes())}
    main_env, relay_env = resolved_env(SERVICES["main-decode"]), resolved_env(SERVICES["relay-decode"])
    bulk = routes["bulk-main-decode-0"]
    assert (bulk.target_host, str(bulk.target_port)) == ("main-decode", main_env["PDD_BULK_PORT"])
    assert main_env["PDD_BULK_ADVERTISE"] == f"wan-link:{bulk.listen_port}"
    assert relay_env["PDD_BULK_ADVERTISE"] == f"relay-decode:{relay_env['PDD_BULK_PORT']}"
    assert (ROOT / SERVICES["router"]["build"]["dockerfile"]).is_file()


def _wan_routes() -> list[str]:
    command = SERVICES["wan-link"]["command"]
    return [command[i + 1] for i, arg in enumerate(command) if arg == "--route"]
