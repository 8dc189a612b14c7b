"""Measure a WAN link profile on loopback: what N parallel streams carry, and how long a small
control message takes while bulk streams fill the link.

Each call runs a real ``WanLink`` in this event loop between real TCP senders and receivers
on 127.0.0.1, all in one direction (site A → site B). Python's own speed caps what the
emulator can carry (see ``docs/design.md``), so compare results against the profile.
"""

import asyncio
from dataclasses import dataclass, replace

from infra.wan_link import LinkProfile, Route, WanLink
from infra.wan_schedule import BULK, CONTROL

WRITE_BYTES = 1 << 20


async def measure_streams(profile: LinkProfile, num_streams: int, megabytes: float, timeout_s: float = 120.0) -> float:
    """Send ``megabytes`` MiB in all, split evenly over ``num_streams`` connections through a
    link with ``profile``, to a sink; return Gbit/s.

    The rate is all bytes × 8 over the seconds from the first write to the last byte reaching
    the sink, so it includes one one-way delay and the first window's ramp; send enough for
    those to be small (several RTTs' worth).

    Raises:
        TimeoutError: not everything arrived within ``timeout_s``.
    """
    per_stream_bytes = int(megabytes * (1 << 20)) // num_streams
    total_bytes = per_stream_bytes * num_streams
    received_bytes, landed = 0, asyncio.Event()

    async def sink(reader, writer):
        nonlocal received_bytes
        while data := await reader.read(1 << 20):
            received_bytes += len(data)
            if received_bytes >= total_bytes:
                landed.set()
        writer.close()

    async with _Endpoints(profile) as ends:
        port = await ends.route("probe-bulk", BULK, await ends.server(sink))
        writers = [(await asyncio.open_connection("127.0.0.1", port))[1] for _ in range(num_streams)]
        ends.writers += writers
        loop = asyncio.get_running_loop()
        started = loop.time()
        senders = [asyncio.create_task(_send(writer, per_stream_bytes)) for writer in writers]
        ends.tasks += senders
        await asyncio.wait_for(landed.wait(), timeout_s)
        return total_bytes * 8 / (loop.time() - started) / 1e9


@dataclass(frozen=True)
class ControlDelay:
    """One control message's crossing while bulk streams filled the link.

    Attributes:
        delay_s: From writing the message to the link until it arrived at the far end.
        waiting_bulk_bytes: Bulk bytes the link had read and not yet put on the wire when the
            message was written: what a message without priority queues behind.
    """

    delay_s: float
    waiting_bulk_bytes: int


async def measure_control_delay(
    profile: LinkProfile, bulk_streams: int, message_bytes: int = 256, timeout_s: float = 30.0
) -> ControlDelay:
    """Saturate the link with ``bulk_streams`` bulk connections, then send one
    ``message_bytes`` message on a control route in the same direction and time its crossing.

    The message goes once every bulk stream has delivered its first bytes (the link's queue is
    full). ``profile.control_priority`` decides whether it may go ahead of the waiting bulk.

    Raises:
        TimeoutError: the bulk streams or the message did not arrive within ``timeout_s``.
    """
    loop = asyncio.get_running_loop()
    flowing, all_flowing = 0, asyncio.Event()
    arrived_at, arrived, accepted = [], asyncio.Event(), asyncio.Event()

    async def bulk_sink(reader, writer):
        nonlocal flowing
        if await reader.read(1 << 20):
            flowing += 1
            if flowing == bulk_streams:
                all_flowing.set()
        while await reader.read(1 << 20):
            pass
        writer.close()

    async def control_sink(reader, writer):
        accepted.set()
        await reader.readexactly(message_bytes)
        arrived_at.append(loop.time())
        arrived.set()
        writer.close()

    async with _Endpoints(profile) as ends:
        bulk_port = await ends.route("probe-bulk", BULK, await ends.server(bulk_sink))
        control_port = await ends.route("probe-control", CONTROL, await ends.server(control_sink))
        _, control = await asyncio.open_connection("127.0.0.1", control_port)
        ends.writers.append(control)
        await asyncio.wait_for(accepted.wait(), timeout_s)
        for _ in range(bulk_streams):
            _, writer = await asyncio.open_connection("127.0.0.1", bulk_port)
            ends.writers.append(writer)
            ends.tasks.append(asyncio.create_task(_send(writer, None)))
        await asyncio.wait_for(all_flowing.wait(), timeout_s)
        waiting_bulk_bytes = sum(d["bulk"] for d in ends.link.snapshot()["waiting_bytes_per_direction"].values())
        sent_at = loop.time()
        control.write(b"c" * message_bytes)
        await asyncio.wait_for(arrived.wait(), timeout_s)
        return ControlDelay(arrived_at[0] - sent_at, waiting_bulk_bytes)


async def _send(writer, num_bytes: int | None):
    """Write ``num_bytes`` (None: until cancelled) as fast as the connection takes them."""
    block, sent = bytes(WRITE_BYTES), 0
    while num_bytes is None or sent < num_bytes:
        size = WRITE_BYTES if num_bytes is None else min(WRITE_BYTES, num_bytes - sent)
        writer.write(block[:size] if size < WRITE_BYTES else block)
        await writer.drain()
        sent += size


class _Endpoints:
    """A link with ``profile`` (a copy) plus the servers, writers and tasks a probe starts; all
    closed on exit."""

    def __init__(self, profile: LinkProfile):
        self.link = WanLink(replace(profile))
        self.servers, self.writers, self.tasks = [], [], []

    async def server(self, handler) -> int:
        server = await asyncio.start_server(handler, "127.0.0.1", 0)
        self.servers.append(server)
        return server.sockets[0].getsockname()[1]

    async def route(self, name: str, traffic: str, target_port: int) -> int:
        return await self.link.add_route(Route(name, "127.0.0.1", 0, "127.0.0.1", target_port, "site-a", traffic))

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        for writer in self.writers:
            writer.close()
        await self.link.close()
        for server in self.servers:
            server.close()
