"""Per-session safety in the policy node: the poison verdict after each step, the hold,
~/recover, periodic checkpoints and restore_on_start, for every session alike (a
single-session node is a fleet of one).

Thin glue over the runtime's Recovery (flashrt_ros/runtime/recovery.py: checkpoints, verdict,
recover, resume), one per session. What stays here is the node's side: what is logged (with
rclpy's throttling), and the on_poison choice between recovering at once and holding.
checkpoint_every, checkpoint_keep, checkpoint_to_disk and on_poison are read at every use, so
live parameter changes apply at the next step.
"""
from flashrt_ros.runtime import safety
from flashrt_ros.runtime.errors import FlashRTError
from flashrt_ros.runtime.recovery import Recovery
from flashrt_ros.runtime.safety import Supervisor


class SessionGuard:
    """One session's guard. on_state_replaced(index) runs after a recovery replaced the
    session's state (the control loop re-syncs its lock-step bookkeeping)."""

    def __init__(self, engine, index, settings, logger, on_state_replaced):
        self.engine, self.index, self.settings = engine, index, settings
        self.name = engine.session_names[index]
        self.label = f'session {self.name}: ' if engine.sessions > 1 else ''
        self.log = logger
        self._on_state_replaced = on_state_replaced
        cfg = settings.node
        self.recovery = Recovery(engine, cfg.checkpoint_every, cfg.checkpoint_keep,
                                 cfg.checkpoint_to_disk, logger=logger,
                                 session=index if engine.sessions > 1 else None)
        self.held = False           # poisoned and not recovered: steps refused until restored
        self.supervisor = None      # the safety supervisor (runtime/safety.py), if configured
        if cfg.safety and settings.terms:
            self.supervisor = Supervisor(
                engine, index if engine.sessions > 1 else None, cfg,
                safety.parse(cfg.safety, cfg, len(cfg.joint_names)), 1.0 / cfg.control_rate,
                logger, self.name if engine.sessions > 1 else '')

    @property
    def failed_checkpoints(self):
        return self.recovery.failed_checkpoints

    @property
    def last_checkpoint_failure(self):
        return self.recovery.last_failure

    @property
    def checkpoints_taken(self):
        return self.recovery.taken

    def settings_changed(self):
        cfg = self.settings.node
        self.recovery.configure(cfg.checkpoint_every, cfg.checkpoint_keep,
                                cfg.checkpoint_to_disk)

    def poisoned(self, action):
        """The step's finite flag was down: say what is not finite, then recover or hold
        (on_poison). The action is never published."""
        bad = self.recovery.verdict(action)
        self.log.error(f'{self.label}poisoned state at step '
                       f'{self.engine.session(self.index).step_index}: NaN/Inf in '
                       f'{", ".join(bad)}; action not published')
        if self.settings.node.on_poison == 'recover':
            try:
                self.log.warning(self.recover())
                return
            except FlashRTError as exc:
                self.log.error(f'{self.label}recovery failed ({exc}); holding until a restore')
        self.held = True

    def committed(self):
        """After a published step: a checkpoint when one is due. A failure is logged and
        counted (failed_checkpoints); control goes on."""
        recovery = self.recovery
        if not recovery.due():
            return
        try:
            recovery.checkpoint()
        except FlashRTError as exc:
            self.log.error(f'{self.label}{exc} ({recovery.failed_checkpoints} failed so far)',
                           throttle_duration_sec=5.0)
        except Exception as exc:  # noqa: B902 - a checkpoint must never stop the control loop
            self.log.error(f'{self.label}checkpoint failed: {exc!r} '
                           f'({recovery.failed_checkpoints} failed so far)',
                           throttle_duration_sec=5.0)

    def recover(self):
        """Restores the newest checkpoint (by sequence) whose bytes are all finite, else
        episode_start; returns the message. FlashRTError when none is usable."""
        message = f'{self.label}recovered: {self.recovery.recover().message}'
        self.held = False
        if self.supervisor is not None:
            self.supervisor.clear()
        self._on_state_replaced(self.index)
        return message

    def state_replaced(self):
        """After a user restore or reset of this session: scrub what a poisoned stretch left
        and stop holding. (A rollback does not end a hold: ~/recover, ~/restore or a reset
        do.)"""
        self.recovery.after_restore()
        self.held = False
        if self.supervisor is not None:
            self.supervisor.clear()

    def resume(self, what):
        """restore_on_start: '' (off), 'latest' (newest loadable checkpoint file of this
        session), or a file in the capsule directory. A named file that cannot be restored
        fails configure. Returns the file resumed from ('' when none)."""
        return self.recovery.resume(what)
