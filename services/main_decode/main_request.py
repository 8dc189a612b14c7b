"""A request main decode holds: decoded here from the start (P→MD), or handed over by a relay."""

import asyncio

from opentelemetry import trace

from shared.decode_request import DecodeRequest, RequestTable
from shared.errors import RequestCancelled
from shared.messages import FlowOpen


class MainRequest(DecodeRequest):
    """What main decode holds for one request, besides what every decoding service holds.

    Attributes:
        relay_id: The relay whose handoff it takes (set once the prompt's KV is in, from the
            flow's ``FlowOpen``); None for P→MD.
        absorbing: Resolved when the catch-up chunk being absorbed is computed (its handoff
            is answered then); None between chunks.
        recompute_span: The final handoff's ``main.recompute`` span, ended by the first
            token main decode samples after it.
    """

    tracer_name = "pdd.main_decode"

    def __init__(self, flow_open: FlowOpen, table: RequestTable):
        super().__init__(flow_open, table)
        self.relay_id: str | None = None
        self.absorbing: asyncio.Future | None = None
        self.recompute_span: trace.Span | None = None

    def absorb(self) -> asyncio.Future:
        """A new catch-up chunk is being absorbed: the future its answer waits for."""
        self.absorbing = asyncio.get_running_loop().create_future()
        return self.absorbing

    def absorbed(self, num_tokens: int):
        """The chunk in absorption is computed; main decode now holds KV for ``num_tokens`` outputs."""
        absorbing, self.absorbing = self.absorbing, None
        if absorbing is not None and not absorbing.done():
            absorbing.set_result(num_tokens)

    def end_recompute_span(self):
        """End the final handoff's recompute span, if open."""
        span, self.recompute_span = self.recompute_span, None
        if span is not None:
            span.end()

    def _release(self, reason: str):
        self.end_recompute_span()
        absorbing, self.absorbing = self.absorbing, None
        if absorbing is not None and not absorbing.done():  # its handoff is answered at once
            absorbing.set_exception(RequestCancelled(f"request closed while absorbing: {reason}"))
            absorbing.exception()  # seen: nobody may be waiting any more
