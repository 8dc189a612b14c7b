"""The relay's side of P→RLD→MD, simulated: eager decoding, the ``HandoffMachine``'s chunks
as token IDs to main decode, and the relay finishing a request itself."""

from loadtest.sim.flight import Flight
from loadtest.sim.instance import Chunked, DecodeSeq, SimEngine
from services.relay_decode.handoff import HandoffMachine, HandoffState


class RelayPath:
    """Every relayed request of one simulation (``sim``: the ``Simulator`` it belongs to)."""

    def __init__(self, sim):
        self.sim, self.d, self.events = sim, sim.d, sim.events
        self.by_name, self.wan, self.handoff = sim.by_name, sim.wan, sim.handoff

    def start(self, flight: Flight, relay: SimEngine):
        request = flight.request
        relay.pool.pin(request.session, self.sim.blocks(request))
        relay.pool.set_chain(request.session, request.prompt_blocks(self.d.block_size))
        flight.machine = HandoffMachine(f"r{request.session}.{request.turn}", self.handoff)
        self.sim.deliver(flight, 1, self.events.now, 0.0, "RLD")
        flight.relay_seq = DecodeSeq(
            flight,
            request.output_tokens - 1,
            request.prompt_tokens + 1,
            lambda s, n, first, gap: self._relay_tokens(flight, relay, n, first, gap),
            lambda s: self._relay_finished(flight, relay),
        )
        if request.output_tokens <= 1:
            self._relay_finished(flight, relay)
            return
        relay.add_decode(flight.relay_seq)

    def _relay_load(self, relay: SimEngine) -> float:
        return (len(relay.running) + len(relay.waiting)) / relay.max_sequences

    def _emitted(self, flight: Flight) -> int:
        self.by_name[flight.placement.relay_decode.instance_id].settle()
        return 1 + flight.relay_seq.emitted

    def _relay_tokens(self, flight: Flight, relay: SimEngine, count: int, first_s: float, gap_s: float):
        self.sim.deliver(flight, count, first_s, gap_s, "RLD")
        machine = flight.machine
        if machine.state is HandoffState.CATCH_UP and machine.in_flight is None:
            self._send_chunk(flight, relay, machine.tokens_emitted(self._emitted(flight), self._relay_load(relay)))

    def kv_ready(self, flight: Flight):
        relay = self.by_name[flight.placement.relay_decode.instance_id]
        if flight.relay_done or flight.machine is None or flight.machine.state is not HandoffState.DECODING:
            if flight.machine is None:  # the relay's KV has not even landed: look again soon
                self.events.after(0.001, lambda: self.kv_ready(flight))
            return
        chunk = flight.machine.kv_ready(self._emitted(flight), self._relay_load(relay))
        self._send_chunk(flight, relay, chunk)

    def _send_chunk(self, flight: Flight, relay: SimEngine, chunk):
        if chunk is None:
            flight.relay_seq.one_token_steps = flight.machine.state is HandoffState.CATCH_UP
            return
        flight.relay_seq.one_token_steps = False
        if chunk.final:
            relay.drop(flight.relay_seq)  # paused: it hands over everything it emitted
            end = self._emitted(flight)
        else:
            end = chunk.end_index
        main = self.sim.main_of(flight)
        tokens = end - chunk.start_index
        context = flight.request.prompt_tokens + chunk.start_index
        self.events.after(
            self.sim.one_way(),
            lambda: main.add_chunked(Chunked(tokens, context, lambda: self._extended(flight, relay, main, chunk, end))),
        )

    def _extended(self, flight: Flight, relay: SimEngine, main: SimEngine, chunk, end: int):
        if chunk.final:
            flight.result.handoff_mode = chunk.mode
            remaining = flight.request.output_tokens - end
            if remaining > 0:
                self.sim.deliver(flight, 1, self.events.now, 0.0, "MD")
            self.sim.md_decode(flight, main, remaining - 1, flight.request.prompt_tokens + end + 1)
            if remaining <= 0:
                return
        self.events.after(self.sim.one_way(), lambda: self._accepted(flight, relay, end))

    def _accepted(self, flight: Flight, relay: SimEngine, next_index: int):
        machine = flight.machine
        if machine.done or machine.in_flight is None:
            return
        chunk = machine.accepted(next_index, self._emitted(flight), self._relay_load(relay))
        if machine.state is HandoffState.RELEASED:
            self._relay_free(flight, relay, next_index)
        else:
            self._send_chunk(flight, relay, chunk)

    def _relay_finished(self, flight: Flight, relay: SimEngine):
        machine = flight.machine
        if machine.state is HandoffState.RELEASED or (machine.in_flight is not None and machine.in_flight.final):
            return  # its last tokens were already on their way to main decode
        flight.relay_done = True
        flight.machine.finished_locally()
        flight.result.finished_on = "RLD"
        if flight.odd.relay_finished() and flight.wan_flow is not None:
            self.wan.cancel(flight.wan_flow)
            flight.result.wan_cancelled = True
            self.sim.flows.claim_done(flight)
            self.sim.flows.release_room(flight)
        elif flight.odd.state.value == "wan_cancelled":
            flight.result.wan_cancelled = True
        if flight.md_ready and flight.placement.pipeline != "P-MD" and not flight.result.wan_cancelled:
            # main decode held the prompt, waiting for a handoff that will not come
            self.sim.unpin_main(flight, flight.request.prompt_blocks(self.d.block_size))
        self._relay_free(flight, relay, flight.request.output_tokens)

    def _relay_free(self, flight: Flight, relay: SimEngine, emitted: int):
        request = flight.request
        if flight.relay_freed:
            return
        flight.relay_freed = True
        relay.drop(flight.relay_seq)
        relay.pool.unpin(
            request.session,
            self.sim.blocks(request),
            request.block_ids[: (request.prompt_tokens + emitted) // self.d.block_size],
        )
        self.sim.flows.release_room(flight, "relay")
