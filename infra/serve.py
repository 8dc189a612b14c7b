"""``pdd serve <service>``: run one service as its own process."""

import asyncio

from shared.config import (
    BulkReceiverConfig,
    CacheIndexConfig,
    PrefillConfig,
    RelayDecodeConfig,
    RouterConfig,
    add_arguments,
    build_config,
)

SERVICE_CONFIGS = {
    "router": RouterConfig,
    "prefill": PrefillConfig,
    "relay_decode": RelayDecodeConfig,
    "main_decode": BulkReceiverConfig,
    "cache_index": CacheIndexConfig,
}


def add_serve_parsers(commands):
    """``pdd serve router|prefill|relay_decode|main_decode|cache_index|wan_link``, each setting
    up logging itself, at its own level."""
    serve = commands.add_parser("serve", help="run one service in this process")
    serve.set_defaults(sets_up_logging=True)
    kinds = serve.add_subparsers(dest="service", required=True)
    for name, cls in SERVICE_CONFIGS.items():
        service = kinds.add_parser(name, help=f"run {name}")
        add_arguments(service, cls)
        service.set_defaults(handler=serve_service)
    wan = kinds.add_parser("wan_link", help="run the WAN link emulator")
    wan.set_defaults(handler=serve_wan_link)
    wan.add_argument(
        "--control-host", default="127.0.0.1", help="address of the control API (/link, /metrics, /health)"
    )
    wan.add_argument("--control-port", type=int, default=8100, help="port of the control API")
    wan.add_argument(
        "--route",
        action="append",
        default=[],
        metavar="NAME=HOST:PORT>HOST:PORT@SITE[:CLASS]",
        help="forward NAME from listen HOST:PORT to target HOST:PORT; SITE is the connecting side's site; "
        "target * or *:PORT: each connection names its own (signed with the route key); CLASS control "
        "(ahead of bulk on the wire) or bulk, by default control for a NAME starting with leafnode",
    )
    wan.add_argument(
        "--control-key-file",
        default="",
        help="bearer key /link requires (pdd secrets writes control.key); needed when "
        "--control-host is not a loopback address",
    )
    wan.add_argument(
        "--route-key-file", default="", help="the route key (pdd secrets writes link-route.key): needed by routed ports"
    )
    wan.add_argument("--bandwidth", default="100mbit", help="capacity per direction (e.g. 1gbit, unlimited)")
    wan.add_argument("--rtt", default="40ms", help="base round trip")
    wan.add_argument("--jitter", default="5ms", help="standard deviation of the one-way delay")
    wan.add_argument("--seed", type=int, default=0, help="seed of the jitter and stall draws")
    wan.add_argument(
        "--window",
        default="0",
        help="most bytes one connection may have in flight per direction, e.g. 4MiB (0: no limit, the default)",
    )
    wan.add_argument("--log-level", default="info", help="debug, info, warning or error")


def serve_wan_link(args) -> int:
    """Run the WAN link emulator until SIGTERM."""
    from infra.wan_link_main import run_wan_link

    asyncio.run(run_wan_link(args))
    return 0


def serve_service(args) -> int:
    """Run the chosen service until SIGTERM."""
    from shared.logging import configure_logging
    from shared.service import run_service

    cls = SERVICE_CONFIGS[args.service]
    config = build_config(cls, vars(args), service=args.service.replace("_", "-"))
    # Before the service exists: its logger binds the configuration in force when it is made.
    configure_logging(config.log_level)
    service = _make_service(args.service, config)
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    return asyncio.run(run_service(service, freeze_start_up_heap=True))


def _make_service(name: str, config):
    if name == "router":
        from services.router.service import RouterService

        return RouterService(config)
    if name == "prefill":
        from services.prefill.service import PrefillService

        return PrefillService(config)
    if name == "relay_decode":
        from services.relay_decode.service import RelayDecodeService

        return RelayDecodeService(config)
    if name == "main_decode":
        from services.main_decode.service import MainDecodeService

        return MainDecodeService(config)
    from services.cache_index.service import CacheIndexService

    return CacheIndexService(config)
