"""The WAN link's Prometheus metrics, read from the link's own state at every scrape."""

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector


class WanLinkCollector(Collector):
    """Bytes per direction and route, bytes in flight, partition state and the shaped profile."""

    def __init__(self, link):
        self._link = link

    def collect(self):
        link, profile = self._link, self._link.profile
        sent = CounterMetricFamily("pdd_wan_bytes", "Bytes carried across the link", labels=["direction"])
        queued = GaugeMetricFamily(
            "pdd_wan_queue_bytes", "Bytes read from a sender and not yet delivered", labels=["direction"]
        )
        for name, direction in link._directions.items():
            sent.add_metric([name], direction.bytes)
            queued.add_metric([name], direction.queued_bytes)
        routes = CounterMetricFamily(
            "pdd_wan_route_bytes", "Bytes carried per forwarded route", labels=["route", "way"]
        )
        connections = CounterMetricFamily(
            "pdd_wan_route_connections", "Connections accepted per route", labels=["route"]
        )
        refused = CounterMetricFamily(
            "pdd_wan_route_refused", "Connections to a routed port refused (no valid signed route)", labels=["route"]
        )
        for name, stats in link.stats.items():
            routes.add_metric([name, "forward"], stats.bytes_forward)
            routes.add_metric([name, "reverse"], stats.bytes_reverse)
            connections.add_metric([name], stats.connections)
            refused.add_metric([name], stats.refused)
        yield from (sent, queued, routes, connections, refused)
        yield GaugeMetricFamily(
            "pdd_wan_partitioned", "1 while the link carries nothing", value=int(profile.partitioned)
        )
        yield GaugeMetricFamily(
            "pdd_wan_shaped_rate_bps", "Capacity per direction in bits/s (0: unlimited)", value=profile.bandwidth_bps
        )
        yield GaugeMetricFamily("pdd_wan_rtt_seconds", "Base round-trip time", value=profile.rtt_ms / 1000)
        yield GaugeMetricFamily(
            "pdd_wan_jitter_seconds", "Standard deviation of the one-way delay", value=profile.jitter_ms / 1000
        )
        yield GaugeMetricFamily(
            "pdd_wan_stall_probability", "Chance per chunk of a stall", value=profile.stall_probability
        )


def metrics_handler(link):
    """An aiohttp handler answering ``GET /metrics`` for ``link``."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(WanLinkCollector(link))

    async def handler(request):
        return web.Response(body=generate_latest(registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    return handler
