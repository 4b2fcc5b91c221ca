"""Recovery: periodic checkpoints, the poison verdict, recover() and resume from a directory.

A collaborator of PolicyEngine with no ROS in it. The caller (the policy node, a script) decides
what to log and publish, and whether a poisoned step recovers at once or holds.

Checkpoints are host-tier capsules named checkpoint-<sequence> (zero-padded to 8 digits, more
when it grows), written with checkpoint_to_disk to <capsule_dir>/checkpoint-<sequence>.capsule.
A session of a multi-session engine has its own: checkpoint-<session name>-<sequence> (session
names start with a letter, so the two patterns never meet).
The sequence number, never a name's sort order or a file's mtime, says which is newest. Only
this class creates names in that namespace (CapsuleStore.allow_reserved()); user capsules are
refused there, so pruning and recover() never touch one.
"""
import logging
import os

import torch

from .capsule_names import (checkpoint_name, checkpoint_sequence, scan_checkpoint_files,
                            SUFFIX)
from .engine import EPISODE_START
from .errors import FlashRTError, InvalidConfig, StorageError


class Recovery:
    """Checkpoints, poison verdict, recover and resume for one PolicyEngine (or, with
    `session`, one session of a multi-session engine: its checkpoints, its state).

    every: a checkpoint every N committed steps (0: off; see due()); keep: newest checkpoints
    kept, in memory and on disk; to_disk: also write each one to the capsule directory.
    logger: anything with info/warning/error(message) (a logging.Logger, an rclpy logger);
    used for what the caller cannot see (files skipped at resume, pruning failures).
    Not thread-safe by itself: call it from the thread that steps the engine.
    """

    def __init__(self, engine, every=0, keep=3, to_disk=False, logger=None, session=None):
        self.engine = engine
        self.session = session       # an index, or None: the engine's only session
        self._tag = engine.session_names[session] if session is not None else ''
        self.log = logger or logging.getLogger(__name__)
        self.sequence = 0            # newest checkpoint taken, or found in the directory
        self.taken = 0               # checkpoints taken (and written, with to_disk)
        self.failed_checkpoints = 0  # checkpoints not taken or not written
        self.last_failure = ''       # why the last one failed
        self.resumed_from = ''       # file resume() restored, '' if none
        self.scrub = False           # a poisoned step may have left NaN rows past position
        self._files = None           # [(sequence, file name)] on disk, newest first
        self._mine = []              # sequences of the files this object wrote, newest first
        self._warned = set()         # pruning failures already logged
        self.to_disk = False
        self.configure(every, keep, to_disk)

    def configure(self, every, keep, to_disk):
        """Change the settings (they may change while running: ROS live parameters)."""
        if isinstance(every, bool) or not isinstance(every, int) or every < 0:
            raise InvalidConfig(f'checkpoint every {every!r} steps: must be an int >= 0 (0: off)')
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise InvalidConfig(f'checkpoint keep {keep!r}: must be an int >= 1')
        if to_disk and not self.to_disk:
            self._files = None       # files may have changed while nothing was written
        self.every, self.keep, self.to_disk = every, keep, bool(to_disk)

    # -- checkpoints ---------------------------------------------------------------------------

    def due(self):
        """True when the step just committed should be followed by a checkpoint."""
        if not self.every:
            return False        # off: no session lookup on every step
        step = self.engine.session(self.session).step_index
        return step > 0 and step % self.every == 0

    def checkpoints(self):
        """[(sequence, name)] of the checkpoints in the store, newest (highest sequence) first."""
        # placement(): names without copying every manifest (this runs at each checkpoint)
        found = ((checkpoint_sequence(n, self._tag), n) for n in self.engine.store.placement())
        return sorted(((s, n) for s, n in found if s is not None), reverse=True)

    def checkpoint(self):
        """Take checkpoint-<sequence + 1> of the live state (host tier) and, with to_disk, write
        it atomically. Returns the snapshot's OpResult (result.path: the file, if written).

        Raises FlashRTError (StorageError for the file system) when it could not take or write
        it; that is counted in failed_checkpoints. A checkpoint whose file failed stays in
        memory, usable by recover(). Either way, at most `keep` checkpoints stay in memory and
        on disk, so failing writes never pile up.
        """
        engine, session = self.engine, self.session
        name = ''
        try:
            bad = engine.nonfinite_buffers(session=session)
            if bad:
                raise FlashRTError(f'checkpoint skipped at step '
                                   f'{engine.session(session).step_index}: the live state '
                                   f'holds NaN/Inf in {", ".join(bad)}')
            self.sequence += 1
            name = checkpoint_name(self.sequence, self._tag)
            with engine.store.allow_reserved():
                result = engine.snapshot(name, overwrite=True, tier='host', session=session)
                if self.to_disk:
                    result.path = engine.save(name).path
                    self._written(self.sequence, os.path.basename(result.path))
            self.taken += 1
            return result
        except Exception as exc:  # noqa: B902 - counted whatever it was, then re-raised
            self.failed_checkpoints += 1
            if name and isinstance(exc, FlashRTError):
                kept = name in engine.store
                exc.args = (f'checkpoint {name!r} ' + ('kept in memory but not written'
                                                       if kept else 'not taken') + f': {exc}',)
            self.last_failure = str(exc)
            if isinstance(exc, OSError):
                raise StorageError.from_os_error(exc, engine.store.directory,
                                                 'write a checkpoint in') from exc
            raise
        finally:
            self._prune()

    def _written(self, sequence, filename):
        files = self._disk_files()
        files[:] = [(s, f) for s, f in files if f != filename]
        files.append((sequence, filename))
        files.sort(reverse=True)
        self._mine.insert(0, sequence)

    def _disk_files(self):
        """Regular files named checkpoint-<number>.capsule (empty ones too), newest first."""
        if self._files is None:
            self._files = []
            try:
                entries = list(os.scandir(self.engine.store.directory))
            except OSError:
                entries = []
            for entry in entries:
                sequence = checkpoint_sequence(entry.name, self._tag) \
                    if entry.name.endswith(SUFFIX) else None
                try:
                    if sequence is not None and entry.is_file(follow_symlinks=False):
                        self._files.append((sequence, entry.name))
                except OSError:
                    pass
            self._files.sort(reverse=True)
        return self._files

    def _prune(self):
        """Keep the newest `keep` checkpoints in memory and, with to_disk, on disk.

        On disk, a file goes only once `keep` newer ones have been written (and synced) by
        this object: while writes fail, the last good files stay; once they succeed, files of
        an earlier process go too (numbered strays included), so restarts do not grow the
        directory. A sequence-only rule would keep newer damaged files over older good ones.
        """
        for _, name in self.checkpoints()[self.keep:]:
            try:
                self.engine.delete(name)
            except FlashRTError as exc:
                self._warn_once(f'could not drop old checkpoint {name!r}: {exc}')
        del self._mine[self.keep:]
        if not self.to_disk or len(self._mine) < self.keep:
            return
        oldest_kept = self._mine[-1]
        files = self._disk_files()
        directory = self.engine.store.directory
        for sequence, filename in [f for f in files if f[0] < oldest_kept]:
            path = os.path.join(directory, filename)
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
            except OSError as e:
                self._warn_once(str(StorageError.from_os_error(e, path,
                                                               'remove old checkpoint file')))
                continue
            files.remove((sequence, filename))

    def _warn_once(self, message):
        # A read-only directory would otherwise log the same failure at every checkpoint.
        if message not in self._warned:
            self._warned.add(message)
            self.log.warning(message)

    # -- poison ---------------------------------------------------------------------------------

    def verdict(self, action):
        """Names of what is not finite after a step: 'action' and static buffers (recurrent,
        conv, chunk, counters); [] when the step is sound. The history (append buffers) is
        checked when a checkpoint is taken or chosen. Reads the engine's finite flag (computed
        inside the step); buffers are only named when it is down. A poisoned verdict marks
        the append rows past the position for scrubbing at the next restore (after_restore)."""
        engine, session = self.engine, self.session
        if engine.last_finite[session or 0]:
            return []       # the step's own finite flag: no second lock, no second sync
        bad = [] if bool(torch.isfinite(action).all()) else ['action']
        bad += engine.nonfinite_buffers(static_only=True, session=session)
        self.scrub = True
        return bad or ['the step (finite flag)']

    def after_restore(self):
        """Call after any restore that ends a poisoned stretch (recover, a user restore or
        episode reset): NaN rows the poisoned steps wrote past the restored position would leak
        into attention (0 * NaN is NaN), so they are zeroed once."""
        if self.scrub:
            self.engine.clear_beyond_position(session=self.session)
        self.scrub = False

    def recover(self):
        """Restore the newest checkpoint (by sequence) whose bytes are all finite, else
        episode_start. Returns the restore's OpResult (its message names what was skipped);
        FlashRTError when nothing is usable."""
        engine = self.engine
        skipped = []
        for name in [n for _, n in self.checkpoints()] + [EPISODE_START]:
            if name not in engine.store:
                continue
            try:
                bad = engine.nonfinite_buffers(name)
                if bad:
                    skipped.append(f'{name} holds NaN/Inf in {", ".join(bad)}')
                    continue
                result = engine.restore(name, session=self.session)
            except FlashRTError as exc:     # e.g. a spilled checkpoint whose file went bad
                skipped.append(f'{name}: {exc}')
                continue
            self.after_restore()
            if skipped:
                result.message += f' (skipped: {"; ".join(skipped)})'
            return result
        raise FlashRTError('no valid checkpoint or episode_start capsule to recover from' +
                           (f' (skipped: {"; ".join(skipped)})' if skipped else ''))

    # -- resume ---------------------------------------------------------------------------------

    def scan(self):
        """This session's checkpoint files (capsule_names.scan_checkpoint_files)."""
        return scan_checkpoint_files(self.engine.store.directory, self._tag)

    def resume(self, what=''):
        """Resume a restarted process from the capsule directory (restore_on_start).

        what: '' (only continue the checkpoint sequence), 'latest' (the newest checkpoint file,
        by sequence, that loads: checksum, signature with a key, schema, model, finite bytes;
        others are skipped with a logged reason), or a file name in the capsule directory (a
        failure raises FlashRTError). Also loads episode_start's file when there is one.
        Returns the file resumed from ('' when none).
        """
        engine = self.engine
        self.resumed_from = ''
        try:
            usable, highest, skipped = self.scan()
        except StorageError as exc:
            if what:
                raise
            self.log.warning(f'checkpoint sequence starts at {self.sequence + 1}: {exc}')
            return ''
        self._files = None          # rescanned (empty numbered files included) when pruning
        self.sequence = max(self.sequence, highest)     # never reuse a number on disk
        for filename, why in skipped:
            self.log.warning(f'restore_on_start: skipping {filename}: {why}')
        if not what:
            return ''
        latest = what == 'latest'
        candidates = [(f, checkpoint_name(s, self._tag)) for s, f in usable] if latest \
            else [(what, '')]
        for filename, name in candidates:
            try:
                with engine.store.allow_reserved():
                    # A checkpoint file loads under the name its number gives (that is the
                    # order trusted); a named file under the name in its manifest.
                    loaded = engine.load(filename, name=name, overwrite=True).manifest.name
                bad = engine.nonfinite_buffers(loaded)
                if bad:
                    engine.delete(loaded)
                    raise FlashRTError(f'{filename} holds NaN/Inf in {", ".join(bad)}')
                engine.restore(loaded, session=self.session)
            except FlashRTError as exc:
                if not latest:
                    raise
                self.log.warning(f'restore_on_start: skipping {filename}: {exc}')
                continue
            self.resumed_from = filename
            self._load_episode_start()
            self.log.info(f'restore_on_start: {self._tag + ": " if self._tag else ""}resumed '
                          f'from {filename} at step {engine.session(self.session).step_index}')
            return filename
        self.log.info(f'restore_on_start: no usable checkpoint in {engine.store.directory}; '
                      'starting fresh')
        return ''

    def _load_episode_start(self):
        engine = self.engine
        if EPISODE_START in engine.store:
            return                  # another session's resume loaded it
        if not os.path.exists(os.path.join(engine.store.directory, EPISODE_START + SUFFIX)):
            return
        try:
            engine.load(EPISODE_START + SUFFIX, overwrite=True)
        except FlashRTError as exc:
            self.log.warning(f'restore_on_start: {EPISODE_START!r} not loaded ({exc}); '
                             'reset_episode will start from the initial state')
