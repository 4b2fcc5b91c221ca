"""The World interface the episode runner drives, and named snapshots of MuJoCo worlds.

`World`: what a simulator (MuJoCo here, Gazebo, ...) offers the episode runner.
`MujocoSnapshots`: world snapshots kept by name that hold the complete physics state
(mj_getState with mjSTATE_INTEGRATION: time, qpos, qvel, act, warmstart, ctrl, applied forces,
mocap, ...) plus the world's own counters and observation-noise generator. After
`restore(name)` the same actions give the same states, bit for bit. It also answers what the
simulation_interfaces services ask of a world (simulation_services.py): entities (the model's
named bodies), their ground-truth states, setting a free body's pose and twist, and resets of
state or time alone. The MuJoCo worlds built on it: `MujocoWorld` (cartpole.py) and
`RobotWorld` (robot_world.py).
"""
import json

import numpy as np

try:
    import mujoco
except ImportError:         # the ROS layer and the tests say so where it matters
    mujoco = None


def require_mujoco():
    if mujoco is None:
        raise RuntimeError('the MuJoCo world needs the `mujoco` package: '
                           'pip install -r requirements/runtime.txt')


class World:
    """What the episode runner needs from a simulator (MuJoCo here, Gazebo, ...).

    obs_dim / act_dim: sizes of observation and action vectors.
    reset(seed) -> obs; step(action) -> (obs, reward); snapshot(name); restore(name) -> obs;
    perturb(push, noise_seed, noise_std): a branch's what-if (an initial push on the robot,
    an observation-noise stream); state_bytes(): the physics state for trajectory checks.
    columns: what obs[0] and obs[1] are, for the episode runner's report.
    """

    obs_dim = 0
    act_dim = 0
    columns = ('obs[0]', 'obs[1]')

    def reset(self, seed=0):
        raise NotImplementedError

    def step(self, action):
        raise NotImplementedError

    def snapshot(self, name):
        raise NotImplementedError

    def restore(self, name):
        raise NotImplementedError

    def perturb(self, push=0.0, noise_seed=None, noise_std=0.0):
        raise NotImplementedError

    def state_bytes(self):
        raise NotImplementedError

    def close(self):
        pass


class MujocoSnapshots(World):
    """Named world snapshots of a MuJoCo world (self.model, self.data): the complete physics
    state (mj_getState with mjSTATE_INTEGRATION), the step counter, the observation-noise
    generator, plus whatever `_extra_state()` returns for a subclass's own fields. After
    `restore(name)` the same actions give the same states, bit for bit."""

    def _init_snapshots(self):
        self.spec = mujoco.mjtState.mjSTATE_INTEGRATION
        self.state_size = mujoco.mj_stateSize(self.model, self.spec)
        self.snapshots = {}

    def _extra_state(self):
        return None

    def _set_extra_state(self, extra):
        pass

    def physics_state(self):
        """The full integration state (float64 [mj_stateSize]) as one copy."""
        out = np.empty(self.state_size, dtype=np.float64)
        mujoco.mj_getState(self.model, self.data, out, self.spec)
        return out

    def state_bytes(self):
        return self.physics_state().tobytes()

    def snapshot(self, name):
        """Keeps the world state under `name` (overwrites); returns the physics state's size
        in bytes."""
        if not name:
            raise ValueError('world snapshot needs a name')
        state = self.physics_state()
        self.snapshots[name] = (state, self.steps, self.noise_std,
                                self.rng.bit_generator.state, self._extra_state())
        return state.nbytes

    def restore(self, name):
        if name not in self.snapshots:
            raise KeyError(f'no world snapshot named {name!r} '
                           f'(have: {sorted(self.snapshots) or "none"})')
        state, self.steps, self.noise_std, rng_state, extra = self.snapshots[name]
        mujoco.mj_setState(self.model, self.data, state, self.spec)
        # derived quantities (xpos, ...) for other readers; the integration state and the
        # next step do not depend on them
        mujoco.mj_forward(self.model, self.data)
        self._set_extra_state(extra)
        self.rng = np.random.default_rng()
        self.rng.bit_generator.state = rng_state
        return self.observation()

    def delete(self, name):
        self.snapshots.pop(name, None)

    # -- what simulation_interfaces asks of a world ----------------------------------------

    @property
    def sim_time(self):
        return float(self.data.time)

    def entities(self):
        """The model's named bodies, in model order (body 0, the world, is not an entity)."""
        names = (mujoco.mj_id2name(self.model, mujoco.mjtObj.mjOBJ_BODY, b)
                 for b in range(1, self.model.nbody))
        return [n for n in names if n]

    def _body(self, name):
        body = mujoco.mj_name2id(self.model, mujoco.mjtObj.mjOBJ_BODY, name) if name else -1
        if body <= 0:
            raise KeyError(f'no entity named {name!r} (entities: {", ".join(self.entities())})')
        return body

    def _free_joint(self, body):
        """The body's free joint id, or None."""
        m = self.model
        first, count = m.body_jntadr[body], m.body_jntnum[body]
        if count == 1 and m.jnt_type[first] == int(mujoco.mjtJoint.mjJNT_FREE):
            return int(first)
        return None

    def _slide_joints(self, body):
        """The joint ids of a body that hangs from the world on slide joints only (a cart on
        its rail), or None."""
        m = self.model
        joints = list(range(m.body_jntadr[body], m.body_jntadr[body] + m.body_jntnum[body]))
        if joints and m.body_parentid[body] == 0 and all(
                m.jnt_type[j] == int(mujoco.mjtJoint.mjJNT_SLIDE) for j in joints):
            return joints
        return None

    def _slide_velocity(self, joints):
        d = self.data
        return sum(d.xaxis[j] * d.qvel[self.model.jnt_dofadr[j]] for j in joints)

    def entity_state(self, name):
        """Ground truth of a body in the world frame: (position [3], quaternion wxyz [4],
        linear velocity of the body frame's origin [3], angular velocity [3], linear and angular
        acceleration [3] each). A free body's position, quaternion and linear velocity are its
        joint's own qpos/qvel values (so setting back what was read changes nothing)."""
        return self.entity_states([name])[0]

    def entity_states(self, names):
        """entity_state of each name, the derived quantities computed once for all."""
        bodies = [self._body(name) for name in names]
        # positions, frames and velocities of the state as it is: mj_step leaves those of the
        # state before its last integration in data. Derived quantities only: the integration
        # state, and so the trajectory, stay as they were.
        mujoco.mj_forward(self.model, self.data)
        mujoco.mj_rnePostConstraint(self.model, self.data)     # cacc, for the accelerations
        return [self._body_state(body) for body in bodies]

    def _body_state(self, body):
        m, d = self.model, self.data
        free, slides = self._free_joint(body), self._slide_joints(body)
        rot = d.xmat[body].reshape(3, 3)
        if free is not None:
            q, v = m.jnt_qposadr[free], m.jnt_dofadr[free]
            pos, quat = d.qpos[q:q + 3].copy(), d.qpos[q + 3:q + 7].copy()
            lin, ang = d.qvel[v:v + 3].copy(), rot @ d.qvel[v + 3:v + 6]
        elif slides:
            # a slide body's velocity straight from its joints: setting back what was read
            # (or that plus a push) leaves the other digits as they were
            pos, quat = d.xpos[body].copy(), d.xquat[body].copy()
            lin, ang = self._slide_velocity(slides), np.zeros(3)
        else:
            pos, quat = d.xpos[body].copy(), d.xquat[body].copy()
            vel = np.empty(6)
            # XBODY: at the body's frame origin (BODY would be its centre of mass)
            mujoco.mj_objectVelocity(m, d, mujoco.mjtObj.mjOBJ_XBODY, body, vel, 0)
            ang, lin = vel[:3], vel[3:]
        acc = np.empty(6)
        mujoco.mj_objectAcceleration(m, d, mujoco.mjtObj.mjOBJ_XBODY, body, acc, 0)
        # cacc carries gravity as an upward acceleration (MuJoCo's convention): remove it
        return pos, quat, lin, ang, acc[3:] + m.opt.gravity, acc[:3].copy()

    def set_entity_state(self, name, pos=None, quat=None, lin=None, ang=None):
        """Sets a free body's pose and/or twist (world frame; None: keep). A value equal to what
        entity_state() reports now is left exactly as it is. Raises KeyError (no such body),
        TypeError (the body is not free), ValueError (not finite, or a quaternion that is not
        unit within 1e-3: the message says which)."""
        m, d = self.model, self.data
        body = self._body(name)
        free = self._free_joint(body)
        slides = self._slide_joints(body)
        if free is None and slides:
            return self._set_slide_state(name, slides, pos, quat, lin, ang)
        if free is None:
            kinds = {int(mujoco.mjtJoint.mjJNT_SLIDE): 'slide', int(mujoco.mjtJoint.mjJNT_HINGE):
                     'hinge', int(mujoco.mjtJoint.mjJNT_BALL): 'ball'}
            joints = [kinds.get(int(m.jnt_type[j]), '?') for j in
                      range(m.body_jntadr[body], m.body_jntadr[body] + m.body_jntnum[body])]
            how = f'{" and ".join(joints)} joint(s)' if joints else 'no joint (welded)'
            raise TypeError(f'entity {name!r} is attached by {how}: only free bodies '
                            '(floating bases, loose objects) and bodies on slide joints from '
                            'the world can be set')
        now = self.entity_state(name)
        q, v = m.jnt_qposadr[free], m.jnt_dofadr[free]
        values = {'position': pos, 'orientation': quat, 'linear velocity': lin,
                  'angular velocity': ang}
        for what, value in values.items():
            if value is not None and not np.all(np.isfinite(value)):
                raise ValueError(f'{what} of {name!r} holds NaN or Inf: {list(value)}')
        if quat is not None:
            norm = float(np.linalg.norm(quat))
            if abs(norm - 1.0) > 1e-3:
                raise ValueError(f'orientation of {name!r} is not a unit quaternion '
                                 f'(norm {norm:.6g})')
        changed = False
        if pos is not None and not np.array_equal(pos, now[0]):
            d.qpos[q:q + 3] = pos
            changed = True
        if quat is not None and not np.array_equal(quat, now[1]):
            d.qpos[q + 3:q + 7] = np.asarray(quat, dtype=np.float64) / norm
            changed = True
        if lin is not None and not np.array_equal(lin, now[2]):
            d.qvel[v:v + 3] = lin
            changed = True
        if ang is not None and not np.array_equal(ang, now[3]):
            # the free joint's angular velocity is in the body frame; the request is in the
            # world frame (the new orientation's, if one was set)
            rot = np.empty(9)
            mujoco.mju_quat2Mat(rot, d.qpos[q + 3:q + 7])
            d.qvel[v + 3:v + 6] = rot.reshape(3, 3).T @ np.asarray(ang, dtype=np.float64)
            changed = True
        if changed:
            mujoco.mj_forward(m, d)
        return changed

    def _set_slide_state(self, name, joints, pos, quat, lin, ang):
        """set_entity_state of a body on slide joints: it can only move along their axes."""
        m, d = self.model, self.data
        now = self.entity_state(name)
        for what, value in (('position', pos), ('orientation', quat),
                            ('linear velocity', lin), ('angular velocity', ang)):
            if value is not None and not np.all(np.isfinite(value)):
                raise ValueError(f'{what} of {name!r} holds NaN or Inf: {list(value)}')
        if quat is not None and not np.allclose(quat, now[1], rtol=0, atol=1e-9):
            raise TypeError(f'entity {name!r} slides without turning: its orientation stays '
                            f'{list(now[1])}')
        if ang is not None and np.any(np.abs(ang) > 1e-9):
            raise TypeError(f'entity {name!r} slides without turning: angular velocity '
                            'must be zero')
        axes = np.array([d.xaxis[j] for j in joints])
        changed = False
        if pos is not None and not np.array_equal(pos, now[0]):
            offset = axes @ (np.asarray(pos, dtype=np.float64) - now[0])
            if np.abs(now[0] + axes.T @ offset - pos).max() > 1e-9:
                raise TypeError(f'entity {name!r} moves only along {axes.tolist()}')
            for j, delta in zip(joints, offset):
                d.qpos[m.jnt_qposadr[j]] += delta
            changed = True
        if lin is not None and not np.array_equal(lin, now[2]):
            speeds = axes @ np.asarray(lin, dtype=np.float64)
            if np.abs(axes.T @ speeds - lin).max() > 1e-9:
                raise TypeError(f'entity {name!r} moves only along {axes.tolist()}')
            for j, speed in zip(joints, speeds):
                d.qvel[m.jnt_dofadr[j]] = speed
            changed = True
        if changed:
            mujoco.mj_forward(m, d)
        return changed

    def reset_scoped(self, seed=0, state=True, time=True):
        """ResetSimulation's scopes: state and time (the seeded start), the state alone (time
        and step counter kept) or the time alone (state kept; the time and step counter the
        start state has)."""
        if state:
            kept = float(self.data.time), self.steps
            obs = self.reset(seed)
            if not time:
                self.data.time, self.steps = kept
            return obs
        if time:
            self.data.time, self.steps = self.start_time
        return self.observation()

    # -- world capsule files ---------------------------------------------------------------

    def state_digest(self):
        """What a world capsule file must match to be loaded here: the model (sizes, timestep,
        the state layout) and the world's class."""
        m = self.model
        fields = [type(self).__name__, self.state_size, m.nq, m.nv, m.nu, m.na, m.nbody,
                  float(m.opt.timestep), int(self.spec)]
        return json.dumps(fields)

    def snapshot_bytes(self, name):
        """A kept snapshot as bytes for a file: a JSON header (step counter, noise, generator
        state, the subclass's extra state) then the float64 physics state."""
        state, steps, noise_std, rng_state, extra = self.snapshots[name]
        head = json.dumps({'steps': steps, 'noise_std': noise_std, 'rng': rng_state,
                           'extra': _to_json(extra)}).encode()
        return len(head).to_bytes(8, 'little') + head + state.tobytes()

    def load_snapshot_bytes(self, name, blob):
        """The inverse of snapshot_bytes: keeps the snapshot under `name` (overwrites)."""
        n = int.from_bytes(blob[:8], 'little')
        head = json.loads(blob[8:8 + n].decode())
        state = np.frombuffer(blob[8 + n:], dtype=np.float64).copy()
        if state.size != self.state_size:
            raise ValueError(f'world capsule holds {state.size} state values, this world '
                             f'has {self.state_size}')
        self.snapshots[name] = (state, head['steps'], head['noise_std'], head['rng'],
                                _from_json(head['extra']))


def _to_json(value):
    """numpy arrays (float64) in tuples, as JSON; float64 values survive exactly (repr)."""
    if isinstance(value, np.ndarray):
        return {'array': value.tolist(), 'dtype': str(value.dtype)}
    if isinstance(value, (tuple, list)):
        return {'tuple': [_to_json(v) for v in value]}
    return value


def _from_json(value):
    if isinstance(value, dict) and 'array' in value:
        return np.array(value['array'], dtype=value['dtype'])
    if isinstance(value, dict) and 'tuple' in value:
        return tuple(_from_json(v) for v in value['tuple'])
    return value
