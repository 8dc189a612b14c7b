"""One simulated request's state across the instances it runs on."""

from loadtest.sim.instance import SimEngine
from loadtest.sim.results import RequestResult
from loadtest.sim.workload import SimRequest


class Flight:
    """One request's state across instances (the simulator's bookkeeping, not a message).

    Attributes:
        request: The workload's request; ``result`` what its client sees.
        placement: The router's ``Placement``.
        delivered: Tokens the client has; ``last_token_s`` when the latest arrived.
        relay_seq, machine: The relay's sequence and its ``HandoffMachine`` (relayed requests).
        odd: Its ``OddTrafficTracker``; ``wan_flow`` its KV transfer on the WAN.
        md_ready: Main decode's import of it ended (landed or cancelled).
        relay_done: The relay finished it; ``prefilled``: its prefill is done; ``done``: answered.
        first_needed: Per path, the first token the receiver asked for at the flow's opening.
        shipped, exported: Paths shipped; start indices exported (one export per start).
        waiters: Flows of the same prefix waiting for this one's import; ``claim`` its place in
            main decode's line (``InFlightBlocks``).
        held: Per path, the receiver whose room it holds; ``room_asked_s`` since when it waited.
        open_arrived_s, open_queued_s: Per path, when the flow's opening reached the receiver,
            and how long the receiver took to answer it.
        main_pinned, relay_freed: Main decode holds its blocks; the relay let go of it.
    """

    def __init__(self, request: SimRequest, arrival_s: float):
        self.request, self.arrival_s = request, arrival_s
        self.result = RequestResult(
            request.session, request.turn, request.kind, request.prompt_tokens, request.output_tokens
        )
        self.placement = None
        self.delivered = 0
        self.last_token_s = None
        self.relay_seq = self.machine = self.odd = self.wan_flow = None
        self.md_ready = self.relay_done = self.done = self.prefilled = False
        self.handshake_s = self.prefill_started_s = self.send_s = self.opened_s = 0.0
        self.first_needed: dict[str, int] = {}
        self.shipped: set[str] = set()
        self.exported: set[int] = set()
        self.waiters: list = []
        self.claim = None
        self.held: dict[str, SimEngine] = {}
        self.room_asked_s: dict[str, float] = {}
        self.open_arrived_s: dict[str, float] = {}
        self.open_queued_s: dict[str, float] = {}
        self.main_pinned = self.relay_freed = False

    @property
    def key(self) -> str:
        """The request's name in main decode's in-flight line."""
        return f"{self.request.session}.{self.request.turn}"
