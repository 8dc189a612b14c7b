"""A request the relay decodes eagerly until main decode takes it over."""

from services.relay_decode.handoff import HandoffMachine, HandoffPolicy
from shared.decode_request import DecodeRequest, RequestTable
from shared.messages import FlowOpen, KvReady


class RelayedRequest(DecodeRequest):
    """What the relay holds for one request, besides what every decoding service holds.

    Attributes:
        machine: Its handoff decisions (one-shot or catch-up, chunk by chunk).
        main_decoder: The main decoder its ``FlowOpen`` named: the only one whose
            ``KvReady`` counts.
        ready: That main decoder's ``KvReady``, once heard (it may come before the relay's
            own import is complete).
    """

    tracer_name = "pdd.relay_decode"

    def __init__(self, flow_open: FlowOpen, table: RequestTable, policy: HandoffPolicy):
        super().__init__(flow_open, table)
        self.machine = HandoffMachine(self.request_id, policy)
        self.main_decoder = flow_open.main_decode_instance_id
        self.ready: KvReady | None = None

    @property
    def handing_over(self) -> bool:
        """Whether a handoff task is still working for it."""
        return any(not task.done() for task in self.tasks)
