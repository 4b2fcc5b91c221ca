"""Recovery in the policy node: thin glue over the runtime's Recovery collaborator
(flashrt_ros/runtime/recovery.py: checkpoints, poison verdict, recover, resume).

What stays here is the node's side: what is logged (with rclpy's throttling), the poisoned-step
count it publishes, and the on_poison choice between recovering at once and holding. Parameters
checkpoint_every, checkpoint_keep and checkpoint_to_disk are read from the node's config at
every use, so live parameter changes apply at the next step.
"""
from flashrt_ros.runtime.errors import FlashRTError
from flashrt_ros.runtime.recovery import Recovery


class RecoveryMixin:
    """Checkpoints, poison handling, ~/recover and restore_on_start for PolicyNode."""

    @property
    def engine(self):
        return self.__dict__.get('_engine')

    @engine.setter
    def engine(self, engine):
        # The node drops its engine on cleanup to free the arena; the Recovery that served it
        # goes with it (holding it here would keep the arena alive until the next configure).
        self.__dict__['_engine'] = engine
        self.__dict__['_recovery'] = None

    @property
    def recovery(self):
        """The Recovery of the current engine (None while unconfigured): its counters
        (failed_checkpoints, last_failure, taken, sequence) are what status may publish."""
        engine, config = self.engine, getattr(self, 'config', None)
        if engine is None or config is None:
            return None
        recovery = self.__dict__.get('_recovery')
        every, keep = config['checkpoint_every'], config['checkpoint_keep']
        to_disk = config['checkpoint_to_disk']
        if recovery is None:
            recovery = Recovery(engine, every, keep, to_disk, logger=self.get_logger())
            self.__dict__['_recovery'] = recovery
        else:
            recovery.configure(every, keep, to_disk)
        return recovery

    def _poison(self, engine, action):
        """True (and nothing published) when the action or the recurrent state is not finite.

        Every step checks the action and the static buffers (recurrent, conv, chunk, counters);
        the KV history is checked when a checkpoint is taken or chosen for recovery.
        """
        bad = self.recovery.verdict(action)
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
        """After a restore or reset: scrub what a poisoned stretch left, stop holding."""
        self.recovery.after_restore()
        self._holding = self._scrub = False

    def _checkpoint(self, engine):
        """A host-tier capsule (and file) of the live state; keeps the newest checkpoint_keep.
        A failure is logged and counted (recovery.failed_checkpoints); control goes on."""
        recovery = self.recovery
        try:
            recovery.checkpoint()
        except FlashRTError as exc:
            self.get_logger().error(f'{exc} ({recovery.failed_checkpoints} failed so far)',
                                    throttle_duration_sec=5.0)
        except Exception as exc:  # noqa: B902 - a checkpoint must never stop the control loop
            self.get_logger().error(f'checkpoint failed: {exc!r} ({recovery.failed_checkpoints}'
                                    ' failed so far)', throttle_duration_sec=5.0)

    def _recover(self, engine):
        """Restores the newest checkpoint (by sequence) whose bytes are all finite, else
        episode_start; returns the message. FlashRTError when none is usable."""
        message = f'recovered: {self.recovery.recover().message}'
        self._holding = self._scrub = False
        self._sync_lockstep()
        return message

    def _resume(self, what):
        """restore_on_start: '' (off), 'latest' (newest loadable checkpoint file), or a file
        in the capsule directory. A named file that cannot be restored fails configure."""
        recovery = self.recovery
        self._resumed_from = recovery.resume(what)
