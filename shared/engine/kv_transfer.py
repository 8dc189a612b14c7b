"""Moving a request's KV between instances: import into reserved blocks, export as frames.

A mixin of ``Engine`` (it uses the engine's pool, block manager, prefix cache and sequence
table): the receiving side (``begin_import`` → ``import_frame``… → ``finish_import``) and the
sending side (``export_frames``) of the KV wire format.
"""

import math

from shared.block_hash import ROOT_PARENT_HASH, hash_blocks
from shared.engine.sampling import SamplingParams
from shared.engine.sequence import Sequence, SequenceStatus
from shared.errors import FrameOwnershipError, OutOfKvBlocks
from shared.kv_wire import KvFrame, encode_frame


class KvTransfer:
    """Import and export of KV frames (mixed into ``Engine``)."""

    def begin_import(self, request_id: str, prompt_token_ids: list[int],
                     sampling: SamplingParams, seed: int | None = None) -> int:
        """Prepare to receive a prompt's KV from another instance.

        Reuses cached prefix blocks and reserves blocks for the rest of the prompt, so
        arriving frames always have room.

        Returns:
            The token index the sender should start from (the cached prefix length).
        """
        seq = self._new_sequence(request_id, prompt_token_ids, sampling, seed)
        seq.status = SequenceStatus.IMPORTING
        hashes = hash_blocks(prompt_token_ids, self.layout.block_size)
        hit = self._lookup(hashes)
        self.blocks.acquire(hit)
        needed = math.ceil(len(prompt_token_ids) / self.layout.block_size) - len(hit)
        try:
            reserved = self.blocks.allocate(needed)
        except OutOfKvBlocks:
            self.blocks.release(hit)
            raise
        self._adopt_cached(seq, hit, hashes)
        seq.block_ids.extend(reserved)
        self._sequences[request_id] = seq
        return seq.num_kv_tokens

    def import_frame(self, frame: KvFrame):
        """Write a validated frame's KV into the request's reserved blocks.

        Raises:
            FrameOwnershipError: no import of that request is under way, the frame does not
                start where the import stands, or its tokens are not the request's.
        """
        header = frame.header
        seq = self._sequences.get(header.request_id)
        if seq is None or seq.status is not SequenceStatus.IMPORTING:
            raise FrameOwnershipError(f"no KV import under way for request {header.request_id!r}")
        start, end = header.first_token_index, header.first_token_index + header.num_tokens
        if start != seq.num_kv_tokens:
            raise FrameOwnershipError(
                f"frame starts at token {start}, import of {seq.request_id!r} stands at {seq.num_kv_tokens}")
        if end > seq.num_prompt_tokens or header.token_ids != seq.token_ids[start:end]:
            raise FrameOwnershipError(f"frame tokens [{start}, {end}) are not the prompt's")
        first_block, last_block = header.first_block_index, math.ceil(end / self.layout.block_size)
        self.pool.import_tokens(seq.block_ids[first_block:last_block], frame.kv)
        seq.num_kv_tokens = end
        seq.num_imported_tokens += header.num_tokens
        self._cache_full_blocks(seq)

    def finish_import(self, request_id: str, token_ids: list[int], logprobs: list | tuple = ()) -> Sequence:
        """End an import and make the sequence runnable.

        Args:
            request_id: The importing request.
            token_ids: Output tokens already produced elsewhere (e.g. the first token the
                prefill sampled, or a relay's tokens). Empty parks the sequence until
                ``extend`` hands it tokens. Prompt tokens not covered by frames are
                recomputed here.
            logprobs: The log-probabilities of ``token_ids`` where their producer computed
                them (aligned; missing ones are None).

        Returns:
            The sequence; already FINISHED if ``token_ids`` end the request (EOS, stop
            string, max tokens), in which case nothing more is computed.
        """
        seq = self._get(request_id, SequenceStatus.IMPORTING)
        seq.status = SequenceStatus.RUNNING
        self._append_outputs(seq, token_ids, logprobs)
        return seq

    def export_frames(self, request_id: str, first_token_index: int = 0,
                      end_token_index: int | None = None, *, max_tokens_per_frame: int = 512,
                      traceparent: str | None = None):
        """Encode the request's computed KV for tokens ``[first, end)`` as wire frames.

        Args:
            request_id: A live request.
            first_token_index: A block start: where the receiver's cached prefix ends.
            end_token_index: One past the last token to send; default all computed KV
                (a prefill instance sends exactly the prompt).
            max_tokens_per_frame: Frame size bound, rounded down to whole blocks.
            traceparent: W3C trace context to stamp on each frame.

        Returns:
            A list of frames, each a list of buffers for ``writelines``.
        """
        seq = self.get(request_id)
        block_size = self.layout.block_size
        stop = seq.num_kv_tokens if end_token_index is None else end_token_index
        if first_token_index % block_size or not 0 <= first_token_index < stop <= seq.num_kv_tokens:
            raise ValueError(f"cannot export tokens [{first_token_index}, {stop}): need a block "
                             f"start below the end, within {seq.num_kv_tokens} computed tokens")
        hashes = hash_blocks(seq.token_ids[:stop], block_size)
        blocks_per_frame = max(1, max_tokens_per_frame // block_size)
        frames = []
        for first_block in range(first_token_index // block_size,
                                 math.ceil(stop / block_size), blocks_per_frame):
            start = first_block * block_size
            end = min(start + blocks_per_frame * block_size, stop)
            block_ids = seq.block_ids[first_block:math.ceil(end / block_size)]
            frames.append(encode_frame(
                kv=self.pool.export_tokens(block_ids, end - start),
                model_fingerprint=self.loaded.fingerprint, block_size=block_size,
                request_id=request_id, first_block_index=first_block,
                parent_hash=hashes[first_block - 1] if first_block else ROOT_PARENT_HASH,
                token_ids=seq.token_ids[start:end], traceparent=traceparent,
            ))
        return frames
