"""KV events on JetStream: one stream per site, in that site's own JetStream domain.

Prefill and main decode instances publish their stored/evicted block events into their own
site's stream (deduplicated by ``Nats-Msg-Id``); the cache-index replays both sites' streams
from the start with ordered consumers (the remote one through the leafnode, addressed by
domain), so a restarted cache-index rebuilds what the events still cover and asks instances
for dumps where they do not.
"""

import asyncio

import nats
from nats.js.api import DeliverPolicy, StorageType, StreamConfig

from shared import subjects

STREAM_NAME = "PDD_KV_EVENTS"
MAX_AGE_S = 24 * 3600
MAX_BYTES = 256 << 20


def stream_config(site: str) -> StreamConfig:
    """The site's KV event stream."""
    return StreamConfig(name=STREAM_NAME, subjects=[subjects.kv_events(site, "*")],
                        storage=StorageType.FILE, max_age=MAX_AGE_S, max_bytes=MAX_BYTES,
                        duplicate_window=120)


async def ensure_stream(js, site: str, timeout_s: float = 15.0):
    """Create the site's stream, or bring an existing one to this configuration.

    Retries while JetStream is still starting (or the leafnode to a remote domain is not up yet).
    """
    config = stream_config(site)
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        try:
            try:
                await js.add_stream(config)
            except nats.js.errors.BadRequestError:
                await js.update_stream(config)
            return
        except (nats.js.errors.ServiceUnavailableError, nats.errors.NoRespondersError,
                nats.errors.TimeoutError):
            if asyncio.get_running_loop().time() > deadline:
                raise
            await asyncio.sleep(0.1)


async def replay(nc: nats.NATS, site: str, callback):
    """Ordered consumer over ``site``'s stream, from its first message, then live.

    Creates the stream if no publisher has yet, so start-up order does not matter.
    """
    js = nc.jetstream(domain=site)
    await ensure_stream(js, site)
    return await js.subscribe(subjects.kv_events(site, "*"), cb=callback, ordered_consumer=True,
                              deliver_policy=DeliverPolicy.ALL)
