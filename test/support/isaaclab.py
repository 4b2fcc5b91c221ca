"""Isaac Lab's observation semantics for the real unitree_rl_lab G1 bundle
(../shared/robots/unitree_rl_lab_g1_velocity), written from Isaac Lab's documentation
(ObservationManager.compute_group, CircularBuffer), not from this package: the reference the
per-term history tests compare the engine and the node with. No ROS."""
from collections import deque
import pathlib

import numpy as np
import yaml

ROOT = pathlib.Path(__file__).resolve().parents[2]
BUNDLE = ROOT.parent / 'shared' / 'robots' / 'unitree_rl_lab_g1_velocity'
ONNX = BUNDLE / 'exported' / 'policy.onnx'
JOINTS = [f'joint_{i}' for i in range(29)]       # the policy's (Isaac Lab's) joint order
STEPS = 20


class _Loader(yaml.SafeLoader):
    '''deploy.yaml as Isaac Lab dumps it; the one Python tag (a joint slice) is not needed.'''


_Loader.add_multi_constructor('tag:yaml.org,2002:python/', lambda loader, suffix, node: None)


def deploy():
    return yaml.load((BUNDLE / 'params' / 'deploy.yaml').read_text(), Loader=_Loader)


def readings(seed=0):
    '''Plausible made-up readings, float64 as a ROS message carries them: joints near the
    default pose, velocities, a slightly tilted unit quaternion, gyro rates, a command.'''
    rng = np.random.default_rng(seed)
    default = np.array(deploy()['default_joint_pos'])
    out = []
    for _ in range(STEPS):
        q = default + 0.1 * rng.standard_normal(29)
        dq = 0.8 * rng.standard_normal(29)
        xyzw = np.array([0.05, -0.04, 0.3, 1.0]) + 0.03 * rng.standard_normal(4)
        xyzw /= np.linalg.norm(xyzw)
        omega = 0.3 * rng.standard_normal(3)
        command = rng.uniform([-0.5, -0.3, -0.2], [1.0, 0.3, 0.2])
        out.append(((JOINTS, q, dq), (tuple(xyzw), tuple(omega)), tuple(command)))
    return out


class IsaacLabReference:
    '''The policy group's input, from Isaac Lab's semantics (not from this package): each
    term in float32, clip (none here) then scale, into its own history buffer.'''

    def __init__(self, cfg):
        self.terms = list(cfg['observations'].items())
        self.default = np.array(cfg['default_joint_pos'], dtype=np.float32)
        self.buffers = None

    def reset(self):
        self.buffers = None             # CircularBuffer.reset: the next append fills it

    def __call__(self, reading, last_action):
        (_, q, dq), ((x, y, z, w), omega), command = reading
        # the IMU's gravity reading: the unit quaternion's rotation of (0, 0, -1), as float32
        gravity = np.array([2 * (-z * x + w * y), -2 * (z * y + w * x),
                            1 - 2 * (w * w + z * z)], dtype=np.float32)
        values = {'base_ang_vel': np.array(omega, np.float32), 'projected_gravity': gravity,
                  'velocity_commands': np.array(command, np.float32),
                  'joint_pos_rel': np.array(q, np.float32) - self.default,
                  'joint_vel_rel': np.array(dq, np.float32) - np.float32(0.0),
                  'last_action': last_action}
        frames = [values[name] * np.array(term['scale'], np.float32)
                  for name, term in self.terms]
        if self.buffers is None:
            self.buffers = [deque([f] * term['history_length'], maxlen=term['history_length'])
                            for f, (_, term) in zip(frames, self.terms)]
        else:
            for buffer, f in zip(self.buffers, frames):
                buffer.append(f)
        return np.concatenate([np.concatenate(list(b)) for b in self.buffers])
