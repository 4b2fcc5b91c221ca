"""Capsule names and capsule file paths: which a capsule may take, and where its files are.

A name is [A-Za-z0-9_.-]{1,128} and not '.' or '..', so it is safe as a file name; a file is
inside the capsule directory. Names, and file names in the capsule directory, starting with
CHECKPOINT_PREFIX belong to the recovery checkpoints (runtime/recovery.py): only code inside
allow_reserved() creates them, so pruning and recover() never touch a user's capsule.
"""

import contextlib
import os
import re
import stat
import threading

from .errors import InvalidName, PathOutsideDirectory, ReservedName, StorageError, UnknownCapsule

SUFFIX = '.capsule'     # save's default file: <capsule_dir>/<name>.capsule
CHECKPOINT_PREFIX = 'checkpoint-'   # reserved for the recovery checkpoints (and their files)
_NAME = re.compile(r'[A-Za-z0-9_.-]{1,128}')
_SEQUENCE = re.compile(r'[0-9]{1,18}')
_SESSION_FILE = re.compile(re.escape(CHECKPOINT_PREFIX) + r'[A-Za-z][A-Za-z0-9_]*-[0-9]{1,18}' +
                           re.escape(SUFFIX))


def checkpoint_prefix(session=''):
    """'checkpoint-', or 'checkpoint-s1-' for the checkpoints of session 's1'."""
    return f'{CHECKPOINT_PREFIX}{session}-' if session else CHECKPOINT_PREFIX


def checkpoint_name(sequence, session=''):
    """'checkpoint-00000042' for sequence 42; 'checkpoint-s1-00000042' for session 's1'."""
    return f'{checkpoint_prefix(session)}{sequence:08d}'


def checkpoint_sequence(name, session=''):
    """The sequence number of a checkpoint capsule name (or file name with SUFFIX) of
    `session` ('' for a single-session engine's), else None."""
    if name.endswith(SUFFIX):
        name = name[:-len(SUFFIX)]
    prefix = checkpoint_prefix(session)
    digits = name[len(prefix):] if name.startswith(prefix) else ''
    return int(digits) if _SEQUENCE.fullmatch(digits) else None


def check_name(name):
    """Names are [A-Za-z0-9_.-]{1,128} and not '.' or '..', so they are safe as file names."""
    if not isinstance(name, str) or not _NAME.fullmatch(name) or name in ('.', '..'):
        raise InvalidName(
            f'capsule name {name!r} is not allowed: use 1-128 characters from '
            '[A-Za-z0-9_.-], not "." or ".."')


class CapsuleNames:
    """The names and files new capsules may take in one capsule directory."""

    def __init__(self, directory):
        self.directory = os.path.realpath(directory)
        # Per thread, so that a service call on another executor thread never borrows the
        # recovery collaborator's permission to create checkpoint names.
        self._grant = threading.local()

    def reserved_allowed(self):
        return getattr(self._grant, 'depth', 0) > 0

    @contextlib.contextmanager
    def allow_reserved(self):
        """Within this block, on this thread only, names and capsule files in the checkpoint
        namespace may be created."""
        depth = getattr(self._grant, 'depth', 0)
        self._grant.depth = depth + 1
        try:
            yield
        finally:
            self._grant.depth = depth

    def validate(self, name):
        """A name a new capsule may take: check_name, and not in the checkpoint namespace
        unless inside allow_reserved() on this thread (ReservedName)."""
        check_name(name)
        if name.startswith(CHECKPOINT_PREFIX) and not self.reserved_allowed():
            raise ReservedName(
                f'capsule name {name!r} is reserved: names starting with {CHECKPOINT_PREFIX!r} '
                'belong to the periodic recovery checkpoints (a capsule there would be pruned '
                'as one, or chosen by recover); choose another name')

    def resolve(self, path, default=''):
        """Absolute path under the capsule directory; PathOutsideDirectory otherwise."""
        path = path or default
        full = os.path.realpath(os.path.join(self.directory, os.path.expanduser(path)))
        if os.path.commonpath([full, self.directory]) != self.directory or full == self.directory:
            raise PathOutsideDirectory(
                f'path {path!r} resolves to {full!r}, outside the capsule directory '
                f'{self.directory!r}')
        return full

    def load_path(self, path):
        """The file `path` names under the capsule directory (resolve()), which must exist:
        UnknownCapsule when it does not, StorageError when it cannot be looked at."""
        if not path:
            raise UnknownCapsule('load needs a capsule file path')
        full = self.resolve(path)
        try:
            os.stat(full)
        except FileNotFoundError:
            raise UnknownCapsule(f'no capsule file at {full!r}') from None
        except OSError as e:    # permission on a directory on the way, name too long, ...
            raise StorageError.from_os_error(e, full, 'read capsule file') from e
        return full

    def save_path(self, name, path=''):
        """The file capsule `name` is saved to (resolve(); its own <name>.capsule by default).

        ReservedName for a checkpoint's file name in the capsule directory that is not this
        capsule's own (resume would take it for a checkpoint) outside allow_reserved().
        """
        full = self.resolve(path, name + SUFFIX)
        base = os.path.basename(full)
        if (os.path.dirname(full) == self.directory and base.startswith(CHECKPOINT_PREFIX)
                and base != name + SUFFIX and not self.reserved_allowed()):
            raise ReservedName(
                f'file name {base!r} is reserved: {CHECKPOINT_PREFIX}* files in the capsule '
                'directory are recovery checkpoints (restore_on_start would resume from it); '
                'choose another file name')
        return full


def scan_checkpoint_files(directory, session=''):
    """Checkpoint files of `session` ('' for a single-session engine's) in `directory`:
    ([(sequence, file name)] newest first, highest sequence seen in any of its numbered
    entries, [(entry, why it was skipped)]).

    Entries outside the namespace (user capsules, temp files, .spill, other sessions') are
    ignored. Strays inside it (checkpoint-abc.capsule, a directory, an empty file) are skipped
    with the reason, and numbered ones still raise the highest sequence so that a new
    checkpoint never lands on their name. StorageError when the directory cannot be listed.
    """
    try:
        entries = list(os.scandir(directory))
    except FileNotFoundError:
        return [], 0, []
    except OSError as e:
        raise StorageError.from_os_error(e, directory, 'list capsule directory') from e
    usable, skipped, highest = [], [], 0
    mine = checkpoint_prefix(session)
    for entry in entries:
        # a single-session engine's namespace holds no session's files: a fleet wrote them
        if not entry.name.startswith(mine) or (
                not session and _SESSION_FILE.fullmatch(entry.name)):
            continue
        sequence = checkpoint_sequence(entry.name, session) \
            if entry.name.endswith(SUFFIX) else None
        if sequence is None:
            skipped.append((entry.name, f'not a checkpoint file name (expected '
                                        f'{mine}<sequence number>{SUFFIX})'))
            continue
        highest = max(highest, sequence)
        try:
            st = os.stat(entry.path)
        except OSError as e:
            skipped.append((entry.name, str(StorageError.from_os_error(e, entry.path, 'stat'))))
            continue
        if stat.S_ISDIR(st.st_mode):
            skipped.append((entry.name, 'is a directory'))
        elif not stat.S_ISREG(st.st_mode):
            skipped.append((entry.name, 'is not a regular file'))
        elif st.st_size == 0:
            skipped.append((entry.name, 'is empty (0 bytes)'))
        else:
            usable.append((sequence, entry.name))
    usable.sort(reverse=True)
    return usable, highest, sorted(skipped)
