"""A MuJoCo world for a floating-base robot from an MJCF file (e.g. the Unitree G1), no ROS.

`RobotWorld` runs joint PD control at the simulation rate toward position targets, with a
decimation to the policy rate, as a ros2_control hardware loop would:
    tau = (target - q) * kps + (0 - dq) * kds      (every physics step, into the joint's motor)
`step(targets)` holds the targets for `decimation` physics steps (one control period), then
takes the readings. After `reset()` the world starts from the model's initial qpos (the MJCF
as is: no keyframe, as unitree_rl_gym's deploy_mujoco.py does) and holds `default_angles` for
one period, as that loop does before its first policy call. With targets computed as upstream
computes them (float32 policy output, float32 gains and default angles widened to float64),
and clip_targets=False, the trajectory is upstream's, bit for bit (`UpstreamController` below
builds them; test/unit/test_robot_world.py checks it against upstream's loop written out).

Readings, taken at the end of each period and kept with the world's snapshots:
  joint_state() -> (names, q, dq, tau): tau is the joint actuator force applied in the last
      physics step (qfrc_actuator, after the joint's actuatorfrcrange clamp).
  imu() -> (quat, gyro, acc): the floating base's frame, read from its free joint (MJCF
      IMU sensors, if a model has any, are not used; the G1 12-dof model has none):
      quat w,x,y,z of the base in the world frame (qpos), gyro = the free joint's angular
      velocity (MuJoCo keeps it in the base frame), acc = specific force in the base frame,
      R^T (a - g), with a = the free joint's linear acceleration (qacc) as the last physics
      step computed it, so a robot at rest reads +9.81 up, as an accelerometer does.
  base_position() -> the base body's origin (free joint position, world frame).
  sim_time (MuJoCo's clock) and steps (physics steps since reset): upstream's gait phase is
  (steps * sim_dt) % period, which is not quite data.time (that one accumulates additions).

Targets are clipped to the joints' ranges where the MJCF gives them (jnt_limited), as a
hardware interface would refuse to command past a limit; upstream does not clip (its G1 walk
asks for an ankle roll past 0.2618 rad now and then), so `clip_targets=False` is upstream's
loop exactly. The World interface (world.py) holds too, so the episode runner can drive it
(through a policy node's robot topics: RobotLink in flashrt_ros/harness/links.py): obs =
[qpos, qvel] (plus seeded noise after perturb; the readings above carry none), reward = the
base's forward (world x) velocity at the end of the period (a return times the period: about
the distance walked).
"""
import numpy as np

from flashrt_ros.sim.world import mujoco, MujocoSnapshots, require_mujoco


class RobotWorld(MujocoSnapshots):
    """A floating-base robot under joint PD control; see the module docstring."""

    columns = ('base x', 'base y')

    def __init__(self, mjcf_path, kps, kds, default_angles, sim_dt=None, decimation=1,
                 joint_names=None, clip_targets=True):
        require_mujoco()
        self.model = mujoco.MjModel.from_xml_path(str(mjcf_path))
        self.data = mujoco.MjData(self.model)
        m = self.model
        if sim_dt:                                  # as upstream: override the MJCF timestep
            if not sim_dt > 0:
                raise ValueError(f'sim_dt must be > 0 (or None: the MJCF\'s), got {sim_dt}')
            m.opt.timestep = float(sim_dt)
        self.sim_dt = float(m.opt.timestep)
        self.decimation = int(decimation)
        if self.decimation < 1:
            raise ValueError(f'decimation must be >= 1, got {decimation}')
        free = [j for j in range(m.njnt) if m.jnt_type[j] == int(mujoco.mjtJoint.mjJNT_FREE)]
        if not free:
            raise ValueError(f'{mjcf_path}: no free joint, RobotWorld needs a floating base')
        self.base_qpos = int(m.jnt_qposadr[free[0]])
        self.base_dof = int(m.jnt_dofadr[free[0]])
        self.base_body = mujoco.mj_id2name(m, mujoco.mjtObj.mjOBJ_BODY, m.jnt_bodyid[free[0]])
        # Joint -> its motor. Default joints: the actuated ones in actuator order.
        motors = {}
        for a in range(m.nu):
            if m.actuator_trntype[a] == int(mujoco.mjtTrn.mjTRN_JOINT):
                motors.setdefault(int(m.actuator_trnid[a, 0]), a)
        if joint_names is None or len(joint_names) == 0:
            joint_names = [mujoco.mj_id2name(m, mujoco.mjtObj.mjOBJ_JOINT, j)
                           for j in sorted(motors, key=motors.get)]
        self.joint_names = [str(n) for n in joint_names]
        if len(set(self.joint_names)) != len(self.joint_names):
            raise ValueError(f'joint names repeat: {self.joint_names}')
        ids = []
        for name in self.joint_names:
            j = mujoco.mj_name2id(m, mujoco.mjtObj.mjOBJ_JOINT, name)
            if j < 0:
                raise ValueError(f'no joint named {name!r} in {mjcf_path}')
            if m.jnt_type[j] not in (int(mujoco.mjtJoint.mjJNT_HINGE),
                                     int(mujoco.mjtJoint.mjJNT_SLIDE)):
                raise ValueError(f'joint {name!r} is not a hinge or slide joint')
            a = motors.get(j)
            # ctrl = torque only for a plain motor (fixed gain, no bias); a position servo
            # would put its own PD on top of ours.
            if (a is None or m.actuator_gaintype[a] != int(mujoco.mjtGain.mjGAIN_FIXED)
                    or m.actuator_biastype[a] != int(mujoco.mjtBias.mjBIAS_NONE)):
                raise ValueError(f'joint {name!r} has no motor actuator (torque control)')
            ids.append((j, a))
        self.qadr = np.array([m.jnt_qposadr[j] for j, _ in ids])
        self.dadr = np.array([m.jnt_dofadr[j] for j, _ in ids])
        self.act = np.array([a for _, a in ids])
        self.ctrl_per_force = 1.0 / (m.actuator_gear[self.act, 0]
                                     * m.actuator_gainprm[self.act, 0])
        n = len(ids)
        limited = np.array([bool(m.jnt_limited[j]) and clip_targets for j, _ in ids])
        self.low = np.where(limited, m.jnt_range[[j for j, _ in ids], 0], -np.inf)
        self.high = np.where(limited, m.jnt_range[[j for j, _ in ids], 1], np.inf)
        self.kps = self._vector(kps, n, 'kps')
        self.kds = self._vector(kds, n, 'kds')
        self.default_angles = self._vector(default_angles, n, 'default_angles')
        self.obs_dim, self.act_dim = m.nq + m.nv, n
        self._init_snapshots()
        self.reset()

    def _vector(self, values, n, what):
        v = np.array(values, dtype=np.float64).reshape(-1)
        if v.size != n:
            raise ValueError(f'{what} has {v.size} values, the world has {n} joints '
                             f'({", ".join(self.joint_names)})')
        if not np.all(np.isfinite(v)):
            raise ValueError(f'{what} holds NaN or Inf')
        return v

    # -- stepping --------------------------------------------------------------------------

    def reset(self, seed=0):
        """The model's initial state, then one period holding the default angles."""
        mujoco.mj_resetData(self.model, self.data)
        self.steps = 0
        self.noise_std = 0.0
        self.rng = np.random.default_rng(seed)
        self.targets = self.default_angles.copy()
        self._run()
        self.start_time = float(self.data.time), self.steps     # ResetSimulation SCOPE_TIME
        return self.observation()

    def step(self, targets=None):
        """Holds joint position targets (None: the current ones) for one control period."""
        if targets is not None:
            t = np.asarray(targets, dtype=np.float64).reshape(-1)
            if t.size != self.act_dim:
                raise ValueError(f'targets have {t.size} values, the world takes '
                                 f'{self.act_dim} (joints: {", ".join(self.joint_names)})')
            if not np.all(np.isfinite(t)):
                raise ValueError('targets hold NaN or Inf')
            self.targets = np.clip(t, self.low, self.high)
        self._run()
        return self.observation(), self.reward()

    def _run(self):
        m, d = self.model, self.data
        for _ in range(self.decimation):
            # Upstream's expression and order, so the float64 results match it bit for bit.
            tau = (self.targets - d.qpos[self.qadr]) * self.kps + \
                (0.0 - d.qvel[self.dadr]) * self.kds
            d.ctrl[self.act] = tau * self.ctrl_per_force
            mujoco.mj_step(m, d)
            self.steps += 1
        self._read()

    def _read(self):
        """Readings at the end of a period; kept so a restore gives them back exactly."""
        d, q0, v0 = self.data, self.base_qpos, self.base_dof
        quat = d.qpos[q0 + 3:q0 + 7].copy()
        rot = np.empty(9)
        mujoco.mju_quat2Mat(rot, quat)
        acc = rot.reshape(3, 3).T @ (d.qacc[v0:v0 + 3] - self.model.opt.gravity)
        self.readings = (d.qpos[self.qadr].copy(), d.qvel[self.dadr].copy(),
                         d.qfrc_actuator[self.dadr].copy(), quat,
                         d.qvel[v0 + 3:v0 + 6].copy(), acc)

    def perturb(self, push=0.0, noise_seed=None, noise_std=0.0):
        """A what-if: adds `push` (m/s) to the base's linear velocity, world frame: a number
        pushes sideways (y), three numbers are (x, y, z). Observation noise from a seed."""
        p = np.asarray(push, dtype=np.float64).reshape(-1)
        if p.size not in (1, 3) or not np.all(np.isfinite(p)):
            raise ValueError(f'push must be one finite value (y) or three (x, y, z): {push!r}')
        v0 = self.base_dof
        if p.size == 1:
            self.data.qvel[v0 + 1] += p[0]
        else:
            self.data.qvel[v0:v0 + 3] += p
        if noise_seed is not None:
            self.rng = np.random.default_rng(noise_seed)
        self.noise_std = float(noise_std)
        return self.observation()

    # -- readings --------------------------------------------------------------------------

    def joint_state(self):
        q, dq, tau = self.readings[:3]
        return list(self.joint_names), q.copy(), dq.copy(), tau.copy()

    def imu(self):
        return tuple(r.copy() for r in self.readings[3:])

    def base_position(self):
        return self.data.qpos[self.base_qpos:self.base_qpos + 3].copy()

    @property
    def control_period(self):
        """Simulated seconds of one step()."""
        return self.decimation * self.sim_dt

    def observation(self):
        obs = np.concatenate([self.data.qpos, self.data.qvel])
        if self.noise_std > 0.0:
            obs = obs + self.rng.normal(0.0, self.noise_std, obs.shape)
        return obs

    def reward(self):
        return float(self.data.qvel[self.base_dof])

    # -- snapshots -------------------------------------------------------------------------

    def _extra_state(self):
        return self.targets.copy(), self.readings     # the held targets, the cached readings

    def _set_extra_state(self, extra):
        targets, self.readings = extra
        self.targets = targets.copy()


# -- upstream's policy side --------------------------------------------------------------------

GAIT_PERIOD = 0.8   # s: the phase clock unitree_rl_gym's G1 policy was trained with


def load_upstream_config(yaml_path):
    """unitree_rl_gym's deploy_mujoco config (e.g. deploy_mujoco_g1.yaml), as it reads it:
    the vectors as float32, the rest as given."""
    import yaml
    with open(yaml_path) as f:
        cfg = yaml.safe_load(f)
    for key in ('kps', 'kds', 'default_angles', 'cmd_scale', 'cmd_init'):
        cfg[key] = np.array(cfg[key], dtype=np.float32)
    return cfg


def upstream_world(mjcf_path, cfg, **kwargs):
    """A RobotWorld with an upstream config's gains, default angles, dt and decimation."""
    return RobotWorld(mjcf_path, cfg['kps'], cfg['kds'], cfg['default_angles'],
                      sim_dt=cfg['simulation_dt'], decimation=cfg['control_decimation'],
                      **kwargs)


class UpstreamController:
    """The consumer side of unitree_rl_gym's deploy_mujoco.py loop: builds its 47 observations
    from a RobotWorld's readings and returns the next joint targets, in upstream's precision
    (float32), so that with clip_targets=False the run is upstream's bit for bit.

    policy: a callable on a [1, 47] float32 tensor (e.g. torch.jit.load('motion.pt'); its
    recurrent state lives in its own buffers). The obs layout: base angular velocity, projected
    gravity, command, joint positions and velocities, last action, sin/cos of the gait phase.
    """

    def __init__(self, policy, cfg, command=None):
        self.policy, self.cfg = policy, cfg
        cmd = cfg['cmd_init'] if command is None else np.asarray(command, dtype=np.float32)
        self.command = cmd * cfg['cmd_scale']
        self.action = np.zeros(cfg['num_actions'], dtype=np.float32)
        self.obs = np.zeros(cfg['num_obs'], dtype=np.float32)

    def __call__(self, world):
        import torch
        c, obs = self.cfg, self.obs
        _, q, dq, _ = world.joint_state()
        quat, gyro, _ = world.imu()
        qw, qx, qy, qz = quat
        gravity = [2 * (-qz * qx + qw * qy), -2 * (qz * qy + qw * qx), 1 - 2 * (qw * qw + qz * qz)]
        # upstream: counter * simulation_dt, its counter being physics steps since the start
        phase = (world.steps * c['simulation_dt']) % GAIT_PERIOD / GAIT_PERIOD
        obs[:3] = gyro * c['ang_vel_scale']
        obs[3:6] = gravity
        obs[6:9] = self.command
        n = self.action.size
        obs[9:9 + n] = (q - c['default_angles']) * c['dof_pos_scale']
        obs[9 + n:9 + 2 * n] = dq * c['dof_vel_scale']
        obs[9 + 2 * n:9 + 3 * n] = self.action
        obs[9 + 3 * n:9 + 3 * n + 2] = np.sin(2 * np.pi * phase), np.cos(2 * np.pi * phase)
        with torch.no_grad():
            self.action = self.policy(torch.from_numpy(obs).unsqueeze(0)).numpy().squeeze()
        return self.action * c['action_scale'] + c['default_angles']
