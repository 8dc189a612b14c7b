"""What a prefill job uses of its service (``PrefillService``), as a protocol: the job and its
KV shipping depend on this, not on the service module."""

import asyncio
from typing import Any, Protocol

from services.prefill.shipping_plan import ShippingPath
from services.prefill.speed import PrefillSpeed
from shared.bulk.sender import BulkFlow
from shared.config import PrefillConfig
from shared.engine.backend import EngineBackend
from shared.engine_loop import EngineLoop
from shared.engine_worker import EngineWorker
from shared.messages import FlowOpen


class PrefillHost(Protocol):
    """What a job uses of its service (``PrefillService``)."""

    service_name: str
    instance_id: str
    config: PrefillConfig
    log: Any
    worker: EngineWorker
    loop: EngineLoop
    slots: asyncio.Semaphore
    speed: PrefillSpeed
    jobs: dict[str, Any]
    """The service's table of ``PrefillJob`` objects by request id."""

    @property
    def engine(self) -> EngineBackend: ...

    async def dial(self, flow_open: FlowOpen, route: ShippingPath) -> BulkFlow: ...

    async def publish(self, subject: str, message, headers: dict | None = None) -> bool: ...
