"""What the backend and its connector share, in one process.

vLLM builds the connector itself (from ``kv_connector_module_path``), once for its scheduler
and once for its worker. Both find the backend's ``Bridge`` by the key the backend put in
``kv_connector_extra_config``: staged KV to load into a request's blocks, finished requests
whose blocks are held for export, and the requests whose export is done.
"""

import itertools
import threading
from dataclasses import dataclass, field

import torch

BRIDGE_KEY = "pdd_bridge"
"""``kv_connector_extra_config`` entry naming the bridge."""


@dataclass
class StagedKv:
    """KV that arrived as wire frames, waiting for its request's blocks.

    Attributes:
        first_token: Index of the first token ``kv`` covers (a block start).
        kv: ``[layers, 2, tokens, kv_heads, head_dim]``.
    """

    first_token: int
    kv: torch.Tensor

    @property
    def end_token(self) -> int:
        """One past the last token covered."""
        return self.first_token + self.kv.shape[2]


@dataclass
class PendingLoad:
    """A load the scheduler granted: write ``staged`` tokens ``[first, end)`` into ``block_ids``.

    Attributes:
        engine_request_id: vLLM's id of the request.
        block_ids: The request's blocks, from its first.
        first_token: First token to write.
        end_token: One past the last.
        staged: Where the tokens' KV is.
    """

    engine_request_id: str
    block_ids: list[int]
    first_token: int
    end_token: int
    staged: StagedKv


@dataclass
class Bridge:
    """The state the backend and both connector roles share.

    Attributes:
        staged: Per vLLM request id, KV to load when vLLM schedules it.
        pending_loads: Loads granted by the scheduler, for the worker's next forward.
        export: vLLM request ids whose blocks must outlive the request (prefill and relay
            export after the request ends).
        held_blocks: Per finished exported request, its blocks (held until released).
        released: Exported requests whose blocks vLLM may free now.
        kv_caches: The worker's per-layer cache tensors, in layer order.
    """

    staged: dict[str, StagedKv] = field(default_factory=dict)
    pending_loads: list[PendingLoad] = field(default_factory=list)
    export: set[str] = field(default_factory=set)
    held_blocks: dict[str, list[int]] = field(default_factory=dict)
    released: set[str] = field(default_factory=set)
    kv_caches: list[torch.Tensor] = field(default_factory=list)


_bridges: dict[str, Bridge] = {}
_lock = threading.Lock()
_serial = itertools.count(1)


def new_bridge() -> tuple[str, Bridge]:
    """A fresh bridge and the key its connector finds it by."""
    with _lock:
        key = f"bridge-{next(_serial)}"
        _bridges[key] = Bridge()
        return key, _bridges[key]


def bridge(key: str) -> Bridge:
    """The bridge a connector was configured with."""
    with _lock:
        return _bridges[key]


def drop_bridge(key: str):
    """Forget a bridge (its backend shut down)."""
    with _lock:
        _bridges.pop(key, None)
