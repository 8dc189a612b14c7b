"""The WAN link as a process: its routes plus the HTTP control API ``pdd wan`` talks to."""

import ipaddress
from pathlib import Path

from aiohttp import web

from infra.wan_link import WanLink, control_app, parse_profile, parse_route
from shared.errors import ConfigError
from shared.logging import configure_logging
from shared.service import wait_for_termination


def is_loopback(host: str) -> bool:
    """Whether ``host`` is reachable from this machine only."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


async def run_wan_link(args):
    """Serve the link until SIGTERM."""
    configure_logging(args.log_level)
    key = Path(args.route_key_file).read_text().strip() if args.route_key_file else ""
    control_key = Path(args.control_key_file).read_text().strip() if args.control_key_file else ""
    if not control_key and not is_loopback(args.control_host):
        raise ConfigError(
            f"--control-host {args.control_host} is reachable from other machines: give "
            "--control-key-file (its /link changes the link) or listen on 127.0.0.1"
        )
    link = WanLink(parse_profile(args.bandwidth, args.rtt, args.jitter, args.seed, args.window), route_key=key)
    for text in args.route:
        await link.add_route(parse_route(text))
    runner = web.AppRunner(control_app(link, control_key), access_log=None)
    await runner.setup()
    await web.TCPSite(runner, args.control_host, args.control_port).start()
    await wait_for_termination()
    await runner.cleanup()
    await link.close()
