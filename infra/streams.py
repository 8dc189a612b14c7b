"""The deployment step that makes each site's JetStream streams, with the admin identity.

No service identity may create, update or delete a stream (``shared/nats_roles.py``): a
service that could would turn a stream update (``republish``, extra subjects, lifted limits)
into publishing on any subject, capturing other traffic or filling the disk. ``pdd up`` and
the in-process stack run this step themselves; docker compose runs it as a one-shot service
per site, Kubernetes as a Job per site (``pdd streams``). Services only look streams up
(``kv_event_stream.wait_for_stream``).
"""

import asyncio

import nats
import structlog

from shared import dead_letters, kv_event_stream, nats_client
from shared.nats_roles import ADMIN

log = structlog.get_logger(__name__)


def stream_configs(site: str) -> list:
    """Every stream a site needs: its KV events and its dead letters."""
    return [kv_event_stream.stream_config(site), dead_letters.stream_config(site)]


async def create_streams(nc: nats.NATS, site: str, timeout_s: float = 30.0) -> list[str]:
    """Create ``site``'s streams on its own server (``nc``), or bring existing ones to their
    configuration; return their names. Retries while JetStream is still starting."""
    js = nc.jetstream()
    deadline = asyncio.get_running_loop().time() + timeout_s
    for config in stream_configs(site):
        while True:
            try:
                try:
                    await js.add_stream(config)
                except nats.js.errors.BadRequestError:
                    await js.update_stream(config)
                break
            except (nats.js.errors.ServiceUnavailableError, nats.errors.NoRespondersError, nats.errors.TimeoutError):
                if asyncio.get_running_loop().time() > deadline:
                    raise
                await asyncio.sleep(0.2)
        log.info("stream_ready", site=site, stream=config.name)
    return [config.name for config in stream_configs(site)]


async def create_site_streams(url: str, site: str, seed_file: str = "", ca_file: str = "") -> list[str]:
    """Connect to ``site``'s server at ``url`` as the admin and create its streams."""
    nc = await nats_client.connect(
        url,
        role=ADMIN,
        instance_id=ADMIN,
        seed_file=seed_file,
        ca_file=ca_file,
        connect_timeout=5,
        max_reconnect_attempts=10,
    )
    try:
        return await create_streams(nc, site)
    finally:
        await nc.close()
