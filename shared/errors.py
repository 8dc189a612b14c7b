"""Typed errors shared by every service.

Each error carries a stable ``code`` so that a service can report it over the wire
(``RequestFailed.code``) and a client can act on it without parsing messages.
"""


class PddError(Exception):
    """Base class of every error this project raises on purpose."""

    code = "pdd_error"


def error_with_code(code: str, message: str) -> PddError:
    """A ``PddError`` carrying ``code`` (one reported by an engine or a peer)."""
    error = PddError(message)
    error.code = code
    return error


class ConfigError(PddError):
    """A setting is missing or invalid; the message names the setting."""

    code = "config_error"


class ModelLoadError(PddError):
    """A model source could not be found or loaded."""

    code = "model_load_error"


class ContextLengthExceeded(PddError):
    """Prompt plus requested output does not fit the model's context window."""

    code = "context_length_exceeded"


class OutOfKvBlocks(PddError):
    """The KV pool has no free or evictable block left."""

    code = "out_of_kv_blocks"


class UnknownRequest(PddError):
    """An operation named a request id the engine does not hold."""

    code = "unknown_request"


class InvalidRequestState(PddError):
    """An operation is not allowed in the request's current state."""

    code = "invalid_request_state"


class HandoffRefused(PddError):
    """A handoff that does not fit its request: another relay sent it, or too many or
    impossible token ids."""

    code = "handoff_refused"


class RequestCancelled(PddError):
    """The request was cancelled; the operation it waited for will not happen."""

    code = "cancelled"


class KvFrameError(PddError):
    """A KV wire frame failed validation; nothing from it reached the pool."""

    code = "kv_frame_invalid"


class TruncatedFrame(KvFrameError):
    """The frame is shorter than its prefix and header declare."""

    code = "kv_frame_truncated"


class CorruptFrame(KvFrameError):
    """Magic, header encoding, checksum or hash chain do not verify."""

    code = "kv_frame_corrupt"


class OversizedFrame(KvFrameError):
    """The frame declares more bytes than the receiver accepts."""

    code = "kv_frame_oversized"


class IncompatibleFrame(KvFrameError):
    """The frame was produced for another model, layout or block size."""

    code = "kv_frame_incompatible"


class FrameOwnershipError(KvFrameError):
    """The frame belongs to another request, or to tokens the request does not have."""

    code = "kv_frame_wrong_request"


class InvalidSampling(PddError, ValueError):
    """A sampling parameter is out of its range; ``field`` names it."""

    code = "invalid_sampling"

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


class InvalidPrompt(PddError, ValueError):
    """A prompt is empty or holds a token id outside the model's vocabulary."""

    code = "invalid_prompt"


class SamplingFailed(PddError):
    """One sequence's next token could not be drawn (a non-finite logits row); the sequence
    ends, the engine carries on."""

    code = "sampling_failed"


class StepFailed(PddError):
    """The forward pass of a step raised; the step's sequences end, the engine carries on."""

    code = "step_failed"
