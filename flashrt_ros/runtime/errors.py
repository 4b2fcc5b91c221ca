"""Exceptions of the runtime: every refusal raises one of these with a message a person can act on.

A refused operation leaves the live state and the capsule store as they were, so callers (the
ROS node, a script) may report the message and carry on.
"""
import errno
import os


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


class ReservedName(InvalidName):
    """A capsule name (or capsule file name) lies in the checkpoint namespace ('checkpoint-'),
    which only the recovery collaborator may create."""


class UntrustedCapsule(FlashRTError):
    """A signing key is configured and a capsule file is unsigned or its signature does not
    match the key."""


class StorageError(FlashRTError):
    """A file-system operation on a capsule file or the capsule directory failed (permission,
    space, read-only, not a file, name too long). `path` and `errno` say where and what."""

    def __init__(self, message, path='', errno=None):
        super().__init__(message)
        self.path = path
        self.errno = errno

    @classmethod
    def from_os_error(cls, exc, path, doing):
        """A StorageError for OSError `exc` met while `doing` (e.g. 'write capsule file') on
        `path`, saying what happened and what a person can do about it."""
        what, advice = _ADVICE.get(exc.errno, (None, 'check the path and the capsule directory'))
        what = what or (exc.strerror or str(exc)).lower()
        return cls(f'cannot {doing} {path!r}: {what}; {advice.format(uid=os.geteuid())}', path,
                   exc.errno)


_ACCESS = ('permission denied', 'give the user running this process (uid {uid}) access to it '
           '(chmod/chown), or use a capsule directory it owns')
_SPACE = 'free space there, keep fewer checkpoints (checkpoint_keep), or put the capsule ' \
         'directory on a larger disk'
# errno -> (what happened, what to do): the OS's own strings ("[Errno 30] Read-only file
# system") name neither the file nor a remedy.
_ADVICE = {
    errno.EACCES: _ACCESS,
    errno.EPERM: _ACCESS,
    errno.ENOSPC: ('no space left on its file system', _SPACE),
    errno.EDQUOT: ('the disk quota is exceeded', _SPACE),
    errno.EROFS: ('its file system is mounted read-only',
                  'remount it read-write or use a capsule directory on a writable file system'),
    errno.EISDIR: ('it is a directory, not a capsule file',
                   'name a file (e.g. <name>.capsule) instead'),
    errno.ENOTDIR: ('a component of the path is a file, not a directory',
                    'fix the path or the capsule directory'),
    errno.ENAMETOOLONG: ('the name is too long for the file system (most allow 255 bytes per '
                         'name)', 'use a shorter file name'),
    errno.ENOENT: ('no such file or directory', 'check the path'),
    errno.EIO: ('an input/output error (a failing disk or card?)',
                'check the device (dmesg) and the file system'),
}
