'''Real-format policy files for the tests, made by the code that defines each format.

Nothing here writes a policy file by hand. rsl_rl's own runner builds, saves, loads and exports
the actors: rsl-rl-lib 3.x and 5.x (pinned in requirements/test.txt) are installed side by side
under .venv/rsl_rl/ by tools/bootstrap.sh, and each version runs in its own subprocess
(`python test/support/policy_exports.py build VERSION DIR`), since two versions of one package
cannot share an interpreter. The only stand-ins are a one-environment VecEnv (the runner asks it
for the observation shapes; nothing is trained) and the exporters of projects that are not
installable from PyPI, copied from their source: Isaac Lab's _TorchPolicyExporter
(isaaclab_rl/rsl_rl/exporter.py, the GRU-aware version) and legged_gym's PolicyExporterLSTM
(legged_gym/utils/helpers.py).

The pipeline is the user's: a runner is built and its normalizer fed (as training does), saved
with runner.save() (the checkpoint), then a second runner loads that file, as Isaac Lab's
play.py does, and exports it (the TorchScript file). build_all() returns, per format, the file
and the facts a test needs, with reference(observations) -> actions that runs the file itself:
TorchScript with torch.jit.load, its memory reset first, one [1, obs_dim] call per step under
torch.no_grad(); checkpoints through rsl_rl's inference policy after runner.load().
'''

import copy
import json
import os
import pathlib
import subprocess
import sys
import warnings

import numpy as np
import torch

ROOT = pathlib.Path(__file__).resolve().parents[2]
RSL_RL_DIR = ROOT / '.venv' / 'rsl_rl'
REQUIREMENTS = ROOT / 'requirements' / 'test.txt'
G1_FILE = ROOT.parent / 'shared' / 'robots' / 'unitree_g1' / 'motion.pt'
N_STEPS = 200       # observations per reference run


class Export:
    '''One policy file and what a test needs to know about it.'''

    def __init__(self, name, path, obs_dim, act_dim, kind, activation, states_activation,
                 source, reference, **facts):
        self.name, self.path = name, str(path)
        self.obs_dim, self.act_dim = int(obs_dim), int(act_dim)
        self.kind = kind                            # 'mlp' | 'recurrent'
        self.activation = activation                # the name rsl_rl's resolve_nn_activation takes
        self.states_activation = states_activation  # TorchScript does, state_dicts do not
        self.source = source
        self.facts = facts                          # rnn_type, rnn_layers, normalizer, format
        self._run, self._cache = reference, {}

    def reference(self, observations):
        '''Actions [T, act_dim] of the file itself for observations [T, obs_dim] (from a fresh
        state). Remembered per observation sequence: a fresh TorchScript LSTM pays seconds of
        JIT optimisation on its second call, and tests ask for the same run more than once.'''
        obs = np.ascontiguousarray(observations, dtype=np.float32)
        key = (obs.shape, obs.tobytes())
        if key not in self._cache:
            self._cache[key] = self._run(obs)
        return self._cache[key].clone()

    def __repr__(self):
        return f'Export({self.name!r}, {self.path!r})'


def observations(obs_dim, n=N_STEPS, seed=0):
    '''Seeded float32 observations [n, obs_dim] of the scale real robots feed (O(1)).'''
    return np.random.default_rng(seed).normal(0.0, 1.0, (n, obs_dim)).astype(np.float32)


def pinned_versions():
    '''rsl-rl-lib versions pinned in requirements/test.txt, in file order.'''
    pins = [line.split('==', 1)[1].strip() for line in REQUIREMENTS.read_text().splitlines()
            if line.startswith('rsl-rl-lib==')]
    if not pins:
        raise RuntimeError(f'{REQUIREMENTS} pins no rsl-rl-lib version')
    return pins


def format_names():
    '''Every format build_all() makes (plus the Unitree G1 file), known before building so
    tests can be parametrized at collection.'''
    names = []
    for version in pinned_versions():
        tag = f'rsl{_major(version)}'
        for arch in ARCHITECTURES:
            names += [f'{tag}_jit_{arch[0]}', f'{tag}_ckpt_{arch[0]}']
            if arch[0] == PLAIN_STATE_DICT:
                names.append(f'{tag}_state_dict_{arch[0]}')
        if _major(version) < 4:
            names += ['legged_gym_lstm_elu', 'legged_gym_mlp_elu']
    return names + ['unitree_g1_motion']


def missing_reason():
    '''Why the fixtures cannot be built here, or '' when they can.'''
    for version in pinned_versions():
        if not (RSL_RL_DIR / version / 'rsl_rl').is_dir():
            return (f'rsl-rl-lib {version} is not installed in {RSL_RL_DIR / version}: '
                    'run tools/bootstrap.sh (it installs requirements/test.txt)')
    if not (RSL_RL_DIR / 'deps').is_dir():
        return f'{RSL_RL_DIR / "deps"} is missing: run tools/bootstrap.sh'
    return ''


# ---------------------------------------------------------------- running a file as users do

def run_torchscript(path, obs):
    '''Actions [T, act_dim] from the TorchScript file itself, as a deploy script runs it.

    Loaded fresh; its own reset method, where it has one, zeroes its memory first (legged_gym
    names it reset_memory, rsl_rl >= 4 reset; Isaac Lab's recurrent files and bare scripted
    actors have none, and load with zeros); each observation goes in as a [1, obs_dim] batch
    under torch.no_grad(), as Isaac Lab's and Unitree's deploy scripts feed it.
    '''
    with warnings.catch_warnings():
        # the exporters still write TorchScript; torch's deprecation notice is noise here
        warnings.simplefilter('ignore', DeprecationWarning)
        module = torch.jit.load(str(path), map_location='cpu')
    module.eval()
    for name in ('reset_memory', 'reset'):
        if hasattr(module, name):
            getattr(module, name)()
            break
    out = []
    with torch.no_grad():
        for row in np.asarray(obs, dtype=np.float32):
            out.append(module(torch.from_numpy(row).unsqueeze(0)).reshape(-1).clone())
    return torch.stack(out)


def _subprocess_env(version):
    # this version's rsl_rl and the shared deps first; nothing else changes
    env = dict(os.environ)
    paths = [str(RSL_RL_DIR / version), str(RSL_RL_DIR / 'deps')]
    env['PYTHONPATH'] = os.pathsep.join(paths + [p for p in [env.get('PYTHONPATH')] if p])
    env['PYTHONWARNINGS'] = 'ignore'
    return env


def _checkpoint_reference(version, spec, cached):
    # rsl_rl's inference policy on the loaded checkpoint; the builder already ran it on the
    # standard observations, so only other observations cost a subprocess
    def reference(obs):
        obs = np.asarray(obs, dtype=np.float32)
        std = observations(spec['obs_dim'])
        if obs.shape == std.shape and np.array_equal(obs, std):
            return torch.from_numpy(np.load(cached))
        work = pathlib.Path(spec['file']).with_suffix('.query')
        work.mkdir(exist_ok=True)
        np.save(work / 'obs.npy', obs)
        (work / 'spec.json').write_text(json.dumps(spec))
        done = subprocess.run([sys.executable, __file__, 'reference', version, str(work)],
                              env=_subprocess_env(version), capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f'rsl_rl {version} reference run failed:\n{done.stdout}'
                               f'{done.stderr}')
        return torch.from_numpy(np.load(work / 'actions.npy'))
    return reference


def build_all(out_dir):
    '''Every format, {name: Export}. Both rsl_rl versions build at once in subprocesses; the
    Unitree G1 file is added when ../shared has it (see G1_FILE).'''
    out_dir = pathlib.Path(out_dir)
    reason = missing_reason()
    if reason:
        raise RuntimeError(reason)
    procs = []
    for version in pinned_versions():
        target = out_dir / f'rsl_rl_{version}'
        target.mkdir(parents=True, exist_ok=True)
        command = [sys.executable, __file__, 'build', version, str(target)]
        procs.append((version, target, subprocess.Popen(
            command, env=_subprocess_env(version), stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True)))
    exports = {}
    for version, target, proc in procs:
        log, _ = proc.communicate()
        if proc.returncode != 0:
            raise RuntimeError(f'building the rsl_rl {version} fixtures failed:\n{log}')
        for spec in json.loads((target / 'manifest.json').read_text()):
            exports[spec['name']] = _export_from_spec(version, spec)
    if G1_FILE.is_file():
        exports['unitree_g1_motion'] = g1_export()
    return exports


def _export_from_spec(version, spec):
    if spec['format'] == 'torchscript':
        def reference(obs):
            return run_torchscript(spec['file'], obs)
    else:
        reference = _checkpoint_reference(version, spec, spec['reference'])
    facts = {k: spec[k] for k in ('rnn_type', 'rnn_layers', 'normalizer', 'format')}
    return Export(spec['name'], spec['file'], spec['obs_dim'], spec['act_dim'], spec['kind'],
                  spec['activation'], spec['format'] == 'torchscript', spec['source'],
                  reference, **facts)


def g1_export():
    '''Unitree's shipped G1 policy (legged_gym PolicyExporterLSTM: 47 obs, 12 actions).'''
    def reference(obs):
        return run_torchscript(G1_FILE, obs)
    return Export('unitree_g1_motion', G1_FILE, 47, 12, 'recurrent', 'elu', True,
                  'Unitree unitree_rl_gym deploy/pre_train/g1/motion.pt (legged_gym export)',
                  reference, rnn_type='lstm', rnn_layers=1, normalizer=False,
                  format='torchscript')


# ---------------------------------------------------------------- the subprocess side
# Everything below runs with one rsl_rl version on sys.path (see _subprocess_env).

# (name, kind, activation, normalizer, rnn_type, rnn_layers, obs_dim, act_dim, hidden dims)
ARCHITECTURES = [
    ('mlp_elu', 'mlp', 'elu', False, '', 0, 48, 12, [64, 32]),
    ('mlp_tanh_norm', 'mlp', 'tanh', True, '', 0, 33, 8, [64, 64, 32]),
    ('lstm_elu_norm', 'recurrent', 'elu', True, 'lstm', 1, 47, 12, [32]),
    ('lstm_tanh', 'recurrent', 'tanh', False, 'lstm', 2, 24, 6, [32, 32]),
    ('gru_elu', 'recurrent', 'elu', False, 'gru', 1, 17, 4, [32]),
    ('gru_tanh_norm', 'recurrent', 'tanh', True, 'gru', 2, 40, 10, [48, 32]),
]
RNN_HIDDEN = 64
PLAIN_STATE_DICT = 'mlp_tanh_norm'     # the architecture also saved as a plain state_dict
PPO = dict(class_name='PPO', value_loss_coef=1.0, use_clipped_value_loss=True, clip_param=0.2,
           entropy_coef=0.005, num_learning_epochs=5, num_mini_batches=4, learning_rate=1.0e-3,
           schedule='adaptive', gamma=0.99, lam=0.95, desired_kl=0.01, max_grad_norm=1.0,
           normalize_advantage_per_mini_batch=False, rnd_cfg=None, symmetry_cfg=None)


def _major(version):
    return int(version.split('.')[0])


def _train_cfg(version, arch):
    # the dict Isaac Lab's RslRlOnPolicyRunnerCfg.to_dict() hands the runner, for this version
    _, kind, act, norm, rnn_type, layers, _, _, hidden = arch
    cfg = dict(seed=42, device='cpu', num_steps_per_env=24, max_iterations=1, save_interval=50,
               experiment_name='fixture', logger='tensorboard', clip_actions=None,
               algorithm=dict(PPO))
    rnn = dict(rnn_type=rnn_type, rnn_hidden_dim=RNN_HIDDEN, rnn_num_layers=layers)
    if _major(version) < 4:
        cfg['obs_groups'] = {'policy': ['policy'], 'critic': ['policy']}
        cfg['policy'] = dict(
            class_name='ActorCriticRecurrent' if kind == 'recurrent' else 'ActorCritic',
            init_noise_std=1.0, noise_std_type='scalar', actor_obs_normalization=norm,
            critic_obs_normalization=norm, actor_hidden_dims=list(hidden),
            critic_hidden_dims=list(hidden), activation=act,
            **(rnn if kind == 'recurrent' else {}))
    else:
        cfg['obs_groups'] = {'actor': ['policy'], 'critic': ['policy']}
        cfg['algorithm']['optimizer'] = 'adam'
        model = dict(class_name='RNNModel' if kind == 'recurrent' else 'MLPModel',
                     hidden_dims=list(hidden), activation=act, obs_normalization=norm,
                     **(rnn if kind == 'recurrent' else {}))
        cfg['actor'] = dict(model, distribution_cfg=dict(
            class_name='GaussianDistribution', init_std=1.0, std_type='scalar'))
        cfg['critic'] = dict(model)
    return cfg


def _make_runner(version, arch, cfg, seed):
    from rsl_rl.env import VecEnv
    from rsl_rl.runners import OnPolicyRunner
    from tensordict import TensorDict

    class OneEnv(VecEnv):
        # the runner reads the observation groups and sizes from an environment; no step
        # is ever taken, so nothing else is needed
        def __init__(self, obs_dim, act_dim):
            self.num_envs, self.num_actions, self.max_episode_length = 1, act_dim, 1000
            self.episode_length_buf = torch.zeros(1, dtype=torch.long)
            self.device, self.cfg = 'cpu', {}
            self._obs = TensorDict({'policy': torch.zeros(1, obs_dim)}, batch_size=[1])

        def get_observations(self):
            return self._obs

        def step(self, actions):
            raise NotImplementedError('the fixtures never train')

    torch.manual_seed(seed)
    return OnPolicyRunner(OneEnv(arch[6], arch[7]), copy.deepcopy(cfg), log_dir=None,
                          device='cpu')


def _policy(version, runner):
    # the module that holds the actor: ActorCritic(Recurrent) in 3.x, the actor model in 5.x
    return runner.alg.policy if _major(version) < 4 else runner.alg.actor


def _feed_normalizer(version, runner, obs_dim, seed):
    # what training does to EmpiricalNormalization: update() on batches of observations, here
    # with per-dimension means and spreads far from (0, 1) so the normalizer matters
    from tensordict import TensorDict
    g = torch.Generator().manual_seed(seed)
    mean = torch.rand(obs_dim, generator=g) * 4 - 2
    spread = torch.rand(obs_dim, generator=g) * 3 + 0.2
    policy = _policy(version, runner)
    policy.train()
    for _ in range(3):
        batch = torch.randn(256, obs_dim, generator=g) * spread + mean
        policy.update_normalization(TensorDict({'policy': batch}, batch_size=[256]))


def _inference_actions(version, runner, obs):
    # the play script's loop: get_inference_policy(), reset, one batched call per step
    from tensordict import TensorDict
    policy = runner.get_inference_policy(device='cpu')
    _policy(version, runner).reset()
    out = []
    with torch.inference_mode():
        for row in torch.from_numpy(np.asarray(obs, dtype=np.float32)):
            actions = policy(TensorDict({'policy': row.unsqueeze(0)}, batch_size=[1]))
            out.append(actions.reshape(-1).clone())
    return torch.stack(out).numpy()


def _load_into(version, runner, spec):
    if spec['format'] == 'checkpoint':
        runner.load(spec['file'])
    else:   # plain state_dict of the policy module
        _policy(version, runner).load_state_dict(torch.load(spec['file'], map_location='cpu'))


class _TorchPolicyExporter(torch.nn.Module):
    '''Isaac Lab's _TorchPolicyExporter (isaaclab_rl/rsl_rl/exporter.py), copied unchanged in
    behaviour: Isaac Lab is not installable from PyPI. Its play.py uses it for rsl-rl < 4.'''

    def __init__(self, policy, normalizer=None):
        super().__init__()
        self.is_recurrent = policy.is_recurrent
        # copy policy parameters
        if hasattr(policy, 'actor'):
            self.actor = copy.deepcopy(policy.actor)
            if self.is_recurrent:
                self.rnn = copy.deepcopy(policy.memory_a.rnn)
        elif hasattr(policy, 'student'):
            self.actor = copy.deepcopy(policy.student)
            if self.is_recurrent:
                self.rnn = copy.deepcopy(policy.memory_s.rnn)
        else:
            raise ValueError('Policy does not have an actor/student module.')
        # set up recurrent network
        if self.is_recurrent:
            self.rnn.cpu()
            self.rnn_type = type(self.rnn).__name__.lower()  # 'lstm' or 'gru'
            self.register_buffer('hidden_state',
                                 torch.zeros(self.rnn.num_layers, 1, self.rnn.hidden_size))
            if self.rnn_type == 'lstm':
                self.register_buffer('cell_state',
                                     torch.zeros(self.rnn.num_layers, 1, self.rnn.hidden_size))
                self.forward = self.forward_lstm
                self.reset = self.reset_memory
            elif self.rnn_type == 'gru':
                self.forward = self.forward_gru
                self.reset = self.reset_memory
            else:
                raise NotImplementedError(f'Unsupported RNN type: {self.rnn_type}')
        # copy normalizer if exists
        if normalizer:
            self.normalizer = copy.deepcopy(normalizer)
        else:
            self.normalizer = torch.nn.Identity()

    def forward_lstm(self, x):
        x = self.normalizer(x)
        x, (h, c) = self.rnn(x.unsqueeze(0), (self.hidden_state, self.cell_state))
        self.hidden_state[:] = h
        self.cell_state[:] = c
        x = x.squeeze(0)
        return self.actor(x)

    def forward_gru(self, x):
        x = self.normalizer(x)
        x, h = self.rnn(x.unsqueeze(0), self.hidden_state)
        self.hidden_state[:] = h
        x = x.squeeze(0)
        return self.actor(x)

    def forward(self, x):
        return self.actor(self.normalizer(x))

    @torch.jit.export
    def reset(self):
        pass

    def reset_memory(self):
        self.hidden_state[:] = 0.0
        if hasattr(self, 'cell_state'):
            self.cell_state[:] = 0.0

    def export(self, path, filename):
        os.makedirs(path, exist_ok=True)
        path = os.path.join(path, filename)
        self.to('cpu')
        traced_script_module = torch.jit.script(self)
        traced_script_module.save(path)


class PolicyExporterLSTM(torch.nn.Module):
    '''legged_gym's PolicyExporterLSTM (legged_gym/utils/helpers.py), as Unitree's
    unitree_rl_gym ships it: legged_gym is not installable from PyPI.'''

    def __init__(self, actor_critic):
        super().__init__()
        self.actor = copy.deepcopy(actor_critic.actor)
        self.is_recurrent = actor_critic.is_recurrent
        self.memory = copy.deepcopy(actor_critic.memory_a.rnn)
        self.memory.cpu()
        self.register_buffer('hidden_state',
                             torch.zeros(self.memory.num_layers, 1, self.memory.hidden_size))
        self.register_buffer('cell_state',
                             torch.zeros(self.memory.num_layers, 1, self.memory.hidden_size))

    def forward(self, x):
        out, (h, c) = self.memory(x.unsqueeze(0), (self.hidden_state, self.cell_state))
        self.hidden_state[:] = h
        self.cell_state[:] = c
        return self.actor(out.squeeze(0))

    @torch.jit.export
    def reset_memory(self):
        self.hidden_state[:] = 0.
        self.cell_state[:] = 0.

    def export(self, path):
        os.makedirs(path, exist_ok=True)
        path = os.path.join(path, 'policy_lstm_1.pt')
        self.to('cpu')
        traced_script_module = torch.jit.script(self)
        traced_script_module.save(path)


def _spec(name, path, arch, fmt, source, **extra):
    _, kind, act, norm, rnn_type, layers, obs_dim, act_dim, _ = arch
    return dict(name=name, file=str(path), obs_dim=obs_dim, act_dim=act_dim, kind=kind,
                activation=act, normalizer=norm, rnn_type=rnn_type or None,
                rnn_layers=layers or None, format=fmt, source=source, **extra)


def _build_rsl_rl(version, out):
    '''Per architecture: checkpoint (runner.save), its TorchScript export (Isaac Lab's exporter
    for 3.x, runner.export_policy_to_jit for >= 4), and for one architecture a plain
    state_dict of the policy module.'''
    tag = f'rsl{_major(version)}'
    base = 1000 * _major(version)       # other weights per version, reproducible per format
    specs = []
    for i, arch in enumerate(ARCHITECTURES):
        name, obs_dim = arch[0], arch[6]
        cfg = _train_cfg(version, arch)
        trained = _make_runner(version, arch, cfg, seed=base + 100 + i)
        _feed_normalizer(version, trained, obs_dim, seed=base + 200 + i)
        ckpt = out / f'{tag}_ckpt_{name}' / 'model_0.pt'
        ckpt.parent.mkdir(parents=True, exist_ok=True)
        trained.save(str(ckpt))
        # play: a fresh runner (other initial weights) loads the checkpoint and exports it
        played = _make_runner(version, arch, cfg, seed=base + 300 + i)
        played.load(str(ckpt))
        played.get_inference_policy(device='cpu')
        export_dir = out / f'{tag}_jit_{name}' / 'exported'
        if _major(version) < 4:
            source = f'rsl_rl {version} + Isaac Lab _TorchPolicyExporter (play.py)'
            policy_nn = played.alg.policy
            normalizer = getattr(policy_nn, 'actor_obs_normalizer', None)
            _TorchPolicyExporter(policy_nn, normalizer).export(str(export_dir), 'policy.pt')
        else:
            source = f'rsl_rl {version} OnPolicyRunner.export_policy_to_jit'
            played.export_policy_to_jit(path=str(export_dir), filename='policy.pt')
        specs.append(_spec(f'{tag}_jit_{name}', export_dir / 'policy.pt', arch, 'torchscript',
                           source))
        ck = _spec(f'{tag}_ckpt_{name}', ckpt, arch, 'checkpoint',
                   f'rsl_rl {version} OnPolicyRunner.save', version=version, cfg=cfg)
        specs.append(ck)
        if name == PLAIN_STATE_DICT:
            plain = out / f'{tag}_state_dict_{name}' / 'policy_state_dict.pt'
            plain.parent.mkdir(parents=True, exist_ok=True)
            torch.save(_policy(version, played).state_dict(), plain)
            specs.append(_spec(f'{tag}_state_dict_{name}', plain, arch, 'state_dict',
                               f'rsl_rl {version} policy module .state_dict()', version=version,
                               cfg=cfg))
    for spec in specs:
        if spec['format'] != 'torchscript':
            arch = next(a for a in ARCHITECTURES if spec['name'].endswith('_' + a[0]))
            runner = _make_runner(version, arch, spec['cfg'], seed=400)
            _load_into(version, runner, spec)
            spec['reference'] = str(pathlib.Path(spec['file']).with_suffix('.reference.npy'))
            np.save(spec['reference'], _inference_actions(version, runner,
                                                          observations(spec['obs_dim'])))
    return specs


def _build_legged_gym(version, out):
    '''legged_gym's two exports of an rsl_rl actor-critic (export_policy_as_jit): the LSTM
    policy through PolicyExporterLSTM (policy_lstm_1.pt), a feed-forward one as the bare
    scripted actor (policy_1.pt). legged_gym pins rsl_rl 1.0.2, whose actor is a plain
    nn.Sequential (as in Unitree's G1 file); rsl_rl 3.x's MLP is a Sequential subclass with
    the same children, so it is re-wrapped to give legged_gym's module tree.'''
    from rsl_rl.modules import ActorCritic, ActorCriticRecurrent
    from tensordict import TensorDict
    obs_dim, act_dim = 45, 12
    obs = TensorDict({'policy': torch.zeros(1, obs_dim)}, batch_size=[1])
    groups = {'policy': ['policy'], 'critic': ['policy']}
    specs = []
    torch.manual_seed(500)
    rec = ActorCriticRecurrent(obs, groups, act_dim, actor_hidden_dims=[32],
                               critic_hidden_dims=[32], activation='elu', rnn_type='lstm',
                               rnn_hidden_dim=RNN_HIDDEN, rnn_num_layers=1)
    rec.actor = torch.nn.Sequential(*rec.actor)
    PolicyExporterLSTM(rec).export(str(out / 'legged_gym_lstm'))
    arch = ('', 'recurrent', 'elu', False, 'lstm', 1, obs_dim, act_dim, None)
    specs.append(_spec('legged_gym_lstm_elu', out / 'legged_gym_lstm' / 'policy_lstm_1.pt',
                       arch, 'torchscript', 'legged_gym PolicyExporterLSTM around rsl_rl '
                       f'{version} ActorCriticRecurrent'))
    torch.manual_seed(501)
    mlp = ActorCritic(obs, groups, act_dim, actor_hidden_dims=[64, 32],
                      critic_hidden_dims=[64, 32], activation='elu')
    mlp.actor = torch.nn.Sequential(*mlp.actor)
    (out / 'legged_gym_mlp').mkdir(parents=True, exist_ok=True)
    path = out / 'legged_gym_mlp' / 'policy_1.pt'
    torch.jit.script(copy.deepcopy(mlp.actor).to('cpu')).save(str(path))
    arch = ('', 'mlp', 'elu', False, '', 0, obs_dim, act_dim, None)
    specs.append(_spec('legged_gym_mlp_elu', path, arch, 'torchscript',
                       f'legged_gym export_policy_as_jit (bare actor) of rsl_rl {version} '
                       'ActorCritic'))
    return specs


def _main(argv):
    command, version, work = argv[0], argv[1], pathlib.Path(argv[2])
    import rsl_rl
    where = pathlib.Path(rsl_rl.__file__).resolve()
    if RSL_RL_DIR / version not in where.parents:
        raise SystemExit(f'imported rsl_rl from {where}, not {RSL_RL_DIR / version}')
    torch.set_num_threads(1)    # many tiny models: threads only add overhead
    if command == 'build':
        specs = _build_rsl_rl(version, work)
        if _major(version) < 4:
            specs += _build_legged_gym(version, work)
        (work / 'manifest.json').write_text(json.dumps(specs, indent=1))
    elif command == 'reference':
        spec = json.loads((work / 'spec.json').read_text())
        arch = next(a for a in ARCHITECTURES if spec['name'].endswith('_' + a[0]))
        runner = _make_runner(version, arch, spec['cfg'], seed=400)
        _load_into(version, runner, spec)
        np.save(work / 'actions.npy', _inference_actions(version, runner,
                                                         np.load(work / 'obs.npy')))
    else:
        raise SystemExit(f'unknown command {command!r}; build or reference')


if __name__ == '__main__':
    _main(sys.argv[1:])
