"""What one KV flow delivered, counted by the receiver as it goes."""

import time
from dataclasses import dataclass, field


@dataclass
class FlowStats:
    """What one flow delivered.

    Attributes:
        bytes_received: Bytes of frames and control messages after the FlowOpen.
        frames: KV frames imported.
        opened_monotonic: When the FlowOpen arrived.
        first_frame_monotonic: When the first KV frame was complete.
        first_frame_bytes: Size of that frame.
        finished_monotonic: When the FlowEnd arrived.
    """

    bytes_received: int = 0
    frames: int = 0
    opened_monotonic: float = field(default_factory=time.monotonic)
    first_frame_monotonic: float = 0.0
    first_frame_bytes: int = 0
    finished_monotonic: float = 0.0

    @property
    def transfer_s(self) -> float:
        """Seconds from FlowOpen to FlowEnd (includes the sender's compute)."""
        return max(0.0, self.finished_monotonic - self.opened_monotonic)

    @property
    def streaming_bytes_per_s(self) -> float | None:
        """Link throughput seen between the first and the last frame (None: too few frames)."""
        elapsed = self.finished_monotonic - self.first_frame_monotonic
        if self.frames < 2 or elapsed <= 0:
            return None
        return (self.bytes_received - self.first_frame_bytes) / elapsed
