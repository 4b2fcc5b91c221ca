"""Exceptions of the runtime: every refusal raises one of these with a message a person can act on.

A refused operation leaves the live state and the capsule store as they were, so callers (the
ROS node, a script) may report the message and carry on.
"""


class FlashRTError(Exception):
    """Base of every refusal raised by the runtime."""


class InvalidName(FlashRTError):
    """A capsule name is empty, too long, or holds characters outside [A-Za-z0-9_.-]."""


class UnknownCapsule(FlashRTError):
    """No capsule of that name is in the store."""


class CapsuleExists(FlashRTError):
    """A capsule of that name exists and overwrite was not asked for."""


class BudgetExceeded(FlashRTError):
    """A tier has no room for the capsule, even after demoting every unpinned capsule."""


class IncompatibleCapsule(FlashRTError):
    """The capsule's schema or model digest differs from the running policy's."""


class CorruptCapsule(FlashRTError):
    """A capsule file failed its checksum, is truncated, or cannot be read."""


class PathOutsideDirectory(FlashRTError):
    """A save/load path resolves outside the capsule directory."""


class InvalidObservation(FlashRTError):
    """An observation has the wrong length, type, or holds NaN/Inf."""


class RollbackUnavailable(FlashRTError):
    """Rollback asked for more steps than the ring holds."""


class CapacityExceeded(FlashRTError):
    """The history (append buffers) is full."""


class InvalidConfig(FlashRTError):
    """A configuration or argument (specs, sizes, kinds) is not usable."""
