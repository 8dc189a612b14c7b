"""Connecting to a site's NATS server as one role: nkey signature, TLS, the role's inbox prefix."""

import nats

from shared.nats_roles import inbox_prefix
from shared.tls import client_context


async def connect(url: str, *, role: str, seed_file: str = "", ca_file: str = "", name: str = "",
                  **options) -> nats.NATS:
    """Connect as ``role``. With ``seed_file`` and ``ca_file`` (a locked-down deployment) the
    client signs the server's challenge with the role's nkey over TLS; without them it
    connects anonymously, which a locked-down server refuses."""
    secure = {}
    if ca_file:
        secure.update(tls=client_context(ca_file), tls_handshake_first=True)
    if seed_file:
        secure["nkeys_seed"] = seed_file
    return await nats.connect(url, name=name or role, inbox_prefix=inbox_prefix(role), **secure, **options)
