"""TLS contexts trusting only the deployment's CA (NATS clients, the bulk channel)."""

import ssl


def client_context(ca_file: str, cert_file: str = "", key_file: str = "") -> ssl.SSLContext:
    """For dialling a peer: verify it against ``ca_file``; present our certificate when given."""
    context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=ca_file)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    if cert_file:
        context.load_cert_chain(cert_file, key_file or None)
    return context


def server_context(ca_file: str, cert_file: str, key_file: str) -> ssl.SSLContext:
    """For accepting peers: present our certificate; require theirs, signed by ``ca_file``."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=ca_file)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(cert_file, key_file)
    context.verify_mode = ssl.CERT_REQUIRED
    return context
