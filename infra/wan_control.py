"""``pdd wan set|show|partition``: change the running WAN link through its control API."""

import json
import urllib.request
from pathlib import Path

from infra.wan_link import parse_bytes, parse_ms, parse_rate
from shared.errors import PddError


class WanControlError(PddError):
    """The WAN link's control API refused or could not be reached."""

    code = "wan_control_error"


def add_wan_parsers(commands, *, show_handler, set_handler, partition_handler):
    """The ``pdd wan`` subcommands, with their handlers (``pdd wan show``, ``set``, ``partition``):
    the command line's, which find the running deployment."""
    wan = commands.add_parser("wan", help="show or change the WAN link of a running deployment")
    wan.add_argument("--control-url", default=None, help="default: from the running deployment")
    wan.add_argument(
        "--control-key-file",
        default=None,
        help="the control API's key (control.key of the secrets folder); default: the running deployment's",
    )
    actions = wan.add_subparsers(dest="wan_action", required=True)
    actions.add_parser("show", help="profile and byte counters").set_defaults(handler=show_handler)
    change = actions.add_parser("set", help="change bandwidth, RTT, jitter, stalls, window or control priority")
    change.add_argument("--bandwidth", help="e.g. 100mbit, 1gbit, unlimited")
    change.add_argument("--rtt", help="e.g. 40ms")
    change.add_argument("--jitter", help="e.g. 10ms")
    change.add_argument("--stall-probability", type=float, help="chance per 64 KiB chunk of a stall")
    change.add_argument("--stall", help="stall length, e.g. 500ms")
    change.add_argument("--seed", type=int, help="reseed the jitter and stall draws")
    change.add_argument("--window", help="most bytes in flight per connection and direction, e.g. 4MiB (0: no limit)")
    change.add_argument(
        "--control-priority", choices=["on", "off"], help="on: control routes' chunks go on the wire before bulk ones"
    )
    change.set_defaults(handler=set_handler)
    partition = actions.add_parser("partition", help="cut (on) or restore (off) the link")
    partition.add_argument("state", choices=["on", "off"], help="on: nothing crosses; off: restored")
    partition.set_defaults(handler=partition_handler)


def profile_changes(args) -> dict:
    """The control API body for ``pdd wan set``."""
    changes = {}
    if args.bandwidth is not None:
        changes["bandwidth_bps"] = parse_rate(args.bandwidth)
    if args.rtt is not None:
        changes["rtt_ms"] = parse_ms(args.rtt)
    if args.jitter is not None:
        changes["jitter_ms"] = parse_ms(args.jitter)
    if args.stall_probability is not None:
        changes["stall_probability"] = args.stall_probability
    if args.stall is not None:
        changes["stall_ms"] = parse_ms(args.stall)
    if args.seed is not None:
        changes["seed"] = args.seed
    if args.window is not None:
        changes["window_bytes"] = parse_bytes(args.window)
    if args.control_priority is not None:
        changes["control_priority"] = args.control_priority == "on"
    if not changes:
        raise WanControlError(
            "nothing to set: give --bandwidth, --rtt, --jitter, --stall-probability, --stall, --seed, --window "
            "or --control-priority"
        )
    return changes


def control_key_in(secrets_folder: Path) -> str:
    """The control API key of a secrets folder (``control.key``); "" when it has none."""
    path = Path(secrets_folder) / "control.key"
    return path.read_text().strip() if path.is_file() else ""


def call(control_url: str, changes: dict | None, key: str = "") -> dict:
    """GET (``changes`` None) or PUT the link profile, with the control ``key``; return the
    link's snapshot."""
    data = json.dumps(changes).encode() if changes is not None else None
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    request = urllib.request.Request(
        control_url.rstrip("/") + "/link", data=data, method="PUT" if data else "GET", headers=headers
    )
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as exc:
        raise WanControlError(json.loads(exc.read()).get("error", str(exc))) from None
    except OSError as exc:
        raise WanControlError(f"WAN link at {control_url} unreachable: {exc}") from None
