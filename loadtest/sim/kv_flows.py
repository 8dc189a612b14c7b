"""The bulk channel, simulated: flow opening, room at the receiver, in-flight dedupe, shipping
from the first needed token, and the import on the receiver's engine thread."""

from collections import defaultdict, deque

from loadtest.sim.flight import Flight
from loadtest.sim.instance import SimEngine
from shared.decode_cache import InFlightBlocks


class KvFlows:
    """Every KV flow of one simulation (``sim``: the ``Simulator`` it belongs to)."""

    def __init__(self, sim):
        self.sim, self.d, self.events = sim, sim.d, sim.events
        self.by_name, self.wan, self.local = sim.by_name, sim.wan, sim.local
        self.held: dict[str, int] = defaultdict(int)
        self._lines: dict[str, InFlightBlocks] = defaultdict(InFlightBlocks)
        self._claimed: dict[str, dict[str, Flight]] = defaultdict(dict)
        self._room_waiters: dict[str, deque] = defaultdict(deque)

    def open(self, flight: Flight, receiver: SimEngine, path: str):
        """The receiver answers a flow's opening with the first token it needs, after earlier
        flows bringing more of this prompt's leading blocks than its cache holds have landed
        (the importer's in-flight dedupe, ``shared.decode_cache.InFlightBlocks``, itself)."""
        flight.open_arrived_s[path] = self.events.now
        if path != "md":
            self._when_room(flight, receiver, path)
            return
        flight.claim = self._lines[receiver.name].claim(
            flight.key, list(flight.request.prompt_blocks(self.d.block_size))
        )
        self._claimed[receiver.name][flight.key] = flight
        self._wait_in_line(flight, receiver)

    def _wait_in_line(self, flight: Flight, receiver: SimEngine):
        request = flight.request
        cached = receiver.pool.hit_blocks(request.session, request.prompt_blocks(self.d.block_size))
        found = self._lines[receiver.name].blocker(flight.claim, cached)
        if found is None:
            self._when_room(flight, receiver, "md")
            return
        behind, _ = found
        self._claimed[receiver.name][behind].waiters.append(lambda: self._wait_in_line(flight, receiver))

    def _when_room(self, flight: Flight, receiver: SimEngine, path: str):
        """The receiver reserves the request's blocks once it has room (the importer's wait:
        fewer than ``max_sequences`` held and the blocks free)."""
        blocks = self.sim.blocks(flight.request)
        if self.held[receiver.name] < receiver.max_sequences and receiver.pool.fits(blocks):
            self.held[receiver.name] += 1
            flight.held[path] = receiver
            waited = self.events.now - flight.room_asked_s.pop(path, self.events.now)
            flight.result.room_wait_s[path] = waited
            self._flow_open_reply(flight, receiver, path)
        else:
            flight.room_asked_s.setdefault(path, self.events.now)
            self._room_waiters[receiver.name].append(lambda: self._when_room(flight, receiver, path))

    def release_room(self, flight: Flight, path: str = "md"):
        """The request no longer holds the receiver's blocks: wake the oldest flow waiting."""
        receiver = flight.held.pop(path, None)
        if receiver is None:
            return
        self.held[receiver.name] -= 1
        waiters = self._room_waiters[receiver.name]
        if waiters:
            waiters.popleft()()

    def _flow_open_reply(self, flight: Flight, receiver: SimEngine, path: str):
        """The importer's prefix lookup and ``begin_import`` are engine-thread calls."""
        if not self.d.engine_thread_io:
            self._reply(flight, receiver, path)
            return
        receiver.add_serial(0.0, lambda: receiver.add_serial(0.0, lambda: self._reply(flight, receiver, path)))

    def _reply(self, flight: Flight, receiver: SimEngine, path: str):
        request = flight.request
        first = receiver.pool.hit_blocks(request.session, request.prompt_blocks(self.d.block_size)) * self.d.block_size
        first = min(first, request.prompt_tokens)
        flight.opened_s = self.events.now
        flight.open_queued_s[path] = self.events.now - flight.open_arrived_s[path]
        latency = self.sim.one_way() if path == "md" else self.d.local_latency_s
        self.events.after(latency, lambda: self._opened(flight, path, first))

    def _opened(self, flight: Flight, path: str, first: int):
        flight.first_needed[path] = first
        if path == "md":
            # as the sender measures it: one round trip, without the receiver's wait for room
            # or for blocks in flight (FlowAccepted.queued_s)
            flight.handshake_s = self.events.now - flight.prefill_started_s - flight.open_queued_s[path]
        self.maybe_ship(flight, path)

    def maybe_ship(self, flight: Flight, path: str):
        """Export from the receiver's first needed token (once per start index) and send."""
        if not flight.prefilled or path not in flight.first_needed or path in flight.shipped:
            return
        flight.shipped.add(path)
        first = flight.first_needed[path]
        num_bytes = (flight.request.prompt_tokens - first) * self.d.kv_bytes_per_token
        export_s = (
            0.0
            if first in flight.exported
            else self.by_name[flight.placement.prefill.instance_id].cost.export_s(num_bytes)
        )
        flight.exported.add(first)
        prefill = self.by_name[flight.placement.prefill.instance_id]
        prefill.add_serial(export_s, lambda: self._send(flight, path, num_bytes))

    def _send(self, flight: Flight, path: str, num_bytes: int):
        if path == "relay":
            relay = self.by_name[flight.placement.relay_decode.instance_id]
            self.local.send(
                num_bytes, lambda _: self.import_kv(relay, num_bytes, lambda: self.sim.relay.start(flight, relay))
            )
            return
        if flight.odd.state.value == "wan_cancelled":
            self.claim_done(flight)
            self.release_room(flight)
            return
        if self.sim.md_remote():
            flight.result.wan_kv_bytes = num_bytes
            flight.send_s = self.events.now
            flight.wan_flow = self.wan.send(
                num_bytes,
                lambda bps: self.sim.md_landed(flight, num_bytes, bps),
                flight.placement.prefill.instance_id,
            )
        else:
            self.local.send(num_bytes, lambda bps: self.sim.md_landed(flight, num_bytes, bps))

    def claim_done(self, flight: Flight):
        """The flow's import ended (landed or cancelled): flows waiting behind it look again."""
        flight.md_ready = True
        main = self.sim.main_of(flight).name
        if self._claimed[main].pop(flight.key, None) is not None:
            self._lines[main].release(flight.key)
        waiters, flight.waiters = flight.waiters, []
        for wake in waiters:
            wake()

    def import_kv(self, receiver: SimEngine, num_bytes: int, then):
        """The flow's frames and its ``finish_import`` queue together on the receiver's engine
        thread (our importer does not wait for one frame before queueing the next): they run
        once the step in progress ends, before the next one."""
        receiver.add_serial(receiver.cost.import_s(num_bytes), then)
