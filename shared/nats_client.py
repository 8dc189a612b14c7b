"""Connecting to a site's NATS server as one role: nkey signature, TLS, the role's inbox prefix."""

import ssl

import nats

from shared.nats_roles import inbox_prefix


def tls_context(ca_file: str, cert_file: str = "", key_file: str = "",
                purpose: ssl.Purpose = ssl.Purpose.SERVER_AUTH) -> ssl.SSLContext:
    """A TLS context trusting only the deployment's CA (with our certificate when given)."""
    context = ssl.create_default_context(purpose, cafile=ca_file)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    if cert_file:
        context.load_cert_chain(cert_file, key_file or None)
    return context


async def connect(url: str, *, role: str, seed_file: str = "", ca_file: str = "", name: str = "",
                  **options) -> nats.NATS:
    """Connect as ``role``. With ``seed_file`` and ``ca_file`` (a locked-down deployment) the
    client signs the server's challenge with the role's nkey over TLS; without them it
    connects anonymously, which a locked-down server refuses."""
    secure = {}
    if ca_file:
        secure.update(tls=tls_context(ca_file), tls_handshake_first=True)
    if seed_file:
        secure["nkeys_seed"] = seed_file
    return await nats.connect(url, name=name or role, inbox_prefix=inbox_prefix(role), **secure, **options)
