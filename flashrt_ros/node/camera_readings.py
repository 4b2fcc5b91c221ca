"""observation_type cameras: a LeRobot policy's observation from what the robot publishes,
one sensor_msgs/Image or CompressedImage topic per camera of the checkpoint, the joint state
and the instruction, assembled on the engine's device (runtime/camera_inputs.py).

A frame is decoded, checked against the checkpoint's size and staged on the device as it
arrives, on the node's camera thread and without the node's lock (stage: decoding a JPEG
takes milliseconds, which the control thread does not wait for); it enters the observation
between ticks, under the lock (on_image). The instruction is tokenized by the checkpoint's
own pre-processor when it arrives (Pi0.5's prompt holds the state: its tokens are made anew
at every step, from that step's state). A step takes the state from the joint state (by
name, in joint_names order) and steps on the newest frame of each camera (lock-step with
camera_sync stamp: on each camera's frame of the joint state's stamp, holds). What cannot be
read is refused with a message that names it, and nothing of the observation changes.
"""
from flashrt_ros.runtime.camera_inputs import CameraObservation, compressed_pixels, raw_pixels
from flashrt_ros.runtime.errors import InvalidObservation
from flashrt_ros.runtime.observation import ObservationLayout


def _stamp(stamp):
    return f'{stamp[0]}.{stamp[1]:09d}'


def _seconds(stamp):
    return stamp[0] + stamp[1] * 1e-9


class CameraReadings:
    """One session's observation: setup (settings.CameraSetup), cfg (the NodeConfig:
    joint_names, the state's, and the instruction), device (the engine's), report
    (diagnostics.Report: refusals), log, and vector: its row of the fleet's device
    observations (ControlLoop)."""

    def __init__(self, setup, cfg, device, report, log, vector=None):
        self.setup, self.report, self.log = setup, report, log
        # the state read by name as joint_state observations read it (one joint_pos term, in
        # the checkpoint's units: joint_offset, joint_scale): joints missing, named twice or
        # not finite are refused there
        self._state = ObservationLayout(
            [{'name': 'joint_pos', 'offset': cfg.joint_offset or [0.0],
              'scale': cfg.joint_scale or [1.0]}], cfg.joint_names, [], len(cfg.joint_names))
        self.observation = CameraObservation(setup.state_dim, setup.cameras, setup.tokens,
                                             device, vector)
        self.text = None            # the instruction as given
        self._held = 0              # lock-step: the step tag last held for frames (logged)
        self.sync_stamps = cfg.camera_sync == 'stamp'
        self.max_age = cfg.max_input_age    # lock-step, newest: a frame's, by its stamp
        self._per_state = setup.tokenize is not None and setup.tokenize.state_in_prompt
        if getattr(setup.tokenize, 'padded_from', None):
            log.warning('the checkpoint pads its prompt to each instruction\'s length '
                        f'({setup.tokenize.padded_from}); the node pads it to '
                        f'{setup.tokens} tokens, masked: its actions agree with LeRobot\'s '
                        'within float rounding, not bit for bit (pad_language_to '
                        'max_length in config.json and policy_preprocessor.json gives '
                        'both the same bits)')
        if cfg.instruction:         # (settings: only for a policy that takes one)
            self.instruction(cfg.instruction)

    def stage(self, key, msg):
        """A camera's message decoded and staged on the device, off the lock (the camera
        thread); None, or what refuses it (an exception, reported by on_image)."""
        epoch = self.observation.epoch      # before decoding: a restore meanwhile outdates it
        try:
            if key in self.setup.compressed:
                pixels = compressed_pixels(bytes(msg.data), self.setup.cameras[key][1:],
                                           msg.format)
            else:
                pixels = raw_pixels(msg.encoding, msg.height, msg.width, msg.step, msg.data)
            self.observation.stage(key, pixels, epoch)
        except Exception as exc:  # noqa: B902 - reported under the lock, as callbacks are
            return exc
        return None

    def on_image(self, s, key, problem, stamp):
        """The frame stage() made of session s's camera message into the observation (under
        the lock): True; or refused (problem; the frame before it kept): False; or False, left
        out, for a frame taken before the state was replaced (lock-step's restore, reset,
        rollback), decoded meanwhile: the replaced episode's world, as the frames forgotten."""
        if isinstance(problem, InvalidObservation):
            self.report.refuse(f'{s.label}{key}: {problem}', key='image')
            return False
        if problem is not None:
            raise problem
        if not self.observation.put_staged(key):
            self.log.info(f'{s.label}{key}: a frame taken before the state was replaced is '
                          'left out (the replaced episode\'s)')
            return False
        s.store('camera:' + key, True, stamp)
        return True

    def holds(self, s, tag):
        """Lock-step: whether session s's joint state of step tag `tag` waits for frames: until
        each camera has sent one since the state was replaced (activation, restore, reset,
        rollback), as those before are the old episode's world; with camera_sync stamp, until
        each camera's newest frame carries the joint state's stamp (a world that renders every
        step: a frame still decoding is waited for, not replaced by the one before). Logged
        once per joint state, so that a camera that never sends is seen (the world waits).
        Until the instruction has come (a checkpoint that takes one) it waits too: refused, its
        stamp would count as answered and the world would wait for an answer without end."""
        stamp = s.inputs['joint_state'][1]
        cameras = [k for k in self.observation.missing() if k in self.setup.cameras]
        late = [k for k in self.setup.cameras if self.sync_stamps and k not in cameras and
                s.inputs.get('camera:' + k, (None, None))[1] != stamp]
        told = self.setup.tokens == 0 or self.text is not None
        if (cameras or late or not told) and self._held != tag:
            self._held = tag
            what = [f'a first frame from {cameras} since the state was replaced'] if cameras \
                else []
            if not told:
                what.append('the instruction (the instruction parameter or ~/instruction)')
            if late:
                newest = ', '.join(_stamp(s.inputs['camera:' + k][1]) for k in late)
                what.append(f'the frame stamped {_stamp(stamp)} from {late} (camera_sync: '
                            f'stamp; their newest: {newest})')
            self.log.info(f'{s.label}lock-step: the joint state waits for ' + ' and '.join(what))
        return bool(cameras or late or not told)

    def ready(self, s, tag):
        """Lock-step: whether session s's joint state of step tag steps now: not held for
        frames (holds), nor refused (reported) for a camera's old frame (behind)."""
        if self.holds(s, tag):
            return False
        behind = self.behind(s)
        if behind:
            self.report.refuse(f'{s.label}stale input: {behind}')
        return not behind

    def behind(self, s):
        """Lock-step, camera_sync newest: the cameras whose newest frame is stamped more than
        max_input_age s (on the world's clock) before session s's joint state, in
        words ('' when none). A camera that stopped would otherwise have its last frame
        stepped on without end; under sim time the frames' arrival says nothing, their stamps
        do. An unstamped frame (0) is not aged."""
        if self.sync_stamps:
            return ''       # (each joint state waits for its own frames: holds)
        joint, old = s.inputs['joint_state'][1], []
        for k in self.setup.cameras:
            frame = s.inputs.get('camera:' + k, (None, (0, 0)))[1]
            if frame != (0, 0) and _seconds(joint) - _seconds(frame) > self.max_age:
                old.append(f'{k} (its newest frame stamped {_stamp(frame)})')
        if not old:
            return ''
        return (f'the joint state stamped {_stamp(joint)} is more than {self.max_age} s '
                f'(max_input_age) after the frames of {", ".join(old)}')

    def on_instruction(self, s, text):
        """A new instruction (~/instruction, or the parameter set while running): True; or
        refused (reported): False."""
        try:
            self.instruction(text)
        except InvalidObservation as exc:
            self.report.refuse(f'{s.label}{exc}', key='instruction')
            return False
        self.log.info(f'{s.label}instruction: {text!r}')
        return True

    def instruction(self, text):
        tokenize = self.setup.tokenize
        if tokenize is None:
            raise InvalidObservation('an instruction: this checkpoint takes none')
        if not self._per_state:     # (Pi0.5's prompt, with the state: tokenized each step)
            ids, mask = tokenize(text)
            whole = tokenize.length(text) if mask.all() else self.setup.tokens
            if whole > self.setup.tokens:
                # what LeRobot does too; the model reads no more, but the user should know
                self.log.warning(f'instruction {text!r} is {whole} tokens: the '
                                 f'checkpoint reads its first {self.setup.tokens} '
                                 '(tokenizer_max_length), as LeRobot does')
            self.observation.put_tokens(ids, mask)
        self.text = text

    def assemble(self, joint_state):
        """The observation for a step on joint_state ((names, positions, velocities)): the
        vector on the device, [obs_dim]; InvalidObservation, before anything is written,
        when a joint is missing, named twice or not finite, or a camera or the instruction has
        not come."""
        state = self._state.assemble(0, joint_state=joint_state)
        waiting = [k for k in self.observation.missing() if k not in ('state', 'tokens')]
        if self.setup.tokens and self.text is None:
            waiting.append('an instruction (the instruction parameter or ~/instruction)')
        if waiting:
            raise InvalidObservation(f'missing input: nothing received yet from {waiting}')
        if self._per_state:
            self.observation.put_tokens(*self.setup.tokenize(self.text, state))
        self.observation.put_state(state)
        return self.observation.vector
