"""Recovery for the policy node: periodic checkpoints, poisoned-state handling and resuming
a restarted process (parameters checkpoint_*, poison_check, on_poison, restore_on_start).

A mixin of PolicyNode: it uses the node's engine, config, logger and counters.
"""
import os

import torch

from flashrt_ros.runtime.capsule import SUFFIX
from flashrt_ros.runtime.engine import EPISODE_START
from flashrt_ros.runtime.errors import FlashRTError

CHECKPOINT = 'checkpoint-'        # + zero-padded sequence number; newest = highest


class RecoveryMixin:
    """Checkpoints, poison detection, ~/recover and restore_on_start for PolicyNode."""

    def _poison(self, engine, action):
        """True (and nothing published) when the action or the recurrent state is not finite.

        Every step checks the action and the static buffers (recurrent, conv, chunk, counters);
        the KV history is checked when a checkpoint is taken or chosen for recovery.
        """
        bad = [] if bool(torch.isfinite(action).all()) else ['action']
        bad += engine.nonfinite_buffers(static_only=True)
        if not bad:
            return False
        self._poisoned += 1
        self._scrub = True
        self.get_logger().error(f'poisoned state at step {engine.step_index}: NaN/Inf in '
                                f'{", ".join(bad)}; action not published')
        if self.config['on_poison'] == 'recover':
            try:
                self.get_logger().warning(self._recover(engine))
            except FlashRTError as exc:
                self._holding = True
                self.get_logger().error(f'recovery failed ({exc}); holding until a restore')
        else:
            self._holding = True
        return True

    def _clear_poison(self, engine):
        """After a restore that ends a poisoned stretch: NaN rows the poisoned steps wrote past
        the restored position would leak into attention, so they are zeroed once."""
        if self._scrub:
            engine.clear_beyond_position()
        self._holding = self._scrub = False

    def _checkpoints(self, engine):
        return sorted((m.name for m in engine.store.list() if m.name.startswith(CHECKPOINT)),
                      reverse=True)

    def _checkpoint(self, engine):
        """A host-tier capsule (and file) of the live state; keeps the newest checkpoint_keep."""
        if engine.nonfinite_buffers():
            self.get_logger().error('checkpoint skipped: the live state holds NaN/Inf')
            return
        self._checkpoint_seq += 1
        name = f'{CHECKPOINT}{self._checkpoint_seq:08d}'
        try:
            engine.snapshot(name, overwrite=True, tier='host')
            if self.config['checkpoint_to_disk']:
                engine.save(name)     # atomic: a crash mid-write never leaves a loadable file
            for old in self._checkpoints(engine)[self.config['checkpoint_keep']:]:
                engine.delete(old)
                path = os.path.join(engine.store.directory, old + SUFFIX)
                if self.config['checkpoint_to_disk'] and os.path.exists(path):
                    os.unlink(path)
        except (FlashRTError, OSError) as exc:
            self.get_logger().error(f'checkpoint {name!r} failed: {exc}',
                                    throttle_duration_sec=5.0)

    def _recover(self, engine):
        """Restores the newest checkpoint whose bytes are all finite, else episode_start."""
        for name in self._checkpoints(engine) + [EPISODE_START]:
            if name in engine.store and not engine.nonfinite_buffers(name):
                result = engine.restore(name)
                self._clear_poison(engine)
                return f'recovered: {result.message}'
        raise FlashRTError('no valid checkpoint or episode_start capsule to recover from')

    def _resume(self, what):
        """restore_on_start: '' (off), 'latest' (newest loadable checkpoint file), or a file
        in the capsule directory. A named file that cannot be restored fails configure."""
        engine = self.engine
        directory = engine.store.directory
        self._resumed_from = ''
        files = sorted((f for f in os.listdir(directory) if f.startswith(CHECKPOINT)
                        and f.endswith(SUFFIX)), reverse=True) \
            if os.path.isdir(directory) else []
        if files:      # continue the sequence of the process that wrote them
            self._checkpoint_seq = int(files[0][len(CHECKPOINT):-len(SUFFIX)] or 0)
        if not what:
            return
        candidates = files if what == 'latest' else [what]
        for path in candidates:
            try:
                name = engine.load(path, overwrite=True).manifest.name
                bad = engine.nonfinite_buffers(name)
                if bad:
                    raise FlashRTError(f'{path} holds NaN/Inf in {", ".join(bad)}')
                engine.restore(name)
            except FlashRTError as exc:
                if what != 'latest':
                    raise
                self.get_logger().warning(f'restore_on_start: skipping {path}: {exc}')
                continue
            self._resumed_from = path
            if os.path.exists(os.path.join(directory, EPISODE_START + SUFFIX)):
                engine.load(EPISODE_START + SUFFIX, overwrite=True)
            self.get_logger().info(f'restore_on_start: resumed from {path} at step '
                                   f'{engine.step_index}')
            return
        self.get_logger().info(f'restore_on_start: no usable checkpoint in {directory}; '
                               'starting fresh')
