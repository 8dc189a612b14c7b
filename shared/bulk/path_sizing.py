"""How many connections a KV flow is striped over, and how large their socket buffers are,
from the path's bandwidth-delay product (BDP).

One TCP connection carries at most its window per round trip: over 40 ms with this host's
4 MiB ``tcp_wmem`` maximum that is ~0.84 Gbit/s, whatever the link's rate. A flow therefore
stripes its frames over ``ceil(BDP / window)`` connections (at most ``MAX_STREAMS``), and each
connection's send and receive buffers hold its share of the BDP (never above the kernel's
limit, which would silently cap them lower than asked).
"""

import math
from dataclasses import dataclass
from pathlib import Path

MAX_STREAMS = 8
"""Most connections one flow is striped over (the receiver refuses a FlowOpen asking more)."""
DEFAULT_WINDOW_BYTES = 4 << 20
"""A connection's window when the kernel's limit cannot be read (this host's ``tcp_wmem`` max)."""


def kernel_window_bytes() -> int:
    """The largest send buffer TCP autotuning gives a connection here (``tcp_wmem``'s maximum)."""
    try:
        return int(Path("/proc/sys/net/ipv4/tcp_wmem").read_text().split()[2])
    except (OSError, IndexError, ValueError):
        return DEFAULT_WINDOW_BYTES


def kernel_buffer_max_bytes() -> int:
    """The largest ``SO_SNDBUF`` / ``SO_RCVBUF`` a process may set (the lower of ``wmem_max``, ``rmem_max``)."""
    try:
        wmem = int(Path("/proc/sys/net/core/wmem_max").read_text())
        rmem = int(Path("/proc/sys/net/core/rmem_max").read_text())
    except (OSError, ValueError):
        return 0
    return min(wmem, rmem)


def bdp_bytes(rate_bps: float, rtt_ms: float) -> int:
    """Bytes in flight that fill a path of ``rate_bps`` bits/s and ``rtt_ms`` round trip."""
    return math.ceil(max(0.0, rate_bps) * max(0.0, rtt_ms) / 1000 / 8)


def default_streams(rate_bps: float, rtt_ms: float, window_bytes: int) -> int:
    """Connections that fill the path: ``ceil(BDP / window_bytes)``, at least 1, at most ``MAX_STREAMS``."""
    if window_bytes <= 0:
        return 1
    return max(1, min(MAX_STREAMS, math.ceil(bdp_bytes(rate_bps, rtt_ms) / window_bytes)))


def socket_buffer_bytes(rate_bps: float, rtt_ms: float, streams: int, kernel_max_bytes: int) -> int:
    """Each connection's ``SO_SNDBUF`` / ``SO_RCVBUF``: its share of the BDP, capped at
    ``kernel_max_bytes``; 0 (leave the kernel's autotuning alone) when the BDP is below 64 KiB,
    as on one site's network, or the kernel's limit is unknown."""
    share = math.ceil(bdp_bytes(rate_bps, rtt_ms) / max(1, streams))
    if share < 64 << 10 or kernel_max_bytes <= 0:
        return 0
    return min(share, kernel_max_bytes)


@dataclass(frozen=True)
class PathStreams:
    """How a path's flows use the network.

    Attributes:
        streams: Connections each flow is striped over.
        buffer_bytes: Each new connection's ``SO_SNDBUF`` / ``SO_RCVBUF`` (0: the kernel's autotuning).
    """

    streams: int
    buffer_bytes: int


def plan_path(rate_bps: float, rtt_ms: float, window_bytes: int = 0, streams: int = 0) -> PathStreams:
    """A path's streams: ``streams`` if set (> 0), else ``default_streams`` for a connection
    window of ``window_bytes`` (0: ``kernel_window_bytes``); buffers sized to the BDP's share."""
    window_bytes = window_bytes or kernel_window_bytes()
    count = streams or default_streams(rate_bps, rtt_ms, window_bytes)
    return PathStreams(count, socket_buffer_bytes(rate_bps, rtt_ms, count, kernel_buffer_max_bytes()))
