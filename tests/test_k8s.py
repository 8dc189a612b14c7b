"""The Kubernetes manifests (infra/k8s): both overlays render with ``kubectl kustomize``, every
object validates against the Kubernetes schema (``kubernetes-validate``, strict), and the
rendered services match the launcher's topology, commands and settings as the compose file does."""

import shutil
import subprocess
import sys
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from infra.cli import build_parser
from infra.launcher import SERVICE_OF, TOPOLOGY
from infra.nats_server import nats_server_binary
from infra.serve import SERVICE_CONFIGS
from shared.config import build_config, env_name, settings_of
from tests.helpers import exported_families

ROOT = Path(__file__).resolve().parent.parent
K8S_VERSION = "1.32"
SECRETS_MOUNT = "/run/secrets/pdd"


@pytest.fixture(scope="module")
def rendered(tmp_path_factory) -> dict[str, list[dict]]:
    """Each overlay's objects, rendered from a copy of infra/k8s with fresh secrets in base/secrets."""
    kubectl = shutil.which("kubectl")
    assert kubectl, "kubectl is needed to render the manifests (kubectl kustomize)"
    copy = tmp_path_factory.mktemp("k8s") / "k8s"
    shutil.copytree(ROOT / "infra/k8s", copy, ignore=shutil.ignore_patterns("secrets"))
    secrets = subprocess.run(
        [sys.executable, "-m", "infra.cli", "secrets", "--out", str(copy / "base/secrets")],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert secrets.returncode == 0, secrets.stderr
    out = {}
    for site in ("site-a", "site-b"):
        result = subprocess.run([kubectl, "kustomize", str(copy / "overlays" / site)], capture_output=True, text=True)
        assert result.returncode == 0, result.stderr
        out[site] = [doc for doc in yaml.safe_load_all(result.stdout) if doc]
    out["secrets_dir"] = copy / "base/secrets"
    return out


def objects(rendered, site: str, kind: str) -> dict[str, dict]:
    return {o["metadata"]["name"]: o for o in rendered[site] if o["kind"] == kind}


@pytest.mark.parametrize("site", ["site-a", "site-b"])
def test_every_object_validates_against_the_kubernetes_schema(rendered, site):
    for obj in rendered[site]:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


@pytest.mark.parametrize("site", ["site-a", "site-b"])
def test_each_site_runs_the_launchers_services_there(rendered, site):
    deployments = set(objects(rendered, site, "Deployment"))
    expected = {name for name, sites in TOPOLOGY.items() if sites == (site,) and name in SERVICE_OF}
    assert deployments == expected | ({"bulk-gateway"} if site == "site-b" else set())
    assert set(objects(rendered, site, "StatefulSet")) == {f"nats-{site[-1]}"}


def container_env(rendered, site: str, deployment: dict) -> dict[str, str]:
    config_maps = objects(rendered, site, "ConfigMap")
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    env = {}
    for source in container.get("envFrom", []):
        env.update(config_maps[source["configMapRef"]["name"]]["data"])
    env.update({e["name"]: e["value"] for e in container.get("env", []) if "value" in e})
    return env


@pytest.mark.parametrize("site", ["site-a", "site-b"])
def test_commands_and_settings_are_the_launchers(rendered, site):
    secrets_dir = rendered["secrets_dir"]
    for name, deployment in objects(rendered, site, "Deployment").items():
        if name == "bulk-gateway":
            continue  # a WAN link, not a service (test_main_decode_scales_behind_the_bulk_gateway)
        container = deployment["spec"]["template"]["spec"]["containers"][0]
        args = build_parser().parse_args(container["command"][1:])
        assert container["command"][0] == "pdd" and args.command == "serve" and args.service == SERVICE_OF[name]
        cls = SERVICE_CONFIGS[SERVICE_OF[name]]
        env = container_env(rendered, site, deployment)
        env = {k: v.replace("$(POD_IP)", "10.0.0.7").replace(SECRETS_MOUNT, str(secrets_dir)) for k, v in env.items()}
        from_fields = {e["name"] for e in container["env"] if "valueFrom" in e} - {"POD_IP"}
        known = {env_name(f.name) for f in settings_of(cls)}
        assert set(env) | from_fields <= known | {"POD_IP"}, sorted(set(env) - known)
        config = build_config(cls, {}, {**env, "PDD_INSTANCE_ID": f"{name}-abc12"}, service=name)
        assert config.site == site and config.nats_url == f"tls://nats-{site[-1]}:4222"
        assert config.nats_seed_file == str(secrets_dir / f"{SERVICE_OF[name]}.nk")
        # Only prefill signs FlowOpens; the receivers hold the key that checks them.
        assert config.bulk_secret == ((secrets_dir / "bulk.secret").read_text().strip() if name == "prefill" else "")
        if name in ENGINES - {"prefill"}:
            assert config.bulk_verify_key == (secrets_dir / "bulk-verify.pub").read_text().strip()
        assert bool(config.tls_cert_file and config.tls_key_file) == (name in ENGINES), name
        assert config.metrics_port == 9090 and config.metrics_host == "0.0.0.0"


def test_router_and_prefill_hold_the_same_wan_path(rendered):
    """Placement's WAN estimate and prefill's stream sizing describe one path: set both."""
    deployments = objects(rendered, "site-a", "Deployment")
    router, prefill = (container_env(rendered, "site-a", deployments[n]) for n in ("router", "prefill"))
    for name in ("PDD_WAN_BANDWIDTH_MBIT", "PDD_WAN_RTT_MS"):
        assert router[name] == prefill[name], name


ENGINES = {"prefill", "relay-decode", "main-decode"}
POD_SECRETS = {  # each TLS peer its own certificate, for its own name; each server its site's users
    ("site-a", "StatefulSet", "nats-a"): {"ca.pem", "nats-users-site-a.conf", "nats-a.pem", "nats-a.key"},
    ("site-b", "StatefulSet", "nats-b"): {
        "ca.pem",
        "nats-users-site-b.conf",
        "nats-b.pem",
        "nats-b.key",
        "nats-leaf-remote.conf",
    },
    ("site-a", "Job", "streams"): {"ca.pem", "admin.nk"},
    ("site-b", "Job", "streams"): {"ca.pem", "admin.nk"},
    ("site-b", "Deployment", "bulk-gateway"): {"link-route.key", "control.key"},
    ("site-a", "Deployment", "router"): {"ca.pem", "metrics-key.sha256", "router.nk"},
    ("site-a", "Deployment", "cache-index"): {"ca.pem", "metrics-key.sha256", "cache_index.nk"},
    ("site-a", "Deployment", "prefill"): {
        "ca.pem",
        "metrics-key.sha256",
        "prefill.pem",
        "prefill.key",
        "bulk.secret",
        "prefill.nk",
    },
    **{
        (site, "Deployment", name): {
            "ca.pem",
            "metrics-key.sha256",
            f"{name}.pem",
            f"{name}.key",
            "bulk-verify.pub",
            f"{SERVICE_OF[name]}.nk",
        }
        for site, name in (("site-a", "relay-decode"), ("site-b", "main-decode"))
    },
}
"""The items of the one Secret each pod mounts: its own credential, and nobody else's."""


@pytest.mark.parametrize("site", ["site-a", "site-b"])
def test_each_pod_mounts_only_its_own_secrets(rendered, site):
    pods = {
        (site, kind, name): obj
        for kind in ("Deployment", "StatefulSet", "Job")
        for name, obj in objects(rendered, site, kind).items()
    }
    assert set(pods) == {key for key in POD_SECRETS if key[0] == site}
    for key, obj in pods.items():
        volumes = [v for v in obj["spec"]["template"]["spec"]["volumes"] if "secret" in v]
        assert len(volumes) == 1, key
        assert {item["key"] for item in volumes[0]["secret"]["items"]} == POD_SECRETS[key], key


@pytest.mark.parametrize("site", ["site-a", "site-b"])
def test_a_job_makes_the_sites_streams_as_admin(rendered, site):
    container = objects(rendered, site, "Job")["streams"]["spec"]["template"]["spec"]["containers"][0]
    args = build_parser().parse_args(container["command"][1:])
    assert (args.command, args.site, args.nats_url) == ("streams", site, f"tls://nats-{site[-1]}:4222")
    assert args.seed_file == f"{SECRETS_MOUNT}/admin.nk" and args.ca_file == f"{SECRETS_MOUNT}/ca.pem"


def test_main_decode_scales_behind_the_bulk_gateway(rendered):
    """Replicas share one address: the gateway's routed port, which forwards each flow to the
    pod address it names, checking the route with the route key (the only secret it holds)."""
    from infra.wan_link import parse_route

    deployments = objects(rendered, "site-b", "Deployment")
    main = deployments["main-decode"]
    env = container_env(rendered, "site-b", main)
    assert main["spec"]["replicas"] > 1 and env["PDD_BULK_ADVERTISE"] == "$(POD_IP):9100"
    gateway = deployments["bulk-gateway"]["spec"]["template"]["spec"]
    args = build_parser().parse_args(gateway["containers"][0]["command"][1:])
    assert args.service == "wan_link" and args.route_key_file == "/run/secrets/pdd/link-route.key"
    assert args.control_host == "0.0.0.0" and args.control_key_file == "/run/secrets/pdd/control.key"
    route = parse_route(args.route[0])
    link_host, _, link_port = env["PDD_BULK_LINK"].rpartition(":")
    service = objects(rendered, "site-b", "Service")[link_host.split(".")[0]]
    assert service["spec"]["selector"] == {"app.kubernetes.io/name": "bulk-gateway"}
    assert route.routed and route.target_port == 9100 and route.listen_port == int(link_port)
    assert gateway["volumes"][0]["secret"]["items"] == [
        {"key": "link-route.key", "path": "link-route.key"},
        {"key": "control.key", "path": "control.key"},
    ]


def test_routers_run_as_replicas_behind_one_service_each_its_own_instance(rendered):
    """Two router replicas behind the ``router`` Service; each names itself after its pod (its
    requests, cancels and leases are its own) and is ready only once it serves."""
    router = objects(rendered, "site-a", "Deployment")["router"]
    env = {e["name"]: e for e in router["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert router["spec"]["replicas"] >= 2
    assert env["PDD_INSTANCE_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    service = objects(rendered, "site-a", "Service")["router"]
    assert service["spec"]["selector"] == router["spec"]["selector"]["matchLabels"]
    probe = router["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]
    assert probe["httpGet"]["path"] == "/health"


@pytest.mark.parametrize("site", ["site-a", "site-b"])
def test_probes_resources_secrets_and_jetstream_volumes(rendered, site):
    secret = next(iter(objects(rendered, site, "Secret").values()))
    assert {"ca.pem", "nats-a.pem", "main-decode.key", "bulk.secret", f"nats-users-{site}.conf"} <= set(secret["data"])
    for name, deployment in objects(rendered, site, "Deployment").items():
        pod = deployment["spec"]["template"]["spec"]
        container = pod["containers"][0]
        for probe in ("readinessProbe", "livenessProbe"):
            assert container[probe]["httpGet"] == {"path": "/health", "port": "metrics"}, name
        assert {"cpu", "memory"} <= set(container["resources"]["requests"]), name
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert [v["secret"]["secretName"] for v in pod["volumes"]] == [secret["metadata"]["name"]]
    nats = next(iter(objects(rendered, site, "StatefulSet").values()))
    assert nats["spec"]["volumeClaimTemplates"][0]["metadata"]["name"] == "jetstream"
    mounts = {m["name"]: m["mountPath"] for m in nats["spec"]["template"]["spec"]["containers"][0]["volumeMounts"]}
    assert mounts["jetstream"] == "/data/jetstream" and mounts["secrets"] == "/etc/nats/secrets"


@pytest.mark.parametrize("site", ["site-a", "site-b"])
def test_nats_config_is_the_compose_one_and_valid(rendered, site, tmp_path):
    ours = (ROOT / "infra/k8s/overlays" / site / "nats.conf").read_text()
    compose = (ROOT / "infra/nats" / f"{site}.conf").read_text()
    differing = set(ours.splitlines()) ^ set(compose.splitlines())
    allowed = {
        "http: 127.0.0.1:8222",
        "http: 0.0.0.0:8222",
        '    url: "tls://wan-link:17422"',
        '    url: "tls://nats-a.site-a.example.com:7422"',
    }
    assert {line for line in differing if not line.startswith("#")} <= allowed
    config_map = next(c for c in objects(rendered, site, "ConfigMap").values() if "site.conf" in c["data"])
    server = objects(rendered, site, "StatefulSet")[f"nats-{site[-1]}"]["spec"]["template"]["spec"]
    items = next(v for v in server["volumes"] if "secret" in v)["secret"]["items"]
    (tmp_path / "secrets").mkdir()
    for item in items:  # the pod's view of the Secret: each item at its path
        (tmp_path / "secrets" / item["path"]).symlink_to(Path(rendered["secrets_dir"]) / item["key"])
    conf = tmp_path / "site.conf"
    conf.write_text(config_map["data"]["site.conf"].replace("/etc/nats/secrets", str(tmp_path / "secrets")))
    check = subprocess.run([nats_server_binary(), "-c", str(conf), "-t"], capture_output=True, text=True)
    assert check.returncode == 0, check.stderr


def test_the_hpa_example_scales_on_a_metric_we_export(rendered):
    hpa = objects(rendered, "site-a", "HorizontalPodAutoscaler")["prefill"]
    metric = hpa["spec"]["metrics"][0]["pods"]["metric"]["name"]
    assert metric in exported_families()
    assert hpa["spec"]["scaleTargetRef"]["name"] in objects(rendered, "site-a", "Deployment")
