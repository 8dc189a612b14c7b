"""A deployment's secrets: a CA, a TLS certificate per server and bulk peer, NATS nkeys (one per instance, and one per
role for replicas that share a credential), the bulk secret, the WAN link's keys.

``pdd up`` (and the in-process stack) write them into ``<run dir>/secrets`` (folder 0700,
every private file 0600) once, and reuse them on the next start from the same folder;
deleting the folder rotates everything (docs/security.md). Certificates use P-256 keys,
valid for the names and addresses a deployment's processes use to reach each other.
"""

import datetime
import hashlib
import ipaddress
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

import nkeys
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from shared.bulk.auth import verify_key
from shared.bulk.link_route import route_key
from shared.nats_roles import ADMIN, ROLES

LEAF_ROLE = "leafnode"
"""The identity site B's server uses to join site A's (not a service role)."""
TLS_PEERS = {
    "nats-a": ("nats-a", "wan-link"),
    "nats-b": ("nats-b",),
    "prefill": ("prefill",),
    "relay-decode": ("relay-decode",),
    "main-decode": ("main-decode",),
}
"""Who holds a certificate of its own, and the names on it (compose and Kubernetes service
names, beside localhost and 127.0.0.1): each NATS server, and each bulk channel peer (a
receiver is dialled by its service name, whatever address reaches it). ``wan-link`` is how
site B's server reaches site A's; no other certificate carries it."""
PEER_OF_ROLE = {"prefill": "prefill", "relay_decode": "relay-decode", "main_decode": "main-decode"}
"""The certificate an engine role serves and dials the bulk channel with."""
PEER_OF_SITE = {"site-a": "nats-a", "site-b": "nats-b"}
"""The certificate a site's NATS server presents."""
VALID_DAYS = 365


@dataclass(frozen=True)
class Credentials:
    """Paths of a deployment's secrets (every file exists).

    Attributes:
        folder: The secrets folder.
        ca_file: CA certificate (PEM) every peer trusts.
        bulk_secret_file: Key of the bulk channel's flow MACs.
        link_route_key_file: Key the WAN link checks connections' routes with.
        control_key_file: Bearer key of the WAN link's control API (``/link``).
    """

    folder: Path

    @property
    def ca_file(self) -> Path:
        return self.folder / "ca.pem"

    def cert_file(self, peer: str) -> Path:
        """The certificate (PEM, signed by the CA) of ``peer``, a key of ``TLS_PEERS``."""
        return self.folder / f"{_peer(peer)}.pem"

    def key_file(self, peer: str) -> Path:
        """The private key of ``cert_file(peer)``."""
        return self.folder / f"{_peer(peer)}.key"

    @property
    def bulk_secret_file(self) -> Path:
        return self.folder / "bulk.secret"

    @property
    def link_route_key_file(self) -> Path:
        """The WAN link's route key (derived from the bulk secret; the link holds only this)."""
        return self.folder / "link-route.key"

    @property
    def bulk_verify_key_file(self) -> Path:
        """The public key that checks FlowOpen signatures (receivers hold this, not the secret)."""
        return self.folder / "bulk-verify.pub"

    @property
    def metrics_key_file(self) -> Path:
        """The bearer key of every service's ``/metrics`` (Prometheus holds it)."""
        return self.folder / "metrics.key"

    @property
    def metrics_key_sha256_file(self) -> Path:
        """Its SHA-256 (the services hold this: they check the key, they cannot present it)."""
        return self.folder / "metrics-key.sha256"

    @property
    def control_key_file(self) -> Path:
        """The WAN link control API's bearer key (``pdd wan`` and the chaos tool send it)."""
        return self.folder / "control.key"

    def seed_file(self, name: str) -> Path:
        """The NATS nkey seed of ``name``: an instance id, a service role or ``leafnode``."""
        return self.folder / f"{name}.nk"

    def public_key(self, name: str) -> str:
        """The public nkey of ``name`` (servers list these)."""
        return nkeys.from_seed(bytearray(self.seed_file(name).read_bytes().strip())).public_key.decode()


def ensure_credentials(
    folder: Path, extra_names: tuple[str, ...] = (), instance_ids: tuple[str, ...] = ()
) -> Credentials:
    """The secrets in ``folder``, generating whatever is missing (nothing is overwritten).

    ``extra_names``: DNS names the certificate also covers (the addresses one site dials the
    other's at, across clusters); they apply when the certificate is made. ``instance_ids``:
    instances that get an nkey of their own (``<instance>.nk``).
    """
    folder.mkdir(parents=True, exist_ok=True)
    os.chmod(folder, 0o700)
    creds = Credentials(folder)
    for name in (*ROLES, ADMIN, LEAF_ROLE, *instance_ids):
        if not creds.seed_file(name).is_file():
            write_private(creds.seed_file(name), _new_user_seed())
    for key_file in (creds.bulk_secret_file, creds.control_key_file, creds.metrics_key_file):
        if not key_file.is_file():
            write_private(key_file, secrets.token_hex(32).encode())
    # Always the current bulk secret's: a replaced secret must not leave a stale derived key.
    bulk_secret = creds.bulk_secret_file.read_text().strip()
    metrics_key = creds.metrics_key_file.read_text().strip()
    for path, key in (
        (creds.link_route_key_file, route_key(bulk_secret).encode()),
        (creds.bulk_verify_key_file, verify_key(bulk_secret).encode()),
        (creds.metrics_key_sha256_file, hashlib.sha256(metrics_key.encode()).hexdigest().encode()),
    ):
        if not path.is_file() or path.read_bytes() != key:
            write_private(path, key)
    certificates = [creds.ca_file, *(f(peer) for peer in TLS_PEERS for f in (creds.cert_file, creds.key_file))]
    if not all(path.is_file() for path in certificates):
        _write_certificates(creds, extra_names)  # all at once: the CA's key is not kept
    return creds


def _peer(peer: str) -> str:
    if peer not in TLS_PEERS:
        raise ValueError(f"no certificate for {peer!r}; peers are {', '.join(TLS_PEERS)}")
    return peer


def give_to(folder: Path, uid: int, gid: int):
    """Hand the folder and its files to ``uid:gid`` (the user containers run as), modes kept."""
    for path in (folder, *folder.iterdir()):
        os.chown(path, uid, gid)


def _new_user_seed() -> bytes:
    # nkeys encodes a 32-byte Ed25519 seed with its prefix and checksum (an "SU…" seed).
    return nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER)


def write_private(path: Path, data: bytes):
    """Write ``data`` to ``path`` readable by its owner only (0600, also when it existed)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)  # O_CREAT's mode applies only to a new file
    with os.fdopen(fd, "wb") as file:
        file.write(data)


def _write_certificates(creds: Credentials, extra_names: tuple[str, ...] = ()):
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"pdd deployment CA {secrets.token_hex(4)}")])
    now = datetime.datetime.now(datetime.UTC)
    ca = _ca_certificate(ca_key, ca_name, now)
    pem = serialization.Encoding.PEM
    for peer, own_names in TLS_PEERS.items():
        key = ec.generate_private_key(ec.SECP256R1())
        dialled_across = extra_names if peer in PEER_OF_SITE.values() else ()
        names = [x509.DNSName(n) for n in dict.fromkeys((*own_names, "localhost", *dialled_across))] + [
            x509.IPAddress(ipaddress.ip_address("127.0.0.1"))
        ]
        cert = _peer_certificate(peer, names, key, ca_key, ca_name, now)
        write_private(
            creds.key_file(peer),
            key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()),
        )
        write_private(creds.cert_file(peer), cert.public_bytes(pem))
    write_private(creds.ca_file, ca.public_bytes(pem))
    # The CA's key is not kept: nothing signs after start-up, and a stolen key could mint peers.


def _ca_certificate(ca_key: ec.EllipticCurvePrivateKey, ca_name: x509.Name, now: datetime.datetime) -> x509.Certificate:
    """The CA's self-signed certificate: signs peer certificates only (no intermediates), valid
    from five minutes before ``now`` for ``VALID_DAYS``."""
    return (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=VALID_DAYS))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=True,
                crl_sign=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .sign(ca_key, hashes.SHA256())
    )


def _peer_certificate(
    peer: str,
    names: list[x509.GeneralName],
    key: ec.EllipticCurvePrivateKey,
    ca_key: ec.EllipticCurvePrivateKey,
    ca_name: x509.Name,
    now: datetime.datetime,
) -> x509.Certificate:
    """``peer``'s certificate for ``key``, valid for ``names`` as server and as client, signed
    by the CA, valid from five minutes before ``now`` for ``VALID_DAYS``."""
    return (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, peer)]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=VALID_DAYS))
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
