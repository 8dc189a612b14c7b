"""``PddConnector``: the vLLM KV connector that moves KV between vLLM's cache and PDD's frames.

Loaded by vLLM from ``kv_connector_module_path``, in the backend's process (the engine runs
in-process), once per role:

- the scheduler's copy offers the tokens the backend staged from wire frames
  (``get_num_new_matched_tokens``), records the blocks vLLM allocated for them, and passes
  the loads to the worker in the step's metadata; it keeps an exported request's blocks
  alive past its end (``request_finished``) until the backend has read them;
- the worker's copy holds the cache tensors, writes the granted loads before the forward
  pass, and reports exported requests whose blocks may now be freed (``get_finished``).
"""

import re
from dataclasses import dataclass, field

import structlog
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from shared.engine.vllm import bridge as bridges
from shared.engine.vllm.kv_blocks import VllmKvBlocks

log = structlog.get_logger(__name__)

_LAYER_INDEX = re.compile(r"\.layers\.(\d+)\.")


def engine_request_id(internal_id: str) -> str:
    """The id the backend gave vLLM (vLLM appends ``-`` and 8 characters of its own)."""
    return internal_id.rsplit("-", 1)[0]


@dataclass
class PddConnectorMetadata(KVConnectorMetadata):
    """What one step's forward pass must load first.

    Attributes:
        loads: Staged KV to write, and where.
    """

    loads: list[bridges.PendingLoad] = field(default_factory=list)


class PddConnector(KVConnectorBase_V1):
    """Loads staged wire-frame KV into vLLM's blocks; holds exported requests' blocks."""

    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config
        self.bridge = bridges.bridge(extra[bridges.BRIDGE_KEY])
        self.block_size = vllm_config.cache_config.block_size
        self.isa = extra.get("isa", "vec")
        self._granted: dict[str, tuple[int, int]] = {}
        self._loads: list[bridges.PendingLoad] = []
        self._kv: VllmKvBlocks | None = None

    # ----- scheduler side -------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        """Staged tokens past vLLM's own prefix hit, up to a block boundary short of the last
        token (vLLM computes at least one). A hit shorter than where the staged KV starts
        leaves a gap no one can fill: then vLLM computes everything itself."""
        staged = self.bridge.staged.get(engine_request_id(request.request_id))
        if staged is None or num_computed_tokens < staged.first_token:
            return 0, False
        end = min(staged.end_token, request.num_tokens - 1) // self.block_size * self.block_size
        count = max(0, end - num_computed_tokens)
        if count:
            self._granted[request.request_id] = (num_computed_tokens, num_computed_tokens + count)
        return count, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int):
        granted = self._granted.pop(request.request_id, None)
        if not num_external_tokens or granted is None:
            return
        staged = self.bridge.staged.pop(engine_request_id(request.request_id))
        self._loads.append(
            bridges.PendingLoad(request.request_id, list(blocks.get_block_ids()[0]), granted[0], granted[1], staged)
        )

    def build_connector_meta(self, scheduler_output) -> PddConnectorMetadata:
        loads, self._loads = self._loads, []
        return PddConnectorMetadata(loads)

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict | None]:
        """An exported request keeps its blocks until the backend releases it."""
        engine_id = engine_request_id(request.request_id)
        if engine_id not in self.bridge.export:
            return False, None
        self.bridge.held_blocks[engine_id] = (request.request_id, list(block_ids))
        return True, None

    # ----- worker side ----------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict):
        ordered = sorted(kv_caches.items(), key=lambda item: int(_LAYER_INDEX.search(item[0]).group(1)))
        self.bridge.kv_caches = [tensor for _, tensor in ordered]
        self._kv = VllmKvBlocks(self.bridge.kv_caches, self.block_size, self.isa)

    def start_load_kv(self, forward_context, **kwargs):
        metadata = self._get_connector_metadata()
        for load in metadata.loads:
            staged = load.staged
            kv = staged.kv[:, :, load.first_token - staged.first_token : load.end_token - staged.first_token]
            self._kv.write(load.block_ids, load.first_token, kv)
            log.debug("kv_loaded", request_id=load.engine_request_id, tokens=load.end_token - load.first_token)

    def wait_for_layer_load(self, layer_name: str):
        """Loads are written whole before the forward pass."""

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs):
        """Exports read the blocks between steps instead (a running request's or a held one's)."""

    def wait_for_save(self):
        """Nothing is saved during the forward pass."""

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Exported requests the backend released: vLLM frees their blocks (they stay cached)."""
        ready = [engine_id for engine_id in self.bridge.released if engine_id in self.bridge.held_blocks]
        self.bridge.released.difference_update(ready)
        return {self.bridge.held_blocks.pop(engine_id)[0] for engine_id in ready} or None, None
