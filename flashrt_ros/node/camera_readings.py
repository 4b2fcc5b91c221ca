"""observation_type cameras: a LeRobot policy's observation from what the robot publishes,
one sensor_msgs/Image or CompressedImage topic per camera of the checkpoint, the joint state
and the instruction, assembled on the engine's device (runtime/camera_inputs.py).

A frame is decoded, checked against the checkpoint's size and copied to the device as it
arrives; the instruction is tokenized by the checkpoint's own pre-processor when it arrives
(Pi0.5's prompt holds the state: its tokens are made anew at every step, from that step's
state). A step takes the state from the joint state (by name, in joint_names order) and steps
on the newest frame of each camera. What cannot be read is refused with a message that names
it, and nothing of the observation changes.
"""
import numpy as np

from flashrt_ros.runtime.camera_inputs import CameraObservation, compressed_pixels, raw_pixels
from flashrt_ros.runtime.errors import InvalidObservation


class CameraReadings:
    """One session's observation: setup (settings.CameraSetup), joints (the state's names),
    device (the engine's)."""

    def __init__(self, setup, joints, device):
        self.setup, self.joints = setup, list(joints)
        self.observation = CameraObservation(setup.state_dim, setup.cameras, setup.tokens,
                                             device)
        self.text = None            # the instruction as given
        self._per_state = setup.tokenize is not None and setup.tokenize.state_in_prompt

    def image(self, key, msg):
        """A camera's message into the observation; InvalidObservation when it cannot be
        read or has another size than the checkpoint's."""
        if key in self.setup.compressed:
            pixels = compressed_pixels(bytes(msg.data))
        else:
            pixels = raw_pixels(msg.encoding, msg.height, msg.width, msg.step, msg.data)
        self.observation.put_image(key, pixels)

    def instruction(self, text):
        tokenize = self.setup.tokenize
        if tokenize is None:
            raise InvalidObservation('an instruction: this checkpoint takes none')
        if not self._per_state:
            self.observation.put_tokens(*tokenize(text))
        self.text = text

    def assemble(self, joint_state):
        """The observation for a step on joint_state ((names, positions, velocities)): the
        vector on the device, [1, obs_dim]; InvalidObservation, before anything is written,
        when a joint is missing or not finite, or a camera or the instruction has not come."""
        names, positions, _ = joint_state
        where = {n: i for i, n in enumerate(names)}
        missing = [j for j in self.joints if j not in where]
        if missing or len(positions) != len(names):
            raise InvalidObservation(f'the joint state lacks {missing or "positions"} (the '
                                     f'state is {self.joints})')
        state = np.array([positions[where[j]] for j in self.joints], np.float32)
        if not np.isfinite(state).all():
            raise InvalidObservation(f'the joint state of {self.joints} holds NaN or Inf')
        waiting = [k for k in self.observation.missing() if k not in ('state', 'tokens')]
        if self.setup.tokens and self.text is None:
            waiting.append('an instruction (the instruction parameter or ~/instruction)')
        if waiting:
            raise InvalidObservation(f'missing input: nothing received yet from {waiting}')
        if self._per_state:
            self.observation.put_tokens(*self.setup.tokenize(self.text, state))
        self.observation.put_state(state)
        return self.observation.vector.view(1, -1)
