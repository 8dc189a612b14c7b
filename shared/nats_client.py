"""Connecting to a site's NATS server as one instance: nkey signature, TLS, its inbox prefix."""

import nats

from shared.nats_roles import inbox_prefix
from shared.tls import client_context


async def connect(
    url: str, *, role: str, instance_id: str = "", seed_file: str = "", ca_file: str = "", name: str = "", **options
) -> nats.NATS:
    """Connect as instance ``instance_id`` of ``role``. With ``seed_file`` and ``ca_file`` (a
    locked-down deployment) the client signs the server's challenge with its nkey over TLS;
    without them it connects anonymously, which a locked-down server refuses. Replies come to
    the instance's own inboxes (``_INBOX.<role>.<instance>``)."""
    secure = {}
    if ca_file:
        secure.update(tls=client_context(ca_file), tls_handshake_first=True)
    if seed_file:
        secure["nkeys_seed"] = seed_file
    return await nats.connect(
        url,
        name=name or instance_id or role,
        inbox_prefix=inbox_prefix(role, instance_id or "any"),
        **secure,
        **options,
    )
