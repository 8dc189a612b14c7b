"""When a request that lost an instance resumes elsewhere: the failures a flow sees, and the
decision to resume (counts and causes only, no I/O)."""

from dataclasses import dataclass, field

from shared.errors import PddError

GONE_REASONS = {"instance_unresponsive", "prefill_unreachable"}
"""Failures that mean the instance is gone: placement skips it until it heartbeats again."""


class UpstreamFailed(PddError):
    """A service reported the request failed, or its instance vanished."""

    code = "upstream_failed"


class UpstreamTimeout(PddError):
    """No token arrived within the configured wait."""

    code = "timeout"


class InstanceFailed(PddError):
    """An instance the stream needs failed the request; it may be resumed elsewhere.

    Attributes:
        instance_id: The failed instance.
        reason: Stable cause (``instance_unresponsive``, ``timeout``, a service error code).
    """

    code = "upstream_failed"

    def __init__(self, message: str, instance_id: str, reason: str):
        super().__init__(message)
        self.instance_id, self.reason = instance_id, reason

    def final(self) -> PddError:
        """The error the client gets when the request cannot be resumed."""
        return (UpstreamTimeout if self.reason == "timeout" else UpstreamFailed)(str(self))


@dataclass
class RecoveryPlan:
    """Whether a failed request resumes elsewhere: a decision from counts and causes, no I/O.

    Attributes:
        max_recoveries: Resumptions allowed per request.
        avoid: Instances that failed this request (never placed on again for it).
    """

    max_recoveries: int
    avoid: set[str] = field(default_factory=set)

    def decide(self, failure: InstanceFailed, recoveries_so_far: int) -> frozenset[str]:
        """The instances a new attempt must avoid; raises the client's error when it may not resume."""
        if recoveries_so_far >= self.max_recoveries:
            raise failure.final() from None
        self.avoid.add(failure.instance_id)
        return frozenset(self.avoid)

    @staticmethod
    def instance_gone(failure: InstanceFailed) -> bool:
        """Whether placement should skip the failed instance until it heartbeats again."""
        return failure.reason in GONE_REASONS
