"""Liveness of one attempt's token stream: which instances it needs now, and when it went quiet.

Pure state, no I/O and no clock of its own (times are passed in), so tests drive it with
plain messages. ``RequestFlow`` feeds it what the stream shows and acts on its answers.

- **Who produces.** The relay while one is placed and has not handed over for good; main
  decode otherwise.
- **Who is needed.** The producer, and the prefill until the producer holds the KV (P→MD:
  main decode announced ``KvReady``; with a relay: the first token arrived). A failure of
  any other instance costs nothing: the request goes on.
- **Who may write.** Only the decoders the attempt was placed on.
- **Quiet.** No new token within the first-token wait (until one arrived) or the token wait
  after it is a timeout of the producer; a stream quiet for ``resend_after_s`` asks its
  decoders to resend (core NATS drops what is published while a server restarts).
"""

from services.router.placement import Placement
from shared.messages import InstanceRef


class StreamWatch:
    """What one attempt's stream depends on."""

    def __init__(
        self,
        placement: Placement,
        now: float,
        *,
        first_token_timeout_s: float,
        token_timeout_s: float,
        resend_after_s: float,
    ):
        self.placement = placement
        self._decoder_ids = placement.decoder_ids
        self.first_token_timeout_s, self.token_timeout_s = first_token_timeout_s, token_timeout_s
        self.resend_after_s = resend_after_s
        self.kv_ready = False
        self.handed_over = False
        self.progressed = False
        self._last_progress = self._last_resend = now

    def producer(self) -> InstanceRef:
        """The instance whose tokens the client waits for now."""
        p = self.placement
        return p.relay_decode if p.relay_decode is not None and not self.handed_over else p.main_decode

    def needed(self) -> list[InstanceRef]:
        """Instances whose failure stops the stream now."""
        p, needed = self.placement, []
        if not (self.kv_ready if p.pipeline == "P-MD" else self.progressed):
            needed.append(p.prefill)
        needed.append(self.producer())
        return needed

    def failure_matters(self, instance_id: str) -> bool:
        """Whether a failure reported by ``instance_id`` stops the stream."""
        return instance_id in {ref.instance_id for ref in self.needed()}

    def may_write(self, instance_id: str) -> bool:
        """Whether ``instance_id`` was placed to write this attempt's tokens."""
        return instance_id in self._decoder_ids

    def on_kv_ready(self):
        """Main decode holds the prompt's KV."""
        self.kv_ready = True

    def on_handoff_accepted(self, final: bool):
        """Main decode accepted a handoff chunk; the last one makes it the producer."""
        self.handed_over = self.handed_over or final

    def on_tokens_released(self, now: float):
        """New tokens reached the client."""
        self._last_progress, self.progressed = now, True

    def timeout_exceeded(self, now: float) -> float | None:
        """The wait the stream has outlasted without a new token, or None."""
        timeout = self.token_timeout_s if self.progressed else self.first_token_timeout_s
        return timeout if now - self._last_progress > timeout else None

    def resend_due(self, now: float) -> bool:
        """Whether to ask for a resend now (quiet long enough since progress and the last ask);
        answering True counts as asking."""
        if now - max(self._last_progress, self._last_resend) < self.resend_after_s:
            return False
        self._last_resend = now
        return True
