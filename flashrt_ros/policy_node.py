"""The flashrt_policy lifecycle node: a policy on a captured step graph, with capsule services.

configure: read and check parameters, build the policy, the state arena and the step graph.
activate: observation subscription, action/status/diagnostics publishers, a pinned
'episode_start' capsule. deactivate/cleanup/shutdown release them in that order.

Every observation is one committed step and publishes one action. Capsule services have
their own callback group; the engine's lock makes each operation happen between two steps,
on any executor (main() spins a single thread; see there for why). Services exist in every
lifecycle state so that a call made while the node is not active gets a clear refusal
instead of silence.
"""
import array
import math
import os

from diagnostic_msgs.msg import DiagnosticArray, DiagnosticStatus, KeyValue
from lifecycle_msgs.msg import State
import numpy as np
import rclpy
from rclpy.callback_groups import MutuallyExclusiveCallbackGroup, ReentrantCallbackGroup
from rclpy.exceptions import ParameterUninitializedException
from rclpy.executors import ExternalShutdownException, SingleThreadedExecutor
from rclpy.lifecycle import LifecycleNode, TransitionCallbackReturn
from rclpy.parameter import Parameter
from rclpy.qos import HistoryPolicy, QoSProfile, ReliabilityPolicy
from sensor_msgs.msg import JointState
from std_msgs.msg import Float32MultiArray
from std_srvs.srv import Trigger
import torch

from flashrt_ros import msg as fmsg
from flashrt_ros import srv as fsrv
from flashrt_ros.recovery import RecoveryMixin
from flashrt_ros.runtime.engine import EPISODE_START, PolicyEngine
from flashrt_ros.runtime.errors import FlashRTError, InvalidConfig, InvalidObservation
from flashrt_ros.runtime.policies import make_policy

# name -> default; the type of the default is the parameter's type.
PARAMETERS = {
    'autostart': True,
    'policy_type': 'recurrent',
    'policy_file': '',
    'seed': 0,
    'obs_dim': 48,
    'act_dim': 12,
    'rnn_type': 'lstm',
    'rnn_hidden_dim': 256,
    'history_capacity': 2048,
    'd_model': 256,
    'n_layers': 4,
    'heads': 4,
    'chunk': 8,
    'noise_std': 0.0,
    'device': 'auto',
    'cuda_graph': True,
    'capsule_dir': '~/.ros/flashrt_capsules',
    'device_budget_mb': 1024,
    'host_budget_mb': 4096,
    'rollback_depth': 32,
    'observation_type': 'float32_array',
    'joint_names': Parameter.Type.STRING_ARRAY,
    'action_joint_names': Parameter.Type.STRING_ARRAY,
    'qos_depth': 10,
    'qos_reliability': 'reliable',
    'status_period': 1.0,
    'checkpoint_every': 0,
    'checkpoint_keep': 3,
    'checkpoint_to_disk': False,
    'poison_check': True,
    'on_poison': 'recover',
    'restore_on_start': '',
}
STATE_NAMES = {State.PRIMARY_STATE_UNCONFIGURED: 'unconfigured',
               State.PRIMARY_STATE_INACTIVE: 'inactive',
               State.PRIMARY_STATE_ACTIVE: 'active',
               State.PRIMARY_STATE_FINALIZED: 'finalized'}


def capsule_info(manifest):
    """flashrt_ros/msg/CapsuleInfo from a runtime Manifest (an empty message for None)."""
    info = fmsg.CapsuleInfo()
    if manifest is None:
        return info
    info.name = manifest.name
    info.parent = manifest.parent
    info.tier = manifest.tier
    info.pinned = bool(manifest.pinned)
    info.step = int(manifest.step)
    info.episode = int(manifest.episode)
    info.position = int(manifest.position)
    info.nbytes = int(manifest.nbytes)
    info.schema_digest = manifest.schema_digest
    info.model_digest = manifest.model_digest
    frac, whole = math.modf(manifest.created)
    info.stamp.sec = int(whole)
    info.stamp.nanosec = int(frac * 1e9)
    return info


class PolicyNode(RecoveryMixin, LifecycleNode):
    """Lifecycle node `flashrt_policy`: see the module docstring."""

    def __init__(self, node_name='flashrt_policy', **kwargs):
        super().__init__(node_name, **kwargs)
        for name, default in PARAMETERS.items():
            self.declare_parameter(name, default)
        self.engine = None
        self.config = None
        self._state = 'unconfigured'
        self._rejected = 0            # refused before reaching the engine (joint names, ...)
        self._poisoned = 0            # steps whose action or state held NaN/Inf
        self._holding = False         # on_poison 'hold': refuse observations until restored
        self._scrub = False           # a poisoned step may have left NaN rows past position
        self._checkpoint_seq = 0
        self._resumed_from = ''
        self._rejected_reported = 0
        self._obs_sub = self._status_timer = None
        self._action_pub = self._status_pub = self._diag_pub = None
        self._obs_group = MutuallyExclusiveCallbackGroup()
        self._srv_group = ReentrantCallbackGroup()
        services = [
            (fsrv.Snapshot, 'snapshot', self.snapshot_callback),
            (fsrv.Restore, 'restore', self.restore_callback),
            (fsrv.Fork, 'fork', self.fork_callback),
            (fsrv.Rollback, 'rollback', self.rollback_callback),
            (fsrv.ListCapsules, 'list_capsules', self.list_capsules_callback),
            (fsrv.DeleteCapsule, 'delete_capsule', self.delete_capsule_callback),
            (fsrv.SaveCapsule, 'save_capsule', self.save_capsule_callback),
            (fsrv.LoadCapsule, 'load_capsule', self.load_capsule_callback),
            (Trigger, 'reset_episode', self.reset_episode_callback),
            (Trigger, 'recover', self.recover_callback),
        ]
        for srv_type, name, callback in services:
            self.create_service(srv_type, '~/' + name, callback,
                                callback_group=self._srv_group)

    # -- parameters ----------------------------------------------------------------------------

    def _read_config(self):
        """Parameters as a dict, checked; InvalidConfig names the offending parameter."""
        cfg = {}
        for name in PARAMETERS:
            try:
                value = self.get_parameter(name).value
            except ParameterUninitializedException:
                value = None
            if name.endswith('joint_names'):
                value = [v for v in (value or []) if v]    # unset string arrays read as None
            cfg[name] = value

        def need(ok, name, what):
            if not ok:
                raise InvalidConfig(f'parameter {name!r} = {cfg[name]!r}: {what}')

        need(cfg['policy_type'] in ('recurrent', 'history'), 'policy_type',
             "must be 'recurrent' or 'history'")
        for name in ('obs_dim', 'act_dim', 'rnn_hidden_dim', 'history_capacity', 'd_model',
                     'n_layers', 'heads', 'chunk', 'rollback_depth', 'qos_depth'):
            need(cfg[name] >= 1, name, 'must be >= 1')
        need(cfg['noise_std'] >= 0.0, 'noise_std', 'must be >= 0')
        need(cfg['device_budget_mb'] >= 0 and cfg['host_budget_mb'] >= 0, 'device_budget_mb',
             'budgets must be >= 0')
        need(cfg['status_period'] > 0.0, 'status_period', 'must be > 0')
        need(cfg['checkpoint_every'] >= 0, 'checkpoint_every', 'must be >= 0 (0: off)')
        need(cfg['checkpoint_keep'] >= 1, 'checkpoint_keep', 'must be >= 1')
        need(cfg['on_poison'] in ('recover', 'hold'), 'on_poison',
             "must be 'recover' (restore the newest valid checkpoint) or 'hold' (publish "
             'nothing until a restore, recover or reset_episode)')
        need(cfg['qos_reliability'] in ('reliable', 'best_effort'), 'qos_reliability',
             "must be 'reliable' or 'best_effort'")
        need(cfg['observation_type'] in ('float32_array', 'joint_state'), 'observation_type',
             "must be 'float32_array' or 'joint_state'")
        if cfg['policy_file']:
            cfg['policy_file'] = os.path.expanduser(cfg['policy_file'])
            need(os.path.isfile(cfg['policy_file']), 'policy_file', 'no such file')
        device = cfg['device']
        if device == 'auto':
            device = 'cuda' if torch.cuda.is_available() else 'cpu'
        try:
            device = torch.device(device)
        except RuntimeError:
            need(False, 'device', "must be 'auto', 'cpu', 'cuda' or 'cuda:N'")
        need(device.type in ('cpu', 'cuda'), 'device', "must be 'auto', 'cpu' or 'cuda[:N]'")
        need(device.type != 'cuda' or torch.cuda.is_available(), 'device',
             'CUDA is not available on this machine')
        cfg['device'] = device
        if cfg['observation_type'] == 'joint_state':
            fields = len(cfg['joint_names'])
            need(fields > 0 and cfg['obs_dim'] in (fields, 2 * fields), 'joint_names',
                 'joint_state observations need obs_dim == len(joint_names) (positions) or '
                 '2 * len(joint_names) (positions then velocities)')
            need(len(cfg['action_joint_names']) in (0, cfg['act_dim']), 'action_joint_names',
                 'must be empty or hold act_dim names')
        cfg['capsule_dir'] = os.path.expanduser(cfg['capsule_dir'])
        return cfg

    def _build_engine(self, cfg):
        if cfg['policy_type'] == 'recurrent':
            sizes = dict(rnn_type=cfg['rnn_type'], rnn_hidden_dim=cfg['rnn_hidden_dim'])
            if cfg['policy_file']:
                sizes = {}      # the file (rsl_rl policy.pt) states its own sizes
        else:
            sizes = dict(capacity=cfg['history_capacity'], d_model=cfg['d_model'],
                         n_layers=cfg['n_layers'], heads=cfg['heads'], chunk=cfg['chunk'])
        if cfg['noise_std'] > 0.0:
            sizes['noise_std'] = cfg['noise_std']
        policy = make_policy(cfg['policy_type'], cfg['obs_dim'], cfg['act_dim'],
                             file=cfg['policy_file'], seed=cfg['seed'], **sizes)
        return PolicyEngine(policy, device=cfg['device'], cuda_graph=cfg['cuda_graph'],
                            rollback_depth=cfg['rollback_depth'],
                            device_budget=cfg['device_budget_mb'] << 20,
                            host_budget=cfg['host_budget_mb'] << 20,
                            capsule_dir=cfg['capsule_dir'])

    # -- lifecycle -----------------------------------------------------------------------------

    def on_configure(self, state):
        try:
            cfg = self._read_config()
            self.engine = self._build_engine(cfg)
            self.config = cfg
            self._resume(cfg['restore_on_start'])
            self._create_publishers(cfg)
        except Exception as exc:  # noqa: B902 - rclpy would swallow it without a word
            self.get_logger().error(f'configure failed: {exc}')
            self._release_configured()
            return TransitionCallbackReturn.FAILURE
        self._rejected = self._rejected_reported = self._poisoned = 0
        self._holding = self._scrub = False
        e = self.engine
        self.get_logger().info(
            f'configured: {cfg["policy_type"]} policy on {e.device}, cuda graph '
            f'{"captured" if e.graph_captured else "off (eager)"}, state '
            f'{e.arena.storage.numel()} bytes, capsules in {e.store.directory}')
        self._state = 'inactive'
        return TransitionCallbackReturn.SUCCESS

    def _create_publishers(self, cfg):
        self._qos = QoSProfile(history=HistoryPolicy.KEEP_LAST, depth=cfg['qos_depth'],
                               reliability=(ReliabilityPolicy.RELIABLE
                                            if cfg['qos_reliability'] == 'reliable'
                                            else ReliabilityPolicy.BEST_EFFORT))
        action_type = JointState if cfg['observation_type'] == 'joint_state' and \
            cfg['action_joint_names'] else Float32MultiArray
        self._action_pub = self.create_lifecycle_publisher(action_type, '~/action', self._qos)
        self._status_pub = self.create_lifecycle_publisher(fmsg.PolicyStatus, '~/status', 10)
        self._diag_pub = self.create_lifecycle_publisher(DiagnosticArray, '/diagnostics', 10)

    def on_activate(self, state):
        cfg = self.config
        obs_type = JointState if cfg['observation_type'] == 'joint_state' else Float32MultiArray
        self._obs_sub = self.create_subscription(obs_type, '~/observation',
                                                 self.observation_callback, self._qos,
                                                 callback_group=self._obs_group)
        self._status_timer = self.create_timer(cfg['status_period'], self.publish_status)
        try:
            # Kept across deactivate/activate; a resumed process keeps the one it loaded.
            if EPISODE_START not in self.engine.store and not self._resumed_from:
                result = self.engine.snapshot(EPISODE_START, pin=True)
                self.get_logger().info(result.message)
                if cfg['checkpoint_to_disk']:
                    self.engine.save(EPISODE_START)
        except FlashRTError as exc:   # e.g. zero budgets: run on, reset uses the initial state
            self.get_logger().warning(f'no {EPISODE_START!r} capsule: {exc}; reset_episode '
                                      'will start from the initial state')
        self._state = 'active'
        return super().on_activate(state)

    def on_deactivate(self, state):
        self._state = 'inactive'
        self._release_active()
        return super().on_deactivate(state)

    def on_cleanup(self, state):
        self._release_active()
        self._release_configured()
        self._state = 'unconfigured'
        return TransitionCallbackReturn.SUCCESS

    def on_shutdown(self, state):
        self._release_active()
        self._release_configured()
        self._state = 'finalized'
        return TransitionCallbackReturn.SUCCESS

    def _release_active(self):
        if self._obs_sub is not None:
            self.destroy_subscription(self._obs_sub)
            self._obs_sub = None
        if self._status_timer is not None:
            self.destroy_timer(self._status_timer)
            self._status_timer = None

    def _release_configured(self):
        for pub in (self._action_pub, self._status_pub, self._diag_pub):
            if pub is not None:
                self.destroy_lifecycle_publisher(pub)
        self._action_pub = self._status_pub = self._diag_pub = None
        self.engine = self.config = None   # frees the arena, graphs and device capsules

    @property
    def active(self):
        return self._state == 'active'

    # -- control loop --------------------------------------------------------------------------

    def _observation_vector(self, msg):
        if isinstance(msg, Float32MultiArray):
            return np.asarray(msg.data, dtype=np.float32) \
                if len(msg.data) else np.zeros(0, np.float32)
        index = {name: i for i, name in enumerate(msg.name)}
        joints = self.config['joint_names']
        missing = [n for n in joints if n not in index]
        if missing:
            raise InvalidObservation(f'joint_state lacks joints {missing}')
        rows = [msg.position]
        if self.config['obs_dim'] == 2 * len(joints):
            rows.append(msg.velocity)
        values = []
        for row in rows:
            if len(row) != len(msg.name):
                raise InvalidObservation('joint_state position/velocity length differs from name')
            values += [row[index[n]] for n in joints]
        return np.asarray(values, dtype=np.float32)

    def observation_callback(self, msg):
        """One observation = one committed step = one published action."""
        engine = self.engine
        if not self.active or engine is None:
            return
        if self._holding:
            self._rejected += 1
            self.get_logger().error('observation refused: the state was poisoned (NaN/Inf); '
                                    'call ~/recover, ~/restore or ~/reset_episode',
                                    throttle_duration_sec=1.0)
            return
        try:
            obs = self._observation_vector(msg)
        except InvalidObservation as exc:
            self._rejected += 1
            self.get_logger().warning(f'observation refused: {exc}', throttle_duration_sec=1.0)
            return
        try:
            action = engine.step(obs)
        except FlashRTError as exc:
            if not isinstance(exc, InvalidObservation):
                self._rejected += 1       # the engine counts the InvalidObservation ones
            self.get_logger().warning(f'observation refused: {exc}', throttle_duration_sec=1.0)
            return
        if self.config['poison_check'] and self._poison(engine, action):
            return
        self._action_pub.publish(self._action_message(action))
        every = self.config['checkpoint_every']
        if every and engine.step_index % every == 0:
            self._checkpoint(engine)

    def _action_message(self, action):
        values = action.numpy()
        if self._action_pub.msg_type is JointState:
            out = JointState()
            out.header.stamp = self.get_clock().now().to_msg()
            out.name = self.config['action_joint_names']
            out.position = values.astype('float64').tolist()
            return out
        out = Float32MultiArray()
        out.data = array.array('f', values.tobytes())
        return out

    def rejected_observations(self):
        return self._rejected + self._poisoned + (
            self.engine.rejected_observations if self.engine else 0)

    # -- status and diagnostics ----------------------------------------------------------------

    def status_message(self):
        status = fmsg.PolicyStatus()
        status.header.stamp = self.get_clock().now().to_msg()
        status.state = self._state
        e = self.engine
        if e is None:
            return status
        status.policy = self.config['policy_type'] + (
            f' ({self.config["policy_file"]})' if self.config['policy_file'] else ' (seeded demo)')
        status.device = str(e.device)
        status.cuda_graph = bool(e.graph_captured)
        status.step, status.episode, status.position = e.step_index, e.episode, e.position
        status.rollback_available = e.rollback_available
        p50, p99 = e.step_latency_us()
        status.step_latency_p50_us, status.step_latency_p99_us = p50, p99
        status.capsules = len(e.store.list())
        status.device_bytes_used = e.store.device_bytes_used
        status.device_bytes_budget = e.store.device_budget
        status.host_bytes_used = e.store.host_bytes_used
        status.rejected_observations = self.rejected_observations()
        return status

    def publish_status(self):
        status = self.status_message()
        self._status_pub.publish(status)
        rejected = status.rejected_observations
        level, message = DiagnosticStatus.OK, f'{status.state}, step {status.step}'
        if rejected > self._rejected_reported:
            level = DiagnosticStatus.WARN
            message = f'{rejected - self._rejected_reported} observations refused since last ' \
                      'report (wrong length, NaN/Inf, missing joints or history full)'
        self._rejected_reported = rejected
        diag = DiagnosticStatus(level=level, name=f'flashrt_ros: {self.get_name()}',
                                message=message, hardware_id=status.device)
        for field in ('policy', 'cuda_graph', 'step', 'episode', 'position',
                      'rollback_available', 'step_latency_p50_us', 'step_latency_p99_us',
                      'capsules', 'device_bytes_used', 'device_bytes_budget', 'host_bytes_used',
                      'rejected_observations'):
            diag.values.append(KeyValue(key=field, value=str(getattr(status, field))))
        array_msg = DiagnosticArray()
        array_msg.header.stamp = status.header.stamp
        array_msg.status = [diag]
        self._diag_pub.publish(array_msg)

    # -- services ------------------------------------------------------------------------------

    def _serve(self, response, operation):
        """Runs a capsule operation; refusals become success=False with the reason."""
        if not self.active:
            response.success = False
            response.message = f'node {self.get_name()!r} is {self._state}, not active: ' \
                               'activate it before calling capsule services'
            return response
        try:
            operation()
            response.success = True
        except FlashRTError as exc:
            response.success = False
            response.message = str(exc)
        except Exception as exc:  # noqa: B902 - a service must answer, never crash the node
            self.get_logger().error(f'capsule service failed: {exc!r}')
            response.success = False
            response.message = f'internal error: {exc!r}'
        return response

    def _fill(self, response, result):
        response.message = result.message
        if hasattr(response, 'capsule'):
            response.capsule = capsule_info(result.manifest)
        if hasattr(response, 'latency_us'):
            response.latency_us = float(result.latency_us)

    def snapshot_callback(self, request, response):
        return self._serve(response, lambda: self._fill(response, self.engine.snapshot(
            request.name, overwrite=request.overwrite, pin=request.pin)))

    def restore_callback(self, request, response):
        def op():
            self._fill(response, self.engine.restore(request.name))
            self._clear_poison(self.engine)
        return self._serve(response, op)

    def fork_callback(self, request, response):
        return self._serve(response, lambda: self._fill(response, self.engine.fork(
            request.source, request.target, overwrite=request.overwrite)))

    def rollback_callback(self, request, response):
        def op():
            result = self.engine.rollback(int(request.steps))
            self._fill(response, result)
            response.step = result.step
        return self._serve(response, op)

    def list_capsules_callback(self, request, response):
        engine = self.engine
        if engine is None:
            return response       # unconfigured: no store, nothing to list
        response.capsules = [capsule_info(m) for m in engine.store.list()]
        response.device_bytes_used = engine.store.device_bytes_used
        response.device_bytes_budget = engine.store.device_budget
        response.host_bytes_used = engine.store.host_bytes_used
        response.host_bytes_budget = engine.store.host_budget
        return response

    def delete_capsule_callback(self, request, response):
        return self._serve(response, lambda: self._fill(response,
                                                        self.engine.delete(request.name)))

    def save_capsule_callback(self, request, response):
        def op():
            result = self.engine.save(request.name, request.path)
            self._fill(response, result)
            response.path = result.path
            response.nbytes = result.manifest.nbytes
        return self._serve(response, op)

    def load_capsule_callback(self, request, response):
        return self._serve(response, lambda: self._fill(response, self.engine.load(
            request.path, request.name, overwrite=request.overwrite)))

    def reset_episode_callback(self, request, response):
        def op():
            self._fill(response, self.engine.reset_episode())
            self._clear_poison(self.engine)
        return self._serve(response, op)

    def recover_callback(self, request, response):
        """Restores the newest checkpoint that passes validation (finite bytes)."""
        def op():
            response.message = self._recover(self.engine)
        return self._serve(response, op)


def main(args=None):
    rclpy.init(args=args)
    node = PolicyNode()
    # Single-threaded: steps and capsule operations run one at a time anyway (they meet at
    # the engine's lock, between steps), and rclpy's MultiThreadedExecutor (Jazzy) kept a core
    # busy spinning once services had been called: the demo took 60 s instead of 2.5 s. The
    # callback groups stay, so a user may still compose this node into a multi-threaded
    # executor; the engine's lock keeps that correct.
    executor = SingleThreadedExecutor()
    executor.add_node(node)
    if node.get_parameter('autostart').value:
        # What nav2's lifecycle manager would do: configure, then activate.
        if node.trigger_configure() != TransitionCallbackReturn.SUCCESS or \
                node.trigger_activate() != TransitionCallbackReturn.SUCCESS:
            node.get_logger().fatal('autostart failed; see the error above')
    try:
        executor.spin()
    except (KeyboardInterrupt, ExternalShutdownException):
        pass
    finally:
        node.destroy_node()
        executor.shutdown()
        if rclpy.ok():
            rclpy.try_shutdown()


if __name__ == '__main__':
    main()
