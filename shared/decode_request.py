"""One request a decoding service holds, and the table that holds them.

A ``DecodeRequest`` lives from its KV flow's arrival until ``close(reason)``; it owns the
request's long-lived span, its trace parent, the tasks working for it and (through the
table) its import and engine sequence. Every way a request ends here (finished, cancelled,
lease expired, failed, handed over, service stopping) goes through that one ``close``,
which frees all of it and takes the request out of the table. The relay's and main
decode's requests specialise it (``RelayedRequest``, ``MainRequest``).
"""

import asyncio
from collections.abc import Coroutine
from typing import Generic, TypeVar

from opentelemetry import trace

from shared.bulk.kv_importer import ImportState, KvImporter
from shared.engine_worker import EngineWorker
from shared.errors import InvalidRequestState
from shared.messages import FlowOpen
from shared.tracing import context_from, tracer


class DecodeRequest:
    """What a decoding service holds for one request.

    Attributes:
        request_id: The request (attempt) id.
        traceparent: The W3C parent of this request's spans here (from its ``FlowOpen``).
        span: Its long-lived span (``relay.decode`` / ``main.decode``) while open.
        tasks: Tasks working for it (the relay's handoff); cancelled when it closes.
        closed_because: Why it was closed; None while it is open.
    """

    tracer_name = "pdd.decode"
    """The tracer of its spans (each service its own)."""

    def __init__(self, flow_open: FlowOpen, table: "RequestTable"):
        self.request_id = flow_open.request_id
        self.traceparent = flow_open.traceparent
        self.span: trace.Span | None = None
        self.tasks: set[asyncio.Task] = set()
        self.closed_because: str | None = None
        self._table = table

    @property
    def closed(self) -> bool:
        """Whether ``close`` was called."""
        return self.closed_because is not None

    @property
    def import_state(self) -> ImportState | None:
        """Its KV import while the flow is still arriving (None before and after)."""
        return self._table.import_state(self.request_id)

    def start_span(self, name: str, **attributes):
        """Open this request's long-lived span (ending one already open)."""
        self.end_span()
        self.span = tracer(self.tracer_name).start_span(
            name, context=context_from(self.traceparent), attributes={"request_id": self.request_id, **attributes}
        )

    def end_span(self, **attributes):
        """End the long-lived span, if open, with ``attributes`` added."""
        span, self.span = self.span, None
        if span is not None:
            span.set_attributes(attributes)
            span.end()

    def spawn(self, work: Coroutine, name: str) -> asyncio.Task:
        """Run ``work`` for this request: its task ends, at the latest, when the request closes."""
        task = asyncio.create_task(work, name=f"{name}:{self.request_id}")
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task

    async def close(
        self, reason: str, *, cancel_tasks: bool = True, sequence_freed: bool = False, **span_attributes
    ) -> bool:
        """Free everything this request holds; False when it was closed already.

        It leaves the table at once, ends its spans (``span_attributes`` onto the long-lived
        one), cancels its tasks but the calling one (with ``cancel_tasks`` False they run to
        their end instead: a handoff awaiting main decode's answer, which then records it),
        and frees its engine sequence or KV import if either is still held
        (``sequence_freed``: the caller freed the engine's sequence already; nothing to ask
        the engine thread).
        """
        if self.closed:
            return False
        self.closed_because = reason
        self._table.drop(self)
        self._release(reason)
        self.end_span(**span_attributes)
        current = asyncio.current_task()
        for task in [t for t in self.tasks if t is not current]:
            if cancel_tasks:
                task.cancel()
            else:
                self._table.linger(task)
        if not sequence_freed:
            await self._table.free_sequence(self.request_id)
        return True

    def _release(self, reason: str):
        """Free what a specialisation holds besides the span and the tasks (on close)."""


R = TypeVar("R", bound=DecodeRequest)


class RequestTable(Generic[R]):
    """A decoding service's requests by id: one entry per request, from its flow to its close."""

    def __init__(self):
        self._requests: dict[str, R] = {}
        self._lingering: set[asyncio.Task] = set()
        self._worker: EngineWorker | None = None
        self._importer: KvImporter | None = None

    def attach(self, worker: EngineWorker, importer: KvImporter):
        """Where closed requests' sequences and imports are freed (once the service started)."""
        self._worker, self._importer = worker, importer

    def add(self, request: R) -> R:
        """Hold ``request``; refuse a second one under the same id."""
        if request.request_id in self._requests:
            raise InvalidRequestState(f"request {request.request_id!r} is held here already")
        self._requests[request.request_id] = request
        return request

    def get(self, request_id: str) -> R | None:
        """The open request ``request_id``, if held."""
        return self._requests.get(request_id)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._requests

    def __len__(self) -> int:
        return len(self._requests)

    def values(self) -> list[R]:
        """The open requests (a copy: closing them changes the table)."""
        return list(self._requests.values())

    async def close(self, request_id: str, reason: str, **how) -> bool:
        """Close ``request_id`` if it is held here (see ``DecodeRequest.close``)."""
        request = self._requests.get(request_id)
        return await request.close(reason, **how) if request is not None else False

    def drop(self, request: R):
        """Forget ``request`` (its ``close`` calls this)."""
        if self._requests.get(request.request_id) is request:
            del self._requests[request.request_id]

    def linger(self, task: asyncio.Task):
        """Keep a closed request's task that finishes on its own, to cancel it on stop."""
        self._lingering.add(task)
        task.add_done_callback(self._lingering.discard)

    async def close_all(self, reason: str):
        """Close every request, and cancel the tasks closed ones left running."""
        for request in self.values():
            await request.close(reason)
        for task in list(self._lingering):
            task.cancel()

    def import_state(self, request_id: str) -> ImportState | None:
        """The KV import of ``request_id`` while its flow arrives."""
        return self._importer.imports.get(request_id) if self._importer is not None else None

    async def free_sequence(self, request_id: str):
        """Free a closed request's engine sequence, or its KV import while the flow owns the
        sequence. An import kept for the cache (its request ended elsewhere) goes on."""
        if self._worker is None:
            return  # never started: nothing was made
        importer = self._importer
        if importer.holds(request_id):
            if request_id not in importer.kept_for_cache():
                await importer.cancel(request_id, finished_elsewhere=False)
            return
        await self._worker.call(self._worker.engine.abort, request_id)
