"""The simulated request path, P→MD and P→RLD→MD, with the router's and the relay's own code.

Placement (``services.router.placement.place``) chooses instances and the pipeline from the
same inputs the router has: per-instance prefix hits, heartbeat loads in an
``InstanceRegistry``, the live ``WanEstimator`` (fed by simulated transfers) and the
``OddTrafficRule``; a relayed request's handoff is decided by ``HandoffMachine`` and its odd
traffic by ``OddTrafficTracker``. Only time is simulated: compute by the cost model, KV by
the links, messages by their latency.
"""

import math
import random
from collections import defaultdict

from loadtest.sim.deployment import Deployment, handoff_policy, router_policy
from loadtest.sim.events import EventQueue
from loadtest.sim.flight import Flight
from loadtest.sim.instance import Chunked, DecodeSeq, Host, SimEngine
from loadtest.sim.kv_flows import KvFlows
from loadtest.sim.kv_pool import SimKvPool
from loadtest.sim.network import LocalPath, WanPipe
from loadtest.sim.relay_path import RelayPath
from loadtest.sim.results import RequestResult, SimResult
from loadtest.sim.workload import SimRequest, Workload
from services.router.odd_traffic import OddTrafficTracker
from services.router.placement import place
from services.router.registry import InstanceRegistry
from services.router.wan_estimate import WanEstimator
from shared.messages import InstanceRef, LoadReported


def _host(deployment: Deployment, seed: int) -> Host | None:
    """The cores every engine shares (``deployment.host_cores``); None: one chip each."""
    if not deployment.host_cores:
        return None
    return Host(
        deployment.host_cores,
        deployment.threads_per_engine,
        deployment.host_speed,
        deployment.step_speeds,
        random.Random(seed) if deployment.step_noise else None,
        deployment.engine_wake_s,
    )


def _engines(events: EventQueue, deployment: Deployment, host: Host | None) -> dict[str, list[SimEngine]]:
    """Every role's engines (``<role>-<i>``), each with its own KV pool, on ``host`` if one."""
    engines: dict[str, list[SimEngine]] = {}
    for role, spec, site, caching in (
        ("prefill", deployment.prefill, "site-a", True),
        ("relay_decode", deployment.relay_decode, "site-a", True),
        ("main_decode", deployment.main_decode, deployment.md_site, deployment.md_prefix_cache),
    ):
        engines[role] = [
            SimEngine(
                events,
                f"{role}-{i}",
                role,
                site,
                spec.cost,
                SimKvPool(spec.pool_blocks, caching=caching, tier_blocks=deployment.cache_tier_blocks),
                max_sequences=spec.max_sequences,
                host=host,
            )
            for i in range(spec.count)
        ]
    return engines


class Simulator:
    """Runs one workload through one deployment."""

    def __init__(self, deployment: Deployment, seed: int = 0):
        self.d = deployment
        self.events = EventQueue()
        self.wan = WanPipe(self.events, deployment.link, seed)
        self.local = LocalPath(self.events, deployment.local_bytes_per_s, deployment.local_latency_s)
        target_s, rule, bandwidth, rtt = router_policy()
        self.ttft_target_s = deployment.ttft_target_s if deployment.ttft_target_s is not None else target_s
        self.odd_rule = deployment.odd_rule or rule
        self.estimator = WanEstimator(
            deployment.initial_wan_bps or bandwidth,
            deployment.initial_wan_rtt_s if deployment.initial_wan_rtt_s is not None else rtt,
        )
        self.handoff = deployment.handoff or handoff_policy()
        self.registry = InstanceRegistry(ttl_s=1e12)
        self.engines = _engines(self.events, deployment, _host(deployment, seed))
        self.by_name = {e.name: e for engines in self.engines.values() for e in engines}
        self.results: list[RequestResult] = []
        self._sessions: dict[int, list[SimRequest]] = defaultdict(list)
        self.flows = KvFlows(self)
        self.relay = RelayPath(self)
        self._dispatch_rng = random.Random(seed + 1) if deployment.step_noise and deployment.dispatch_spread else None

    # ----- workload ------------------------------------------------------------------------

    def run(self, workload: Workload, until_s: float = float("inf")) -> SimResult:
        """Replay ``workload``; the result covers every request that finished."""
        return self._run(workload, until_s)

    def _run(self, workload: Workload, until_s: float) -> SimResult:
        for request in workload.requests:
            self._sessions[request.session].append(request)
        for turns in self._sessions.values():
            turns.sort(key=lambda r: r.turn)
        order = sorted(self._sessions, key=lambda s: (self._sessions[s][0].start_s, s))
        if workload.concurrency:  # closed loop: sessions wait for a free slot
            self._pending_sessions = order[workload.concurrency :]
            for session in order[: workload.concurrency]:
                self.events.at(0.0, lambda s=session: self._next_turn(s))
        else:  # open loop: every session at its start, its turns one after another
            self._pending_sessions = []
            for session in order:
                first = self._sessions[session][0]
                if first.history_blocks:
                    self.events.at(first.start_s - first.think_s, lambda r=first: self._warm(r))
                self.events.at(first.start_s - first.think_s, lambda s=session: self._next_turn(s))
        self.events.run(until_s)
        return SimResult(
            self.results,
            self.wan.bytes_carried,
            self.d,
            self.events.now,
            {name: e.busy_s for name, e in self.by_name.items()},
        )

    def _next_turn(self, session: int):
        turns = self._sessions[session]
        if turns:
            request = turns.pop(0)
            if request.history_blocks and request.turn > 0:
                self._warm(request)
            self.events.after(request.think_s, lambda: self._arrive(request))
        elif self._pending_sessions:
            self._next_turn(self._pending_sessions.pop(0))

    def _warm(self, request: SimRequest):
        """The session's history lands at its home prefill and main decoder."""
        history = request.block_ids[: request.history_blocks]
        for role in ("prefill", "main_decode"):
            engines = self.engines[role]
            engines[request.session % len(engines)].pool.insert_idle(request.session, history)

    # ----- routing -------------------------------------------------------------------------

    def _report(self, engine: SimEngine):
        busy = len(engine.running) + len(engine.waiting) if engine.role != "prefill" else len(engine.chunks)
        self.registry.observe(
            LoadReported(
                instance=InstanceRef(instance_id=engine.name, site=engine.site),
                service=engine.role,
                active_sequences=busy,
                max_sequences=engine.max_sequences,
                used_blocks=engine.pool.pinned_blocks,
                total_blocks=engine.pool.capacity_blocks,
                pending_tokens=sum(work.remaining for work in engine.chunks),
                unix_s=0.0,
            )
        )

    def _arrive(self, request: SimRequest):
        flight = Flight(request, self.events.now)
        prompt_blocks = request.prompt_blocks(self.d.block_size)
        hits = {}
        for role in ("prefill", "main_decode"):
            for engine in self.engines[role]:
                hits[engine.name] = engine.pool.hit_blocks(request.session, prompt_blocks)
        for engine in self.by_name.values():
            self._report(engine)
        flight.placement = place(
            self.registry,
            hits,
            num_prompt_tokens=request.prompt_tokens,
            block_size=self.d.block_size,
            kv_bytes_per_token=self.d.kv_bytes_per_token,
            wan=self.estimator.current(),
            ttft_target_s=self.ttft_target_s,
            policy=self.d.pipeline_policy,
            odd_rule=self.odd_rule,
            max_tokens=request.max_tokens,
        )
        placement = flight.placement
        self.registry.assign(placement.instance_ids, placement.num_prompt_blocks, placement.compute_blocks)
        flight.result.pipeline = placement.pipeline
        flight.odd = OddTrafficTracker(placement.odd_traffic)
        dispatch_s = self.dispatch_s()
        flight.prefill_started_s = self.events.now + dispatch_s
        self.events.after(dispatch_s, lambda: self._start_prefill(flight))

    def dispatch_s(self) -> float:
        """A request's way from the client to its prefill engine (``Deployment.dispatch_s``)."""
        median = self.d.local_latency_s if self.d.dispatch_s is None else self.d.dispatch_s
        if self._dispatch_rng is None:
            return median
        return median * math.exp(self._dispatch_rng.gauss(0.0, self.d.dispatch_spread))

    # ----- prefill -------------------------------------------------------------------------

    def md_remote(self) -> bool:
        return self.d.md_site != "site-a"

    def _start_prefill(self, flight: Flight):
        """Open the KV flows (their handshakes overlap the compute), then prefill."""
        request, engine = flight.request, self.by_name[flight.placement.prefill.instance_id]
        main = self.main_of(flight)
        self.events.after(self.one_way(), lambda: self.flows.open(flight, main, "md"))
        if flight.placement.relay_decode:
            relay = self.by_name[flight.placement.relay_decode.instance_id]
            self.events.after(self.d.local_latency_s, lambda: self.flows.open(flight, relay, "relay"))
        blocks = request.prompt_blocks(self.d.block_size)
        cached = engine.pool.hit_blocks(request.session, blocks) * self.d.block_size
        cached = min(cached, request.prompt_tokens - 1)  # the last prompt token is always computed
        flight.result.prefill_cached_tokens = cached
        engine.pool.pin(request.session, math.ceil(request.prompt_tokens / self.d.block_size))
        engine.add_chunked(Chunked(request.prompt_tokens - cached, cached, lambda: self._prefilled(flight, engine)))

    def _prefilled(self, flight: Flight, engine: SimEngine):
        request = flight.request
        # the router stops counting the request on its prefill instance at PrefillCompleted
        self.registry.release([engine.name], flight.placement.num_prompt_blocks, flight.placement.compute_blocks)
        engine.pool.unpin(
            request.session,
            math.ceil(request.prompt_tokens / self.d.block_size),
            request.prompt_blocks(self.d.block_size),
        )
        flight.result.prefill_done_s = self.events.now - flight.arrival_s
        flight.prefilled = True
        for path in ("md", "relay"):
            self.flows.maybe_ship(flight, path)

    # ----- main decode ---------------------------------------------------------------------

    def main_of(self, flight: Flight) -> SimEngine:
        return self.by_name[flight.placement.main_decode.instance_id]

    def md_landed(self, flight: Flight, num_bytes: int, throughput_bps: float):
        if self.md_remote():
            self.estimator.add_throughput(throughput_bps, num_bytes)
            self.estimator.add_rtt(flight.handshake_s)
        main = self.main_of(flight)
        self.flows.import_kv(main, num_bytes, lambda: self.md_holds_prompt(flight, main))

    def blocks(self, request: SimRequest) -> int:
        return math.ceil((request.prompt_tokens + request.output_tokens) / self.d.block_size)

    def md_holds_prompt(self, flight: Flight, main: SimEngine):
        request = flight.request
        if flight.placement.pipeline == "P-MD":
            self._pin_main(flight, main)
            main.pool.set_chain(request.session, request.prompt_blocks(self.d.block_size))
            self.flows.claim_done(flight)
            self.deliver(flight, 1, self.events.now, 0.0, "MD")
            self.md_decode(flight, main, request.output_tokens - 1, request.prompt_tokens + 1)
            return
        flight.odd.kv_landed()
        if flight.relay_done:  # a cache fill: main decode keeps the prompt's blocks
            main.pool.pin(request.session, 0)
            main.pool.unpin(request.session, 0, request.prompt_blocks(self.d.block_size))
            self.flows.claim_done(flight)
            self.flows.release_room(flight)
            return
        self._pin_main(flight, main)
        main.pool.set_chain(request.session, request.prompt_blocks(self.d.block_size))
        self.flows.claim_done(flight)
        self.events.after(self.one_way(), lambda: self.relay.kv_ready(flight))

    def md_decode(self, flight: Flight, main: SimEngine, remaining: int, context: int):
        if remaining <= 0:
            self._md_finished(flight, main)
            return
        seq = DecodeSeq(
            flight,
            remaining,
            context,
            lambda s, n, first, gap: self.deliver(flight, n, first, gap, "MD"),
            lambda s: self._md_finished(flight, main),
            blocks=0,
        )
        main.add_decode(seq)

    def _md_finished(self, flight: Flight, main: SimEngine):
        request = flight.request
        self.unpin_main(
            flight, request.block_ids[: (request.prompt_tokens + request.output_tokens) // self.d.block_size]
        )
        flight.result.finished_on = "MD"

    def _pin_main(self, flight: Flight, main: SimEngine):
        main.pool.pin(flight.request.session, self.blocks(flight.request))
        flight.main_pinned = True

    def unpin_main(self, flight: Flight, chain: tuple[int, ...]):
        """Main decode lets go of the request (once), keeping ``chain`` cached."""
        if flight.main_pinned:
            flight.main_pinned = False
            self.main_of(flight).pool.unpin(flight.request.session, self.blocks(flight.request), chain)
        self.flows.release_room(flight)

    # ----- relay and handoff ---------------------------------------------------------------

    # ----- the client's view -----------------------------------------------------------------

    def one_way(self) -> float:
        return self.wan.one_way_s() if self.md_remote() else self.d.local_latency_s

    def deliver(self, flight: Flight, count: int, first_s: float, gap_s: float, producer: str):
        if count <= 0 or flight.done:
            return
        latency = self.one_way() if producer == "MD" else self.d.local_latency_s
        arrival = first_s + latency
        result = flight.result
        if flight.last_token_s is None:
            result.ttft_s = arrival - flight.arrival_s
        else:
            result.add_gap(max(0.0, arrival - flight.last_token_s), 1)
        result.add_gap(gap_s, count - 1)
        flight.last_token_s = arrival + gap_s * (count - 1)
        flight.delivered += count
        if producer == "RLD":
            result.eager_tokens += count
        if flight.delivered >= flight.request.output_tokens:
            self._complete(flight)

    def _complete(self, flight: Flight):
        flight.done = True
        result = flight.result
        result.e2e_s = flight.last_token_s - flight.arrival_s
        result.arrival_s = flight.arrival_s
        self.results.append(result)
        decoders = [i for i in flight.placement.instance_ids if i != flight.placement.prefill.instance_id]
        self.registry.release(decoders, flight.placement.num_prompt_blocks)
        if self._sessions:
            self.events.at(flight.last_token_s, lambda: self._next_turn(flight.request.session))
