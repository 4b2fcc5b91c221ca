'''ONNX policy files as Isaac Lab writes them (policy.onnx beside policy.pt), converted by
onnx2pytorch and run by the engine.

The files are made here by torch's ONNX exporter through a module built like Isaac Lab's
`_OnnxPolicyExporter` (isaaclab_rl/rsl_rl/exporter.py): the same submodules, forward
signatures, input/output names and export arguments. Two exporters write them: torch's
default since 2.9 (dynamo; what Isaac Lab's call gives on today's torch, opset 18) and the
TorchScript-based one at opset 11 (what Isaac Lab wrote on torch <= 2.8, e.g. with Isaac Sim
4.5 / 5.0). Each file runs 200 seeded observations through the engine, compared with
onnxruntime running the file itself (feeding back its own h/c) and with the exporter module
in torch; a capsule taken at step 100 replays steps 100-149 bit for bit.
'''

import copy
import importlib.util
import pathlib
import time
import warnings

import numpy as np
import pytest
import torch
import torch.nn as nn

from flashrt_ros.runtime.engine import PolicyEngine
from flashrt_ros.runtime.errors import InvalidConfig
from flashrt_ros.runtime.policies import make_policy

OBS, ACT, STEPS, SNAP, REPLAY = 48, 12, 200, 100, 50
EXPORTERS = {'dynamo18': (True, 18), 'legacy11': (False, 11)}
# name -> (rnn type, rnn layers, actor activation, normalizer)
CASES = {
    'mlp_elu_norm': ('', 0, nn.ELU, True),
    'mlp_tanh': ('', 0, nn.Tanh, False),
    'lstm_elu_norm': ('lstm', 2, nn.ELU, True),
    'lstm_elu': ('lstm', 1, nn.ELU, False),
    'gru_elu_norm': ('gru', 1, nn.ELU, True),
    'gru_tanh': ('gru', 2, nn.Tanh, False),
}


def _missing(*names):
    return [n for n in names if importlib.util.find_spec(n) is None]


def need(*names):
    '''Skip, naming the packages and where they are pinned, when any is not installed.'''
    missing = _missing(*names)
    if missing:
        pytest.skip(f'needs {", ".join(missing)} (pip install --no-deps -r '
                    'requirements/onnx.txt)')


# ---------------------------------------------------------------- Isaac Lab's exporter

class EmpiricalNormalization(nn.Module):
    '''rsl_rl's observation normalizer as exported (eval): (x - _mean) / (_std + eps).'''

    def __init__(self, n, gen):
        super().__init__()
        self.eps = 1e-2
        self.register_buffer('_mean', torch.randn(1, n, generator=gen))
        self.register_buffer('_var', torch.rand(1, n, generator=gen) * 4 + 0.1)
        self.register_buffer('_std', torch.sqrt(self._var))

    def forward(self, x):
        return (x - self._mean) / (self._std + self.eps)


class IsaacLabOnnxExporter(nn.Module):
    '''Built like isaaclab_rl.rsl_rl.exporter._OnnxPolicyExporter: copies of the policy's
    `actor` and `memory_a.rnn`, the normalizer or Identity; MLP forward(obs) -> actions,
    forward_lstm(obs, h_in, c_in) -> (actions, h, c), forward_gru(obs, h_in) -> (actions, h).'''

    def __init__(self, policy, normalizer=None):
        super().__init__()
        self.is_recurrent = policy.is_recurrent
        self.actor = copy.deepcopy(policy.actor)
        if self.is_recurrent:
            self.rnn = copy.deepcopy(policy.memory_a.rnn)
            self.rnn.cpu()
            self.rnn_type = type(self.rnn).__name__.lower()
            self.forward = self.forward_lstm if self.rnn_type == 'lstm' else self.forward_gru
        self.normalizer = copy.deepcopy(normalizer) if normalizer else nn.Identity()

    def forward_lstm(self, x_in, h_in, c_in):
        x_in = self.normalizer(x_in)
        x, (h, c) = self.rnn(x_in.unsqueeze(0), (h_in, c_in))
        return self.actor(x.squeeze(0)), h, c

    def forward_gru(self, x_in, h_in):
        x_in = self.normalizer(x_in)
        x, h = self.rnn(x_in.unsqueeze(0), h_in)
        return self.actor(x.squeeze(0)), h

    def forward(self, x):
        return self.actor(self.normalizer(x))

    def export(self, path, opset, dynamo):
        self.to('cpu')
        self.eval()
        if self.is_recurrent:
            obs = torch.zeros(1, self.rnn.input_size)
            h_in = torch.zeros(self.rnn.num_layers, 1, self.rnn.hidden_size)
            if self.rnn_type == 'lstm':
                args, names = (obs, h_in, h_in.clone()), (['obs', 'h_in', 'c_in'],
                                                          ['actions', 'h_out', 'c_out'])
            else:
                args, names = (obs, h_in), (['obs', 'h_in'], ['actions', 'h_out'])
        else:
            args, names = (torch.zeros(1, self.actor[0].in_features),), (['obs'], ['actions'])
        # Isaac Lab passes no `dynamo`: torch >= 2.9 then uses its dynamo exporter
        extra = {} if dynamo else {'dynamo': False}
        with warnings.catch_warnings():
            warnings.simplefilter('ignore')     # exporter chatter (deprecations, opset notes)
            torch.onnx.export(self, args, str(path), export_params=True, opset_version=opset,
                              verbose=False, input_names=names[0], output_names=names[1],
                              dynamic_axes={}, **extra)


def _policy(case, seed):
    '''A trained-looking rsl_rl ActorCritic[Recurrent] stand-in: what the exporter reads.'''
    rnn_type, layers, act, normalize = CASES[case]
    gen = torch.Generator().manual_seed(seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        rnn = None
        if rnn_type:
            rnn = (nn.LSTM if rnn_type == 'lstm' else nn.GRU)(OBS, 64, layers)
        dims = [64 if rnn_type else OBS, 128, 64, 32]
        layers_ = []
        for a, b in zip(dims[:-1], dims[1:]):
            layers_ += [nn.Linear(a, b), act()]
        actor = nn.Sequential(*layers_, nn.Linear(dims[-1], ACT))
    policy = nn.Module()
    policy.actor, policy.is_recurrent = actor, bool(rnn_type)
    if rnn is not None:
        policy.memory_a = nn.Module()
        policy.memory_a.rnn = rnn
    normalizer = EmpiricalNormalization(OBS, gen) if normalize else None
    return IsaacLabOnnxExporter(policy, normalizer).eval().requires_grad_(False)


_FILES = {}


@pytest.fixture(scope='module')
def files(tmp_path_factory):
    '''(case, exporter) -> (path, exporter module), exported once per test module.'''
    folder = tmp_path_factory.mktemp('onnx')

    def get(case, exporter='dynamo18'):
        dynamo, opset = EXPORTERS[exporter]
        need('onnx', 'onnx2pytorch', *(['onnxscript'] if dynamo else []))
        key = (case, exporter)
        if key not in _FILES:
            module = _policy(case, seed=sorted(CASES).index(case))
            path = folder / f'{case}_{exporter}.onnx'
            start = time.perf_counter()
            module.export(path, opset, dynamo)
            print(f'\nexported {path.name} in {time.perf_counter() - start:.2f} s')
            _FILES[key] = (path, module)
        return _FILES[key]
    return get


def _kind(case):
    return 'recurrent' if CASES[case][0] else 'mlp'


def _observations(case):
    return np.random.default_rng(1000 + sorted(CASES).index(case)).standard_normal(
        (STEPS, OBS)).astype(np.float32)


def _run_onnxruntime(path, observations):
    import onnxruntime as ort
    session = ort.InferenceSession(str(path), providers=['CPUExecutionProvider'])
    inputs = session.get_inputs()
    state = [np.zeros(i.shape, np.float32) for i in inputs[1:]]
    actions = []
    for obs in observations:
        out = session.run(None, dict(zip([i.name for i in inputs], [obs[None], *state])))
        actions.append(out[0].reshape(-1))
        state = out[1:]
    return np.stack(actions)


def _bound(reference):
    '''The largest per-step difference from `reference` [T, act] that onnx.py allows a
    correct conversion: CONVERSION_TOL * max(1, the step's largest |action|), as [T, 1].'''
    from flashrt_ros.runtime.policies.onnx import conversion_bound
    return np.array([[conversion_bound(row)] for row in reference])


@torch.no_grad()
def _run_torch(module, observations):
    state = []
    if module.is_recurrent:
        state = [torch.zeros(module.rnn.num_layers, 1, module.rnn.hidden_size)
                 for _ in range(2 if module.rnn_type == 'lstm' else 1)]
    actions = []
    for obs in observations:
        out = module(torch.from_numpy(obs[None]), *state)
        if isinstance(out, tuple):
            out, state = out[0], list(out[1:])
        actions.append(out.reshape(-1).numpy())
    return np.stack(actions)


# ---------------------------------------------------------------- the formats

@pytest.mark.parametrize('exporter', sorted(EXPORTERS))
@pytest.mark.parametrize('case', list(CASES))
def test_isaac_lab_onnx_through_the_engine(files, tmp_path, case, exporter):
    need('onnxruntime')
    path, module = files(case, exporter)
    start = time.perf_counter()
    policy = make_policy(_kind(case), OBS, ACT, file=str(path))
    load_s = time.perf_counter() - start
    engine = PolicyEngine(policy, device='cpu', capsule_dir=str(tmp_path))
    observations = _observations(case)
    actions = []
    start = time.perf_counter()
    for k, obs in enumerate(observations):
        if k == SNAP:
            assert engine.snapshot('s').manifest.step == SNAP
        actions.append(engine.step(obs).numpy())
    step_us = (time.perf_counter() - start) / STEPS * 1e6
    actions = np.stack(actions)

    ort_actions = _run_onnxruntime(path, observations)
    ort_diff = float(np.abs(actions - ort_actions).max())
    torch_actions = _run_torch(module, observations)
    torch_diff = float(np.abs(actions - torch_actions).max())
    bitwise = np.array_equal(actions, torch_actions)
    print(f'\n{case} [{exporter}, opset {policy.opset}]: max |engine - onnxruntime| '
          f'{ort_diff:.3g}; vs the exporter module in torch: max {torch_diff:.3g}, '
          f'bit-identical {bitwise}; load {load_s:.2f} s, {step_us:.0f} us/step')
    # onnxruntime's kernels round differently: the bound onnx.py states (a wrong conversion
    # is ~1e-1 off)
    assert np.all(np.abs(actions - ort_actions) <= _bound(ort_actions))
    # the conversion runs the same torch kernels as the module that was exported
    assert bitwise, f'engine vs torch module: max abs diff {torch_diff}'

    # the capsule at step 100 holds everything that decides the next action
    assert engine.restore('s').step == SNAP
    replay = np.stack([engine.step(obs).numpy() for obs in observations[SNAP:SNAP + REPLAY]])
    assert np.array_equal(replay, actions[SNAP:SNAP + REPLAY])
    # and a new episode starts from the file's initial state (zeros) again
    engine.reset_episode()
    again = np.stack([engine.step(obs).numpy() for obs in observations[:REPLAY]])
    assert np.array_equal(again, actions[:REPLAY])


def test_state_lives_in_the_arena(files):
    path, module = files('lstm_elu_norm')
    policy = make_policy('recurrent', OBS, ACT, file=str(path))
    specs = {s.name: s for s in policy.state_specs()}
    assert sorted(specs) == ['c_in', 'h_in', 'rng']
    for name in ('h_in', 'c_in'):
        assert specs[name].kind == 'recurrent'
        assert specs[name].shape == (2, 1, 64)
    gru = make_policy('recurrent', OBS, ACT, file=str(files('gru_elu_norm')[0]))
    assert [s.name for s in gru.state_specs()] == ['h_in', 'rng']
    mlp = make_policy('mlp', OBS, ACT, file=str(files('mlp_elu_norm')[0]))
    assert [s.name for s in mlp.state_specs()] == ['rng']
    assert policy.config()['format'] == 'onnx' and policy.activation == 'elu'


def test_digest_covers_the_graph(files, tmp_path):
    import onnx
    from onnx import numpy_helper
    path, _ = files('mlp_elu_norm')
    first = make_policy('mlp', OBS, ACT, file=str(path)).model_digest()
    assert make_policy('mlp', OBS, ACT, file=str(path)).model_digest() == first
    model = onnx.load(str(path))
    weight = max(model.graph.initializer, key=lambda t: int(np.prod(t.dims)))
    array = numpy_helper.to_array(weight).copy()
    array.flat[0] = np.nextafter(array.flat[0], np.float32(np.inf))     # one ulp, one weight
    weight.CopyFrom(numpy_helper.from_array(array, weight.name))
    changed = tmp_path / 'changed.onnx'
    onnx.save(model, str(changed))
    assert make_policy('mlp', OBS, ACT, file=str(changed)).model_digest() != first


# ---------------------------------------------------------------- the stated bound

G1_VELOCITY = (pathlib.Path(__file__).resolve().parents[3] / 'shared' / 'robots' /
               'unitree_rl_lab_g1_velocity' / 'exported' / 'policy.onnx')


def _float64_model(model):
    '''The same graph evaluated in float64 (onnx.reference on float64 weights and inputs).'''
    import onnx
    from onnx import numpy_helper
    wide = onnx.ModelProto()
    wide.CopyFrom(model)
    for t in wide.graph.initializer:
        t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(t).astype(np.float64), t.name))
    for value in [*wide.graph.input, *wide.graph.output]:
        value.type.tensor_type.elem_type = onnx.TensorProto.DOUBLE
    return wide


@pytest.mark.slow
def test_real_isaac_lab_export_agrees_with_onnxruntime_within_the_bound(tmp_path):
    # Isaac Lab's G1 velocity policy as unitree_rl_lab ships it (480 inputs, 512-256-128 ELU,
    # 29 actions): the engine and onnxruntime differ by float32 rounding, each about as far
    # from a float64 evaluation of the same graph; the bound onnx.py states holds over
    # observations of the scale Isaac Lab feeds (scaled terms, O(1)) and beyond
    if not G1_VELOCITY.is_file():
        pytest.skip(f'{G1_VELOCITY} is absent (the ../shared folder beside the repository '
                    'holds the real unitree_rl_lab export)')
    need('onnx', 'onnx2pytorch', 'onnxruntime')
    import onnx
    import onnxruntime as ort
    from onnx.reference import ReferenceEvaluator
    from flashrt_ros.runtime.policies.onnx import CONVERSION_TOL
    engine = PolicyEngine(make_policy('mlp', 480, 29, file=str(G1_VELOCITY)), device='cpu',
                          capsule_dir=str(tmp_path))
    session = ort.InferenceSession(str(G1_VELOCITY), providers=['CPUExecutionProvider'])
    exact = ReferenceEvaluator(_float64_model(onnx.load(str(G1_VELOCITY))))
    rng = np.random.default_rng(19)
    worst = {'engine vs onnxruntime': 0.0, 'engine vs float64': 0.0,
             'onnxruntime vs float64': 0.0}
    for scale in (0.5, 1.0, 2.0):
        for obs in (rng.standard_normal((700, 480)) * scale).astype(np.float32):
            ours = engine.step(obs).numpy().astype(np.float64)
            theirs = session.run(None, {'obs': obs[None]})[0].reshape(-1).astype(np.float64)
            truth = exact.run(None, {'obs': obs[None].astype(np.float64)})[0].reshape(-1)
            scale_of = max(1.0, float(np.abs(truth).max()))
            for key, (a, b) in {'engine vs onnxruntime': (ours, theirs),
                                'engine vs float64': (ours, truth),
                                'onnxruntime vs float64': (theirs, truth)}.items():
                worst[key] = max(worst[key], float(np.abs(a - b).max()) / scale_of)
    print('\n' + '; '.join(f'{k}: {v:.3g} of max(1, largest |action|)'
                           for k, v in worst.items()))
    assert all(v <= CONVERSION_TOL for v in worst.values()), worst
    # neither runtime is the exact one: both round about as far from float64
    assert worst['engine vs float64'] > 0 and worst['onnxruntime vs float64'] > 0


# ---------------------------------------------------------------- refusals

def test_mlp_kind_refuses_a_graph_with_state_inputs(files):
    with pytest.raises(InvalidConfig, match=r"recurrent state inputs \['h_in \[2, 1, 64\]', "
                                            r"'c_in \[2, 1, 64\]'\].*set policy_type "
                                            r"'recurrent'"):
        make_policy('mlp', OBS, ACT, file=str(files('lstm_elu_norm')[0]))


def test_recurrent_kind_refuses_a_graph_without_state(files):
    with pytest.raises(InvalidConfig, match=r'takes only the observation obs \[1, 48\] and '
                                            r"keeps no recurrent state.*set policy_type 'mlp'"):
        make_policy('recurrent', OBS, ACT, file=str(files('mlp_tanh')[0]))


def test_dimension_mismatches_are_named(files):
    path = str(files('gru_elu_norm')[0])
    with pytest.raises(InvalidConfig, match=r'takes the observation obs \[1, 48\], '
                                            'configured obs_dim 45'):
        make_policy('recurrent', 45, ACT, file=path)
    with pytest.raises(InvalidConfig, match=r'gives actions \[1, 12\], configured act_dim 10'):
        make_policy('recurrent', OBS, 10, file=path)


def test_activation_must_agree_with_the_graph(files):
    path = str(files('mlp_elu_norm')[0])
    with pytest.raises(InvalidConfig, match=r"'activation' is 'tanh' but the graph's "
                                            r"activations are \['elu'\]"):
        make_policy('mlp', OBS, ACT, file=path, activation='tanh')
    assert make_policy('mlp', OBS, ACT, file=path, activation='elu').activation == 'elu'


def test_an_op_the_converter_cannot_take_is_named(files, tmp_path):
    import onnx
    from onnx import helper
    model = onnx.load(str(files('lstm_elu', 'legacy11')[0]))
    for node in model.graph.node:
        if node.op_type == 'LSTM':          # cell clipping: onnx2pytorch has no such LSTM
            node.attribute.append(helper.make_attribute('clip', 3.0))
    path = tmp_path / 'clipped.onnx'
    onnx.save(model, str(path))
    with pytest.raises(InvalidConfig, match=r'operators that cannot be converted to torch '
                                            r'\(LSTM: LSTM clip 3.0\).*TorchScript export'):
        make_policy('recurrent', OBS, ACT, file=str(path))


def test_operators_outside_the_standard_are_named(files, tmp_path):
    need('onnxruntime')
    import onnxruntime as ort
    # what onnxruntime writes when a deployment "optimises" the file: fused contrib ops
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    options.optimized_model_filepath = str(tmp_path / 'optimised.onnx')
    ort.InferenceSession(str(files('mlp_elu_norm', 'legacy11')[0]), options,
                         providers=['CPUExecutionProvider'])
    with pytest.raises(InvalidConfig, match=r'com\.microsoft\.FusedGemm: an operator outside '
                                            r'the ONNX standard.*TorchScript export'):
        make_policy('mlp', OBS, ACT, file=options.optimized_model_filepath)


def test_a_conversion_that_computes_something_else_is_refused(files, monkeypatch):
    from flashrt_ros.runtime.policies import onnx as onnx_policy

    def careless(module):
        # a converter that drops Elu's alpha attribute: plausible, silent and wrong
        for m in module.modules():
            if isinstance(m, nn.ELU):
                m.alpha = 0.5

    _refused_after(files, monkeypatch, onnx_policy, careless,
                   r'disagrees with the ONNX reference implementation \(output actions, '
                   r'step 0, max abs diff')


def test_a_conversion_off_by_half_precision_weights_is_refused(files, monkeypatch):
    # subtler than a dropped attribute: weights rounded through float16 move the actions by
    # ~1e-4, inside the old tolerance (1e-4 + 1e-3 |value|), far outside float32 rounding
    from flashrt_ros.runtime.policies import onnx as onnx_policy

    def rounded(module):
        with torch.no_grad():
            for p in module.parameters():
                p.copy_(p.half().float())

    _refused_after(files, monkeypatch, onnx_policy, rounded,
                   r'disagrees with the ONNX reference implementation \(output actions, '
                   r'step 0, max abs diff [0-9.e-]+, allowed 1e-05\)')


def _refused_after(files, monkeypatch, onnx_policy, spoil, match):
    # the real converter, then `spoil` edits the converted module in place: the load-time
    # check against the ONNX reference must refuse the file with `match`
    path = files('mlp_elu_norm')[0]
    onnx_module, convert, operations, real = onnx_policy.converter()

    def spoiled(model, **kwargs):
        module = convert(model, **kwargs)
        spoil(module)
        return module

    # patched where from_onnx looks it up
    monkeypatch.setattr(onnx_policy, 'converter',
                        lambda: (onnx_module, spoiled, operations, real))
    with pytest.raises(InvalidConfig, match=match):
        make_policy('mlp', OBS, ACT, file=str(path))


def test_a_file_that_is_not_onnx(tmp_path):
    need('onnx', 'onnx2pytorch')
    path = tmp_path / 'policy.onnx'
    path.write_bytes(b'not a protobuf at all \xff\xfe')
    with pytest.raises(InvalidConfig, match='cannot be read as an ONNX model'):
        make_policy('mlp', OBS, ACT, file=str(path))
    with pytest.raises(InvalidConfig, match='cannot be read as an ONNX model'):
        make_policy('mlp', OBS, ACT, file=str(tmp_path / 'missing.onnx'))


# ---------------------------------------------------------------- CUDA

@pytest.mark.cuda
@pytest.mark.parametrize('case', ['mlp_elu_norm', 'lstm_elu_norm', 'gru_tanh'])
def test_cuda_graph_matches_eager(files, tmp_path, case):
    path, _ = files(case)
    observations = _observations(case)
    runs = {}
    for captured in (True, False):
        policy = make_policy(_kind(case), OBS, ACT, file=str(path), device='cuda')
        engine = PolicyEngine(policy, device='cuda', cuda_graph=captured,
                              capsule_dir=str(tmp_path / str(captured)))
        assert engine.graph_captured == captured
        actions = []
        for k, obs in enumerate(observations):
            if k == SNAP:
                assert engine.snapshot('s').manifest.step == SNAP
            actions.append(engine.step(obs).numpy())
        assert engine.restore('s').step == SNAP
        replay = [engine.step(obs).numpy() for obs in observations[SNAP:SNAP + REPLAY]]
        assert np.array_equal(np.stack(replay), np.stack(actions[SNAP:SNAP + REPLAY]))
        runs[captured] = np.stack(actions)
    assert np.array_equal(runs[True], runs[False])
    if not _missing('onnxruntime'):
        diff = float(np.abs(runs[True] - _run_onnxruntime(path, observations)).max())
        print(f'\n{case} on CUDA, graph captured: max |engine - onnxruntime (CPU)| {diff:.3g}')
