"""docker-compose.yml checked against the launcher's topology (Docker cannot run here).

Same processes on the same sites, every ``pdd`` command accepted by the CLI, every ``PDD_*``
variable a known and valid setting of that service, NATS configs accepted by nats-server,
and WAN-link routes that lead to services that exist.
"""

import re
import subprocess
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


def resolved_env(spec) -> dict[str, str]:
    """Compose ``${VAR:-default}`` substitution with nothing set: the default."""
    return {k: re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", str(v))
            for k, v in (spec.get("environment") or {}).items()}


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
def test_every_variable_is_a_known_valid_setting(name):
    cls = SERVICE_CONFIGS[SERVICE_OF[name]]
    env = resolved_env(SERVICES[name])
    known = {env_name(f.name) for f in settings_of(cls)}
    assert set(env) <= known, f"{name}: unknown settings {sorted(set(env) - known)}"
    config = build_config(cls, {}, env, service=name)
    assert config.site == TOPOLOGY[name][0]
    assert config.nats_url == f"nats://nats-{config.site[-1]}:4222"


def test_nats_configs_are_valid_and_joined_through_the_wan_link(tmp_path):
    routes = {r.name: r for r in (parse_route(t) for t in _wan_routes())}
    for site in ("site-a", "site-b"):
        conf = ROOT / "infra" / "nats" / f"{site}.conf"
        check = subprocess.run([nats_server_binary(), "-c", str(conf), "-t"], capture_output=True, text=True)
        assert check.returncode == 0, check.stderr
        assert f'domain: "{site}"' in conf.read_text()
    leaf = routes["leafnode"]
    assert (leaf.target_host, leaf.target_port, leaf.from_site) == ("nats-a", 7422, "site-b")
    assert f"nats-leaf://wan-link:{leaf.listen_port}" in (ROOT / "infra/nats/site-b.conf").read_text()


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
