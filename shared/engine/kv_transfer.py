"""Moving a request's KV between instances: import into reserved blocks, export as frames.

The receiving side reserves the prompt's blocks up front (``reserve``), so arriving frames
always have room, and writes each validated frame in order (``import_frame``); the sending
side encodes computed KV as wire frames (``export_frames``). Both go through the scheduler's
block tables and the pool's tensors.
"""

import math

from shared.block_hash import hash_blocks
from shared.engine.backend import RequestStatus
from shared.engine.kv_pool import KvPool
from shared.engine.scheduler import Scheduler
from shared.engine.sequence import Sequence
from shared.kv_wire import KvFrame, check_next_frame, encode_frames


class KvTransfer:
    """Import and export of KV frames for one engine."""

    def __init__(self, scheduler: Scheduler, pool: KvPool, model_fingerprint: str):
        self._scheduler = scheduler
        self._pool = pool
        self._fingerprint = model_fingerprint

    def reserve(self, seq: Sequence) -> int:
        """Give an importing sequence its cached prefix and blocks for the rest of the prompt;
        return where the sender should start (the cached prefix length).

        Raises:
            OutOfKvBlocks: the pool cannot hold the rest of the prompt now.
        """
        scheduler = self._scheduler
        hashes = hash_blocks(seq.token_ids, scheduler.block_size)
        hit = scheduler.adopt_cached_prefix(seq, hashes)
        try:
            scheduler.ensure_blocks(seq, seq.num_prompt_tokens)
        except BaseException:
            scheduler.blocks.release(hit)
            raise
        return seq.num_kv_tokens

    def import_frame(self, frame: KvFrame):
        """Write a validated frame's KV into the request's reserved blocks.

        Raises:
            FrameOwnershipError: no import of that request is under way, the frame does not
                start where the import stands, or its tokens are not the request's.
        """
        header = frame.header
        seq = self._scheduler.sequences.get(header.request_id)
        importing = seq is not None and seq.status is RequestStatus.IMPORTING
        check_next_frame(
            header,
            importing,
            seq.num_kv_tokens if importing else 0,
            seq.token_ids[: seq.num_prompt_tokens] if importing else [],
        )
        end = header.first_token_index + header.num_tokens
        first_block, last_block = header.first_block_index, math.ceil(end / self._scheduler.block_size)
        self._pool.import_tokens(seq.block_ids[first_block:last_block], frame.kv)
        seq.num_kv_tokens = end
        seq.num_imported_tokens += header.num_tokens
        self._scheduler.cache_full_blocks(seq)

    def export_frames(
        self,
        seq: Sequence,
        first_token_index: int,
        end_token_index: int | None,
        max_tokens_per_frame: int,
        traceparent: str | None,
    ) -> list[list]:
        """Encode ``seq``'s computed KV for tokens ``[first, end)`` as wire frames."""
        block_size = self._scheduler.block_size
        stop = seq.num_kv_tokens if end_token_index is None else end_token_index
        if first_token_index % block_size or not 0 <= first_token_index < stop <= seq.num_kv_tokens:
            raise ValueError(
                f"cannot export tokens [{first_token_index}, {stop}): need a block "
                f"start below the end, within {seq.num_kv_tokens} computed tokens"
            )
        return encode_frames(
            lambda start, end: self._pool.export_tokens(
                seq.block_ids[start // block_size : math.ceil(end / block_size)], end - start
            ),
            seq.token_ids,
            first_token_index,
            stop,
            block_size=block_size,
            model_fingerprint=self._fingerprint,
            request_id=seq.request_id,
            max_tokens_per_frame=max_tokens_per_frame,
            traceparent=traceparent,
        )
