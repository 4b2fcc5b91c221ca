"""The World interface the episode runner drives, and named snapshots of MuJoCo worlds.

`World`: what a simulator (MuJoCo here, Gazebo, ...) offers the episode runner.
`MujocoSnapshots`: world snapshots kept by name that hold the complete physics state
(mj_getState with mjSTATE_INTEGRATION: time, qpos, qvel, act, warmstart, ctrl, applied forces,
mocap, ...) plus the world's own counters and observation-noise generator. After
`restore(name)` the same actions give the same states, bit for bit. The MuJoCo worlds built on
it: `MujocoWorld` (cartpole.py) and `RobotWorld` (robot_world.py).
"""
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
