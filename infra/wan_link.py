"""The WAN link: a TCP shaping proxy every byte between the two sites goes through.

Each route forwards connections from one site to a service at the other (the NATS leafnode,
a main decoder's bulk KV port). Both directions of the link have a capacity shared by all
routes and connections (one bandwidth budget per direction), a base RTT split into two
one-way delays, seeded jitter, optional stalls, and a partition switch that freezes all
traffic until it is lifted. Order within a connection is always preserved. Everything is
adjustable at runtime through a small HTTP control API (``pdd wan``).

Two properties of a long real path are emulated as well:

- **A window per connection** (``window_bytes``; 0, the default: none). A chunk read from a
  sender is in flight from when it is read until its delivery plus half the base RTT (the
  acknowledgement's return); the link reads no more from that connection and direction while
  its in-flight bytes reach the window. One connection then carries at most about
  ``window_bytes / RTT`` (4 MiB over 40 ms: 0.84 Gbit/s), however fast the link; several share
  the link's rate.
- **Control before bulk.** Each route is ``control`` or ``bulk`` (``Route.traffic``; a route
  named ``leafnode…`` is control by default, any other bulk). A direction's wire takes waiting
  control chunks before waiting bulk ones (``infra/wan_schedule.py``), so a handoff or token
  message waits for at most the one bulk chunk (``CHUNK_BYTES``) already on the wire, not for
  the KV read behind it. Connections of one class take turns on the wire, a chunk each.
  ``control_priority=False`` turns priority off (control connections take turns with bulk).

A route's target may be ``*`` (a routed port): each connection then names its own target
in a signed ``LinkRoute`` (``shared/bulk/link_route.py``), so one port reaches every main
decoder at the far site, however many replicas run.
"""

import argparse
import asyncio
import hmac
import random
import re
import socket
from dataclasses import asdict, dataclass, field

import structlog
from aiohttp import web

from infra.wan_schedule import BULK, CHUNK_BYTES, CONTROL, FlowGate, LinkSchedule
from shared.bulk.framing import read_message
from shared.bulk.link_route import RouteAuthenticator
from shared.errors import KvFrameError
from shared.messages import LinkRoute

log = structlog.get_logger(__name__)
ROUTE_TIMEOUT_S = 5.0
"""A connection to a routed port must name its target within this."""
MAX_ROUTE_BYTES = 4 << 10
ANY = "*"
ACCEPT_BUFFER_BYTES = 2 * CHUNK_BYTES
"""Kernel receive buffer of a connection into the link: about what one read takes."""


@dataclass
class LinkProfile:
    """How the link behaves.

    Attributes:
        bandwidth_bps: Capacity per direction in bits/s; 0 for unlimited.
        rtt_ms: Base round-trip time.
        jitter_ms: Standard deviation of the extra one-way delay per chunk.
        stall_probability: Chance per chunk that the link stalls.
        stall_ms: Length of a stall.
        partitioned: When True nothing crosses until it is False again.
        seed: Seed of the jitter and stall draws.
        window_bytes: Most bytes one connection may have in flight per direction (read, not
            yet acknowledged); 0 for no limit.
        control_priority: Whether control routes' chunks go on the wire before waiting bulk ones.
    """

    bandwidth_bps: float = 100e6
    rtt_ms: float = 40.0
    jitter_ms: float = 5.0
    stall_probability: float = 0.0
    stall_ms: float = 0.0
    partitioned: bool = False
    seed: int = 0
    window_bytes: int = 0
    control_priority: bool = True


@dataclass(frozen=True)
class Route:
    """A forwarded port.

    Attributes:
        name: Label for stats (``leafnode``, ``bulk-main_decode-0``…).
        listen_host: Address the link listens on.
        listen_port: Port it listens on (0: any).
        target_host: Where connections go; ``*``: where each connection's signed
            ``LinkRoute`` says (a routed port).
        target_port: Target port; for a routed port the only port a route may name (0: any).
        from_site: Site the connecting side is at (decides the direction of each byte).
        traffic: ``control`` (goes on the wire ahead of bulk) or ``bulk``; "" picks control
            for a name starting with ``leafnode``, bulk otherwise.
    """

    name: str
    listen_host: str
    listen_port: int
    target_host: str
    target_port: int
    from_site: str = "site-a"
    traffic: str = ""

    def __post_init__(self):
        if not self.traffic:
            object.__setattr__(self, "traffic", CONTROL if self.name.startswith("leafnode") else BULK)
        if self.traffic not in (CONTROL, BULK):
            raise ValueError(f"route {self.name!r}: traffic {self.traffic!r} is neither {CONTROL} nor {BULK}")

    @property
    def routed(self) -> bool:
        """Whether each connection names its own target."""
        return self.target_host == ANY

    @property
    def control(self) -> bool:
        """Whether this route's chunks go on the wire ahead of bulk ones."""
        return self.traffic == CONTROL


@dataclass
class _Direction:
    schedule: LinkSchedule
    bytes: int = 0
    queued_bytes: int = 0  # read from the sender, not yet delivered (in flight on the "wire")


@dataclass
class _RouteStats:
    connections: int = 0
    bytes_forward: int = 0
    bytes_reverse: int = 0
    refused: int = 0
    targets: dict = field(default_factory=dict)  # routed ports: connections per target


class WanLink:
    """The emulated link with its routes."""

    def __init__(self, profile: LinkProfile | None = None, route_key: str = ""):
        self.profile = profile or LinkProfile()
        # One for every routed port: a route's nonce is spent on all of them.
        self._routes_auth = RouteAuthenticator(route_key) if route_key else None
        self._rng = random.Random(self.profile.seed)
        self._directions = {
            name: _Direction(LinkSchedule(lambda: self.profile.bandwidth_bps))
            for name in ("site-a->site-b", "site-b->site-a")
        }
        self._open = asyncio.Event()
        self._open.set()
        self._servers: dict[str, asyncio.Server] = {}
        self.routes: dict[str, Route] = {}
        self.stats: dict[str, _RouteStats] = {}
        self._tasks: set[asyncio.Task] = set()

    def set_profile(self, **changes) -> LinkProfile:
        """Change the profile at runtime; unknown fields raise ValueError."""
        unknown = set(changes) - set(asdict(self.profile))
        if unknown:
            raise ValueError(f"unknown link settings: {sorted(unknown)}")
        for name, value in changes.items():
            setattr(self.profile, name, type(getattr(self.profile, name))(value))
        if "seed" in changes:
            self._rng.seed(self.profile.seed)
        if self.profile.partitioned:
            self._open.clear()
        else:
            self._open.set()
        log.info("wan_profile_set", **asdict(self.profile))
        return self.profile

    async def add_route(self, route: Route) -> int:
        """Start forwarding ``route``; return the port it listens on.

        Raises:
            ValueError: a routed port without a route key.
        """
        if route.routed and self._routes_auth is None:
            raise ValueError(f"routed port {route.name!r} needs the route key (--route-key-file)")
        server = await asyncio.start_server(
            lambda r, w: self._accept(route, r, w), sock=_listening_socket(route), limit=CHUNK_BYTES
        )
        port = server.sockets[0].getsockname()[1]
        self._servers[route.name] = server
        self.routes[route.name] = route
        self.stats[route.name] = _RouteStats()
        return port

    async def close(self):
        """Stop every route and connection."""
        for server in self._servers.values():
            server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for direction in self._directions.values():
            direction.schedule.close()

    def snapshot(self) -> dict:
        """Profile and counters, for ``pdd wan show``."""
        return {
            "profile": asdict(self.profile),
            "routes": {n: {**asdict(r), **asdict(self.stats[n])} for n, r in self.routes.items()},
            "bytes_per_direction": {d: s.bytes for d, s in self._directions.items()},
            "queued_bytes_per_direction": {d: s.queued_bytes for d, s in self._directions.items()},
            "waiting_bytes_per_direction": {d: dict(s.schedule.waiting_bytes) for d, s in self._directions.items()},
        }

    async def _accept(self, route: Route, client_reader, client_writer):
        task = asyncio.current_task()
        self._tasks.add(task)
        stats = self.stats[route.name]
        stats.connections += 1
        other = "site-b" if route.from_site == "site-a" else "site-a"
        try:
            target = await self._target(route, client_reader, stats, f"{route.from_site}->{other}")
            if target is not None:
                await self._open.wait()
                target_reader, target_writer = await asyncio.open_connection(*target)
        except (TimeoutError, OSError, asyncio.CancelledError):
            target = None
        if target is None:
            client_writer.close()
            self._tasks.discard(task)
            return
        forward = asyncio.create_task(
            self._pipe(client_reader, target_writer, f"{route.from_site}->{other}", stats, True, route.control)
        )
        reverse = asyncio.create_task(
            self._pipe(target_reader, client_writer, f"{other}->{route.from_site}", stats, False, route.control)
        )
        try:
            await asyncio.gather(forward, reverse)
        except asyncio.CancelledError:
            forward.cancel()
            reverse.cancel()
        finally:
            client_writer.close()
            target_writer.close()
            self._tasks.discard(task)

    async def _target(self, route: Route, reader, stats: _RouteStats, direction: str) -> tuple[str, int] | None:
        """Where this connection goes: the route's target, or the one its LinkRoute names."""
        if not route.routed:
            return route.target_host, route.target_port
        try:
            message, size = await asyncio.wait_for(read_message(reader, None, MAX_ROUTE_BYTES), ROUTE_TIMEOUT_S)
        except KvFrameError as exc:
            return _refuse(route, stats, f"no LinkRoute: {exc}")
        # The opening crossed the link like any other byte.
        stats.bytes_forward += size
        self._directions[direction].bytes += size
        if not isinstance(message, LinkRoute):
            return _refuse(route, stats, "first message is not a LinkRoute")
        problem = self._routes_auth.verify(message, allowed_port=route.target_port)
        if problem is not None:
            return _refuse(route, stats, problem, target=message.target)
        stats.targets[message.target] = stats.targets.get(message.target, 0) + 1
        host, _, port = message.target.rpartition(":")
        return host, int(port)

    async def _pipe(self, reader, writer, direction: str, stats: _RouteStats, forward: bool, control: bool):
        """Read as the wire and the connection's window allow; deliver in order (``_deliver``)."""
        queue: asyncio.Queue = asyncio.Queue()
        link, gate = self._directions[direction], FlowGate()
        deliver = asyncio.create_task(self._deliver(queue, writer, link, gate))
        try:
            while True:
                # Not reading is how the sender feels the link: TCP back-pressure.
                data = await reader.read(await gate.room(self.profile.window_bytes, self.profile.bandwidth_bps))
                if not data:
                    break
                await self._open.wait()
                profile = self.profile
                stall_s = 0.0
                if profile.stall_probability and self._rng.random() < profile.stall_probability:
                    stall_s = profile.stall_ms / 1000
                sent = link.schedule.submit(gate, len(data), control and profile.control_priority, stall_s)
                gate.read(len(data), sent)
                link.bytes += len(data)
                link.queued_bytes += len(data)
                if forward:
                    stats.bytes_forward += len(data)
                else:
                    stats.bytes_reverse += len(data)
                one_way_s = max(0.0, profile.rtt_ms / 2000 + self._rng.gauss(0, profile.jitter_ms / 1000))
                queue.put_nowait((sent, one_way_s, data))
        except (ConnectionError, OSError):
            pass
        finally:
            queue.put_nowait((None, 0.0, None))
            await asyncio.gather(deliver, return_exceptions=True)

    async def _deliver(self, queue: asyncio.Queue, writer, link: _Direction, gate: FlowGate):
        """Write each chunk one one-way delay after the wire sent it, never before an earlier one;
        half the base RTT after it was due, its acknowledgement frees its bytes in the window."""
        loop, last_delivery, undelivered = asyncio.get_running_loop(), 0.0, 0
        try:
            while True:
                sent, one_way_s, data = await queue.get()
                if data is None:
                    break
                undelivered = len(data)
                last_delivery = max(last_delivery, await sent + one_way_s)
                delay = last_delivery - loop.time()
                if delay > 0:
                    await asyncio.sleep(delay)
                await self._open.wait()
                writer.write(data)
                link.queued_bytes -= undelivered
                undelivered = 0
                # Timed from the due delivery, not the write: a late wake-up here must not shrink the window.
                loop.call_at(last_delivery + self.profile.rtt_ms / 2000, gate.acknowledged, len(data))
                await writer.drain()
            if writer.can_write_eof():
                writer.write_eof()
        except (ConnectionError, OSError):
            pass
        finally:
            link.queued_bytes -= undelivered  # undelivered when the connection broke: no longer queued
            while not queue.empty():
                _, _, data = queue.get_nowait()
                link.queued_bytes -= len(data or b"")


def _listening_socket(route: Route) -> socket.socket:
    """The route's listening socket. Its connections' kernel receive buffers are set to
    ``ACCEPT_BUFFER_BYTES`` (inherited from the listener) rather than autotuned to megabytes,
    so bytes the link has not read stay in the sender's socket as not yet sent, as over a real
    path, where only a window's worth is in flight (``BulkConnection.unsent_bytes`` relies on it)."""
    family = socket.AF_INET6 if ":" in route.listen_host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, ACCEPT_BUFFER_BYTES)
        sock.bind((route.listen_host, route.listen_port))
        sock.listen(socket.SOMAXCONN)
    except BaseException:
        sock.close()
        raise
    sock.setblocking(False)
    return sock


def _refuse(route: Route, stats: _RouteStats, reason: str, **fields) -> None:
    """Count and log a connection a routed port will not forward."""
    stats.refused += 1
    log.warning("wan_route_refused", route=route.name, reason=reason, **fields)


# --- units and control API ---------------------------------------------------------------

_RATE = re.compile(r"^\s*([0-9.]+)\s*(bit|kbit|mbit|gbit|bps|kbps|mbps|gbps)?\s*$", re.IGNORECASE)
_TIME = re.compile(r"^\s*([0-9.]+)\s*(us|ms|s)?\s*$", re.IGNORECASE)
_RATE_UNITS = {"bit": 1, "bps": 1, "kbit": 1e3, "kbps": 1e3, "mbit": 1e6, "mbps": 1e6, "gbit": 1e9, "gbps": 1e9}
_SIZE = re.compile(r"^\s*([0-9.]+)\s*(b|kb|kib|mb|mib|gb|gib)?\s*$", re.IGNORECASE)
_SIZE_UNITS = {"b": 1, "kb": 1e3, "kib": 1 << 10, "mb": 1e6, "mib": 1 << 20, "gb": 1e9, "gib": 1 << 30}


def parse_rate(text: str) -> float:
    """``100mbit`` → 1e8 bits/s; ``0`` or ``unlimited`` → 0 (no cap)."""
    if text.strip().lower() in ("0", "unlimited", "none"):
        return 0.0
    match = _RATE.match(text)
    if not match:
        raise ValueError(f"bandwidth {text!r}: use e.g. 100mbit, 1gbit, unlimited")
    return float(match.group(1)) * _RATE_UNITS[(match.group(2) or "bit").lower()]


def parse_ms(text: str) -> float:
    """``40ms`` → 40.0, ``1s`` → 1000.0, ``250us`` → 0.25 (bare numbers are ms)."""
    match = _TIME.match(text)
    if not match:
        raise ValueError(f"duration {text!r}: use e.g. 40ms or 1s")
    unit = (match.group(2) or "ms").lower()
    return float(match.group(1)) * {"us": 1e-3, "ms": 1.0, "s": 1000.0}[unit]


def parse_bytes(text: str) -> int:
    """``4MiB`` → 4194304, ``4mb`` → 4000000, ``65536`` → 65536 (bare numbers are bytes; KiB,
    MiB, GiB are powers of 1024, kB, MB, GB of 1000; case does not matter)."""
    match = _SIZE.match(text)
    if not match:
        raise ValueError(f"size {text!r}: use e.g. 4MiB, 512KiB, 4mb or a number of bytes")
    return int(float(match.group(1)) * _SIZE_UNITS[(match.group(2) or "b").lower()])


def parse_profile(bandwidth: str, rtt: str, jitter: str, seed: int = 0, window: str = "0") -> LinkProfile:
    """A profile from the command-line spellings (``100mbit``, ``40ms``, ``5ms``, ``4MiB``)."""
    return LinkProfile(
        bandwidth_bps=parse_rate(bandwidth),
        rtt_ms=parse_ms(rtt),
        jitter_ms=parse_ms(jitter),
        seed=seed,
        window_bytes=parse_bytes(window),
    )


def parse_route(text: str) -> "Route":
    """``leafnode=127.0.0.1:17422>127.0.0.1:7422@site-b`` → Route.

    A target of ``*`` (any port) or ``*:PORT`` makes a routed port: each connection names
    its target (``bulk=0.0.0.0:19100>*:9100@site-a``). ``@SITE:control`` or ``@SITE:bulk``
    sets the route's traffic class; without it a route named ``leafnode…`` is control, any
    other bulk.

    Raises:
        argparse.ArgumentTypeError: the text is not ``NAME=HOST:PORT>HOST:PORT@SITE[:CLASS]``.
    """
    try:
        name, rest = text.split("=", 1)
        listen, rest = rest.split(">", 1)
        target, rest = rest.split("@", 1)
        from_site, _, traffic = rest.partition(":")
        listen_host, listen_port = listen.rsplit(":", 1)
        if target in (ANY, f"{ANY}:{ANY}"):
            target = f"{ANY}:0"
        target_host, target_port = target.rsplit(":", 1)
        if not name or not from_site:
            raise ValueError(text)
        return Route(name, listen_host, int(listen_port), target_host, int(target_port), from_site, traffic)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"route {text!r}: expected NAME=HOST:PORT>HOST:PORT@SITE[:control|:bulk] (target * or *:PORT: "
            "each connection names its own)"
        ) from None


def control_app(link: WanLink, control_key: str = "") -> web.Application:
    """``GET /link`` shows the profile and counters; ``PUT /link`` changes the profile;
    ``GET /metrics`` is the link's Prometheus exposition, ``GET /health`` its probe.

    With ``control_key``, ``/link`` answers only requests that carry
    ``Authorization: Bearer <control_key>`` (401 otherwise); ``/metrics`` and ``/health`` stay
    open to scrapers and probes (they change nothing).
    """
    from infra.wan_link_metrics import metrics_handler

    @web.middleware
    async def require_key(request, handler):
        if control_key and request.path == "/link":
            scheme, _, given = request.headers.get("Authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), control_key.encode()):
                return web.json_response(
                    {"error": "missing or incorrect control key (send Authorization: Bearer <control.key>)"}, status=401
                )
        return await handler(request)

    async def show(request):
        return web.json_response(link.snapshot())

    async def change(request):
        try:
            link.set_profile(**await request.json())
        except (ValueError, TypeError) as exc:
            return web.json_response({"error": str(exc)}, status=400)
        return web.json_response(link.snapshot())

    app = web.Application(middlewares=[require_key])

    async def health(request):
        return web.json_response({"status": "ok", "partitioned": link.profile.partitioned})

    app.add_routes(
        [
            web.get("/link", show),
            web.put("/link", change),
            web.get("/metrics", metrics_handler(link)),
            web.get("/health", health),
        ]
    )
    return app
