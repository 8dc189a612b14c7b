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
    return StreamConfig(
        name=STREAM_NAME,
        subjects=[subjects.kv_events(site, "*")],
        storage=StorageType.FILE,
        max_age=MAX_AGE_S,
        max_bytes=MAX_BYTES,
        duplicate_window=120,
    )


async def wait_for_stream(js, stream: str, timeout_s: float = 30.0):
    """Return once ``stream`` exists (services only look streams up: a deployment step with an
    admin identity makes them, ``infra/streams.py``); raise ``nats.js.errors.NotFoundError``
    or a timeout when it is still missing after ``timeout_s``.

    Retries while JetStream is still starting, the leafnode to a remote domain is not up yet,
    or the deployment step has not run yet.
    """
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        try:
            await js.stream_info(stream)
            return
        except (
            nats.js.errors.NotFoundError,
            nats.js.errors.ServiceUnavailableError,
            nats.errors.NoRespondersError,
            nats.errors.TimeoutError,
        ):
            if asyncio.get_running_loop().time() > deadline:
                raise
            await asyncio.sleep(0.2)


async def replay(nc: nats.NATS, site: str, callback):
    """Ordered consumer over ``site``'s stream, from its first message, then live (once the
    stream exists)."""
    js = nc.jetstream(domain=site)
    await wait_for_stream(js, STREAM_NAME)
    return await js.subscribe(
        subjects.kv_events(site, "*"), cb=callback, ordered_consumer=True, deliver_policy=DeliverPolicy.ALL
    )
