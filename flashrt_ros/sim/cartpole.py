"""The cart-pole world: a headless MuJoCo cart-pole, in process (mujoco + numpy, no ROS).

Deterministic stepping and named world snapshots (`MujocoSnapshots`, world.py): after
`restore(name)` the same actions give the same states, bit for bit. The `flashrt_sim` node
(sim_node.py) serves it over ROS 2 with parameter world = 'cartpole'.
"""
import math

import numpy as np

from flashrt_ros.sim.world import mujoco, MujocoSnapshots, require_mujoco

CARTPOLE_XML = """
<mujoco model="flashrt_cartpole">
  <option timestep="0.01" integrator="RK4">
    <flag contact="disable"/>
  </option>
  <worldbody>
    <body name="cart" pos="0 0 1">
      <joint name="slider" type="slide" axis="1 0 0" limited="true" range="-3 3"
             damping="0.05"/>
      <geom name="cart" type="box" size="0.2 0.15 0.1" mass="1"/>
      <body name="pole" pos="0 0 0">
        <joint name="hinge" type="hinge" axis="0 1 0" damping="0.005"/>
        <geom name="pole" type="capsule" fromto="0 0 0 0 0 0.8" size="0.04" mass="0.1"/>
      </body>
    </body>
  </worldbody>
  <actuator>
    <motor name="push" joint="slider" gear="10" ctrllimited="true" ctrlrange="-1 1"/>
  </actuator>
</mujoco>
"""


class MujocoWorld(MujocoSnapshots):
    """The cart-pole on MuJoCo, in process. obs = [x, theta, x_dot, theta_dot] (qpos, qvel).

    action: one value, scaled by `action_scale` and clipped to the actuator's control range,
    held for `frame_skip` physics steps. reward: cos(theta) - 0.01 x^2 (1 when upright).
    """

    columns = ('x', 'theta')

    def __init__(self, xml=CARTPOLE_XML, frame_skip=2, action_scale=1.0):
        require_mujoco()
        self.model = mujoco.MjModel.from_xml_string(xml)
        self.data = mujoco.MjData(self.model)
        self.frame_skip = int(frame_skip)
        self.action_scale = float(action_scale)
        self.obs_dim = self.model.nq + self.model.nv
        self.act_dim = self.model.nu
        self._init_snapshots()
        self.steps = 0
        self.noise_std = 0.0
        self.rng = np.random.default_rng(0)
        self.reset()

    # -- state -----------------------------------------------------------------------------

    def qpos_qvel_bytes(self):
        return self.data.qpos.tobytes() + self.data.qvel.tobytes()

    # -- episode ---------------------------------------------------------------------------

    def reset(self, seed=0):
        """The seeded start state: pole near upright, small seeded offsets."""
        mujoco.mj_resetData(self.model, self.data)
        rng = np.random.default_rng(seed)
        self.data.qpos[:] = rng.uniform(-0.05, 0.05, self.model.nq)
        self.data.qvel[:] = rng.uniform(-0.05, 0.05, self.model.nv)
        mujoco.mj_forward(self.model, self.data)
        self.steps = 0
        self.noise_std = 0.0
        self.rng = np.random.default_rng(seed)
        self.start_time = float(self.data.time), self.steps     # ResetSimulation SCOPE_TIME
        return self.observation()

    def perturb(self, push=0.0, noise_seed=None, noise_std=0.0):
        """A what-if: adds `push` (m/s) to the cart's velocity; observation noise from a seed."""
        self.data.qvel[0] += push
        mujoco.mj_forward(self.model, self.data)
        if noise_seed is not None:
            self.rng = np.random.default_rng(noise_seed)
        self.noise_std = float(noise_std)
        return self.observation()

    def observation(self):
        obs = np.concatenate([self.data.qpos, self.data.qvel])
        if self.noise_std > 0.0:
            obs = obs + self.rng.normal(0.0, self.noise_std, obs.shape)
        return obs

    def control(self, action):
        a = np.asarray(action, dtype=np.float64).reshape(-1)
        if a.size != self.act_dim:
            raise ValueError(f'action has {a.size} values, the world takes {self.act_dim}')
        if not np.all(np.isfinite(a)):
            raise ValueError('action holds NaN or Inf')
        low, high = self.model.actuator_ctrlrange[:, 0], self.model.actuator_ctrlrange[:, 1]
        return np.clip(self.action_scale * a, low, high)

    def step(self, action=None):
        """One control step: set the controls (None: keep them), integrate frame_skip steps."""
        if action is not None:
            self.data.ctrl[:] = self.control(action)
        for _ in range(self.frame_skip):
            mujoco.mj_step(self.model, self.data)
        self.steps += 1
        return self.observation(), self.reward()

    @property
    def control_period(self):
        """Simulated seconds of one step()."""
        return self.frame_skip * float(self.model.opt.timestep)

    def reward(self):
        x, theta = self.data.qpos[0], self.data.qpos[1]
        return float(math.cos(theta) - 0.01 * x * x)
