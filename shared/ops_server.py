"""Every service's operations endpoint: ``/metrics`` for Prometheus, ``/health`` for probes.

``/metrics`` asks for the deployment's metrics key (``Authorization: Bearer <key>``) when the
service holds its SHA-256: the service can check the key but never present it, so one
compromised container cannot read the others' metrics. ``/health`` answers anyone (probes).

It runs on the service's own event loop, so a loop that stops turning fails the liveness
probe instead of answering from a side thread.
"""

import hashlib
import hmac
from collections.abc import Callable
from dataclasses import dataclass

from aiohttp import web

from shared.metrics import exposition


@dataclass
class OpsServer:
    """A running operations endpoint."""

    runner: web.AppRunner
    port: int

    async def stop(self):
        """Stop answering."""
        await self.runner.cleanup()


def key_matches(authorization: str, key_sha256: str) -> bool:
    """Whether an ``Authorization`` header carries the bearer key whose SHA-256 is ``key_sha256``."""
    scheme, _, key = authorization.partition(" ")
    digest = hashlib.sha256(key.strip().encode()).hexdigest()
    return scheme.lower() == "bearer" and hmac.compare_digest(digest, key_sha256.strip().lower())


async def start_ops_server(
    host: str, port: int, health: Callable[[], tuple[bool, dict]], metrics_key_sha256: str = ""
) -> OpsServer:
    """Serve ``/metrics`` and ``/health`` on ``host:port`` (port 0: any free one).

    Args:
        health: Returns (healthy, details): 200 with the details when healthy, else 503.
        metrics_key_sha256: When set, ``/metrics`` answers 401 without the matching bearer key.
    """

    async def metrics(request):
        if metrics_key_sha256 and not key_matches(request.headers.get("Authorization", ""), metrics_key_sha256):
            return web.json_response(
                {"error": "the metrics key is required"}, status=401, headers={"WWW-Authenticate": "Bearer"}
            )
        body, content_type = exposition()
        return web.Response(body=body, headers={"Content-Type": content_type})

    async def health_check(request):
        healthy, details = health()
        return web.json_response(
            {"status": "ok" if healthy else "unavailable", **details}, status=200 if healthy else 503
        )

    app = web.Application()
    app.add_routes([web.get("/metrics", metrics), web.get("/health", health_check)])
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    return OpsServer(runner, site._server.sockets[0].getsockname()[1])
