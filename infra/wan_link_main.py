"""The WAN link as a process: its routes plus the HTTP control API ``pdd wan`` talks to."""

from pathlib import Path

from aiohttp import web

from infra.wan_link import WanLink, control_app, parse_profile, parse_route
from shared.logging import configure_logging
from shared.service import wait_for_termination


async def run_wan_link(args):
    """Serve the link until SIGTERM."""
    configure_logging(args.log_level)
    key = Path(args.route_key_file).read_text().strip() if args.route_key_file else ""
    link = WanLink(parse_profile(args.bandwidth, args.rtt, args.jitter, args.seed), route_key=key)
    for text in args.route:
        await link.add_route(parse_route(text))
    runner = web.AppRunner(control_app(link), access_log=None)
    await runner.setup()
    await web.TCPSite(runner, args.control_host, args.control_port).start()
    await wait_for_termination()
    await runner.cleanup()
    await link.close()
