"""Every service's operations endpoint: ``/metrics`` for Prometheus, ``/health`` for probes.

It runs on the service's own event loop, so a loop that stops turning fails the liveness
probe instead of answering from a side thread.
"""

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


async def start_ops_server(host: str, port: int, health: Callable[[], tuple[bool, dict]]) -> OpsServer:
    """Serve ``/metrics`` and ``/health`` on ``host:port`` (port 0: any free one).

    Args:
        health: Returns (healthy, details): 200 with the details when healthy, else 503.
    """

    async def metrics(request):
        body, content_type = exposition()
        return web.Response(body=body, headers={"Content-Type": content_type})

    async def health_check(request):
        healthy, details = health()
        return web.json_response({"status": "ok" if healthy else "unavailable", **details},
                                 status=200 if healthy else 503)

    app = web.Application()
    app.add_routes([web.get("/metrics", metrics), web.get("/health", health_check)])
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    return OpsServer(runner, site._server.sockets[0].getsockname()[1])
