'''ONNX policy files (Isaac Lab's policy.onnx) converted onto the torch path, their recurrent
state (the h/c inputs that come back as outputs) kept in the arena.

Isaac Lab's `_OnnxPolicyExporter` writes an MLP actor as `obs -> actions` and a recurrent one
as `(obs, h_in[, c_in]) -> (actions, h_out[, c_out])`, state [num_layers, 1, hidden]: the graph
is a pure function and the caller carries the state. Here the caller is the policy: the state
inputs are arena views, and each step copies the returned state into them in place, so a
capsule holds everything that decides the next action.

Reading the graph and converting it is onnx_graph.py's. Nothing is taken on trust: before a
graph is accepted, the converted module runs a few steps beside ONNX's own reference
implementation (onnx.reference) and must agree with it.
'''

import hashlib
import warnings

import numpy as np
import torch

from ..enums import PolicyKind
from ..errors import InvalidConfig
from ..state import BufferSpec
from .base import Policy
from .onnx_graph import (activations, check_activation, converter, describe_io, GraphValue,
                         last_line, pair_state, to_torch, USE_TORCHSCRIPT)

# How far a correct float32 conversion may stray from another float32 implementation, as a
# fraction of max(1, the output's largest |value|). Rounding error follows the magnitudes
# inside the graph, not each output element, so an element-wise relative bound would be
# meaningless near zero. Measured on Isaac Lab's G1 velocity export (480 inputs, 512-256-128
# ELU) over 20,000 observations: torch vs onnx.reference <= 1.3e-6, torch vs onnxruntime
# <= 2.8e-6, each <= 2.4e-6 from a float64 evaluation (test_onnx.py re-measures). A wrong
# conversion (a dropped ELU alpha) is ~1e-1 off.
CONVERSION_TOL = 1e-5
_CHECK_STEPS = 4


# ---------------------------------------------------------------- the policy

class OnnxPolicy(Policy):
    '''An ONNX policy file converted to torch (onnx2pytorch), its state in the arena.

    kind: 'mlp' (the graph takes only the observation) or 'recurrent' (it takes state inputs
    that come back as outputs). State: each state input under its graph name (kind
    'recurrent', the input's shape and dtype), and 'rng' for optional action noise.
    '''

    def __init__(self, module, obs, states, action_index, state_index, obs_dim, act_dim, *,
                 kind, activation='', opset=0, graph_bytes=b'', noise_std=0.0, seed=0,
                 source=''):
        super().__init__(obs_dim, act_dim, 0, noise_std, seed)
        self.kind, self.source, self.opset = kind, source, int(opset)
        self.module = module.eval()
        self.requires_grad_(False)
        self.obs_name, self.obs_shape, self.obs_dtype = obs.name, obs.shape, obs.dtype
        self.state_names = [s.name for s in states]
        self._state_shapes = {s.name: (s.shape, s.dtype) for s in states}
        self.action_index, self.state_index = int(action_index), list(state_index)
        self.activation = activation
        self._graph_digest = hashlib.sha256(graph_bytes).hexdigest()
        self._run, self._run_device = None, None

    def config(self):
        return {**super().config(), 'format': 'onnx', 'opset': self.opset,
                'state': tuple(self.state_names), 'activation': self.activation}

    def state_specs(self):
        return [BufferSpec(name, *self._state_shapes[name], 'recurrent')
                for name in self.state_names] + [self._rng_spec()]

    def outputs(self, obs, *states):
        '''The converted graph's outputs as a tuple, eager (no tracing): for checks.'''
        out = self.module(obs, *states)
        return tuple(out) if isinstance(out, (list, tuple)) else (out,)

    def bind(self, views, sessions=None):
        super().bind(views, sessions)       # refuses a fleet: the graph steps one session
        if self._run_device != self.device:
            self._run, self._run_device = self._trace(), self.device

    @torch.no_grad()
    def _trace(self):
        '''The converted module traced on this device into one fixed kernel sequence.

        onnx2pytorch interprets the graph node by node in Python and reads shape constants
        back to the host (a device sync that CUDA graph capture forbids); tracing runs that
        once, so the step is only tensor kernels: capturable, and several times faster on
        CPU. The trace is used only where it gives the eager module's outputs bit for bit.
        '''
        gen = torch.Generator().manual_seed(0)

        def sample():
            obs = torch.randn(self.obs_shape, generator=gen).to(self.device, self.obs_dtype)
            return [obs] + [torch.randn(shape, generator=gen).to(self.device, dtype)
                            for shape, dtype in (self._state_shapes[n]
                                                 for n in self.state_names)]

        try:
            with warnings.catch_warnings():
                # torch.jit.trace's deprecation notice and the tracer's notes on Python
                # values: the values are the graph's shape constants, fixed by design
                warnings.simplefilter('ignore')
                # a plain function, not the method: trace would take a method for a module's
                traced = torch.jit.trace(lambda *args: self.outputs(*args), tuple(sample()),
                                         check_trace=False)
                same = all(all(torch.equal(a, b) for a, b in zip(traced(*x), self.outputs(*x)))
                           for x in (sample() for _ in range(3)))
        except Exception as exc:  # noqa: B902 - any tracing failure: keep the eager module
            warnings.warn(f'{self.source}: the converted graph could not be traced '
                          f'({last_line(exc)}); it runs node by node (slower, and not '
                          'capturable as a CUDA graph)', RuntimeWarning)
            return self.outputs
        if not same:
            warnings.warn(f'{self.source}: the traced graph differs from the converted one; '
                          'it runs node by node (slower, and not capturable as a CUDA '
                          'graph)', RuntimeWarning)
            return self.outputs
        return traced

    @torch.no_grad()
    def step(self, obs, action):
        states = [self.views[name] for name in self.state_names]
        out = self._run(obs.view(self.obs_shape).to(self.obs_dtype), *states)
        # every output is computed before any state view is written
        for view, i in zip(states, self.state_index):
            view.copy_(out[i])
        self._act(out[self.action_index].reshape(self.act_dim).float(), action)

    def model_digest(self):
        # the graph bytes (its weights included) and the config; never the arena state
        digest = hashlib.sha256(repr(sorted(self.config().items())).encode())
        digest.update(self._graph_digest.encode())
        return digest.hexdigest()

    @property
    def device(self):
        for tensor in (*self.module.parameters(), *self.module.buffers()):
            return tensor.device
        return torch.device('cpu')


# ---------------------------------------------------------------- loading

def _check_against_reference(onnx, model, policy, source):
    '''Run the converted module and ONNX's reference implementation side by side for a few
    steps (each feeding back its own state, starting from random state) and refuse on a
    disagreement: a converter that silently computes something else must not drive a robot.'''
    from onnx.reference import ReferenceEvaluator
    names = [policy.obs_name] + policy.state_names
    gen = torch.Generator().manual_seed(1)
    ours = [torch.randn(shape, generator=gen).to(dtype)
            for shape, dtype in (policy._state_shapes[n] for n in policy.state_names)]
    theirs = [t.numpy().copy() for t in ours]
    try:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter('ignore')     # onnx2pytorch's own notices, as in from_onnx
            reference = ReferenceEvaluator(model)
            for step in range(_CHECK_STEPS):
                obs = torch.randn(policy.obs_shape, generator=gen).to(policy.obs_dtype)
                got = policy.outputs(obs, *ours)
                want = reference.run(None, dict(zip(names, [obs.numpy(), *theirs])))
                for i, (a, b) in enumerate(zip(got, want)):
                    _compare(source, model.graph.output[i].name, step, a, b)
                ours = [got[i] for i in policy.state_index]
                theirs = [np.asarray(want[i]) for i in policy.state_index]
    except InvalidConfig:
        raise
    except Exception as exc:  # noqa: B902 - the reference cannot run it: no check possible
        warnings.warn(f'{source}: the ONNX reference implementation cannot run this graph '
                      f'({last_line(exc)}); the conversion is not cross-checked',
                      RuntimeWarning)


def conversion_bound(reference):
    '''The largest difference a correct float32 conversion shows from `reference` (one
    output, any float array): CONVERSION_TOL * max(1, max |reference|).'''
    reference = np.asarray(reference, np.float64)
    return CONVERSION_TOL * max(1.0, float(np.max(np.abs(reference), initial=0.0)))


def _compare(source, name, step, ours, theirs):
    a, b = ours.double().numpy(), np.asarray(theirs, np.float64)
    if a.shape == b.shape and np.all(np.abs(a - b) <= conversion_bound(b)):
        return
    diff = (f'max abs diff {float(np.max(np.abs(a - b))):.3g}, allowed '
            f'{conversion_bound(b):.3g}' if a.shape == b.shape else
            f'shape {list(a.shape)}, the reference gives {list(b.shape)}')
    raise InvalidConfig(f'{source}: the converted graph disagrees with the ONNX reference '
                        f'implementation (output {name}, step {step}, {diff}); refused rather '
                        f'than run wrong actions: {USE_TORCHSCRIPT}')


def from_onnx(kind, path, obs_dim, act_dim, *, activation='', **options):
    '''An OnnxPolicy of `kind` ('mlp' | 'recurrent') from an ONNX file. Raises InvalidConfig
    naming what does not fit: state inputs for 'mlp', none for 'recurrent', dimensions, an
    activation that contradicts the file, operators the converter cannot handle.'''
    source = str(path)
    if kind not in (PolicyKind.MLP, PolicyKind.RECURRENT):
        raise InvalidConfig(f"{source}: an ONNX file is a policy of kind 'mlp' or "
                            f"'recurrent', not {kind!r}")
    converted_by = converter()
    onnx = converted_by[0]
    try:
        model = onnx.load(source)
        graph_bytes = model.SerializeToString()
    except Exception as exc:  # noqa: B902 - missing file, protobuf and format errors alike
        raise InvalidConfig(f'{source}: cannot be read as an ONNX model '
                            f'({exc.__class__.__name__}: {str(exc)[:200]})') from exc
    graph = model.graph
    weights = {t.name for t in graph.initializer}
    inputs = [GraphValue(onnx, v) for v in graph.input if v.name not in weights]
    outputs = [GraphValue(onnx, v) for v in graph.output]
    if not inputs or not outputs:
        raise InvalidConfig(f'{source}: the graph has no inputs or no outputs; found '
                            f'{describe_io(inputs, outputs)}')
    obs, states = inputs[0], inputs[1:]
    if kind == PolicyKind.MLP and states:
        raise InvalidConfig(f'{source}: the graph takes recurrent state inputs '
                            f'{[str(s) for s in states]} besides the observation {obs}: set '
                            "policy_type 'recurrent'")
    if kind == PolicyKind.RECURRENT and not states:
        raise InvalidConfig(f'{source}: the graph takes only the observation {obs} and keeps no '
                            "recurrent state (no h_in/c_in inputs): set policy_type 'mlp'; "
                            f'found {describe_io(inputs, outputs)}')
    if obs.shape[-1:] != (obs_dim,) or int(np.prod(obs.shape)) != obs_dim:
        raise InvalidConfig(f'{source}: the graph takes the observation {obs}, configured '
                            f'obs_dim {obs_dim}')
    for value in inputs:
        if value.dtype is None or not value.dtype.is_floating_point:
            raise InvalidConfig(f'{source}: input {value} is not a float tensor; found '
                                f'{describe_io(inputs, outputs)}')
    state_index = pair_state(source, inputs, outputs)
    action_index = next(i for i in range(len(outputs)) if i not in state_index)
    if 'actions' in [o.name for o in outputs] and outputs[action_index].name != 'actions':
        action_index = [o.name for o in outputs].index('actions')
    for s, i in zip(states, state_index):
        if outputs[i].known and outputs[i].shape != s.shape:
            raise InvalidConfig(f'{source}: state input {s} comes back as {outputs[i]}, a '
                                'different shape')
    found = activations(graph.node)
    check_activation(source, activation, found)
    opset = next((o.version for o in model.opset_import if o.domain in ('', 'ai.onnx')), 0)
    module = to_torch(source, model, opset, converted_by)
    policy = OnnxPolicy(module, obs, states, action_index, state_index, obs_dim, act_dim,
                        kind=kind, activation='/'.join(found), opset=opset,
                        graph_bytes=graph_bytes, noise_std=options.get('noise_std', 0.0),
                        seed=options.get('seed', 0), source=source)
    _probe(policy, outputs, act_dim, source)
    _check_against_reference(onnx, model, policy, source)
    return policy


@torch.no_grad()
def _probe(policy, outputs, act_dim, source):
    '''One eager step on zeros: the action has act_dim values, each state its own shape.'''
    obs = torch.zeros(policy.obs_shape, dtype=policy.obs_dtype)
    states = [torch.zeros(shape, dtype=dtype)
              for shape, dtype in (policy._state_shapes[n] for n in policy.state_names)]
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')         # onnx2pytorch's own notices, as above
        try:
            out = policy.outputs(obs, *states)
        except Exception as exc:  # noqa: B902 - a converted graph that cannot run at all
            raise InvalidConfig(f'{source}: the converted graph fails on zeros '
                                f'({last_line(exc)}); {USE_TORCHSCRIPT}') from exc
    action = out[policy.action_index]
    if action.numel() != act_dim:
        raise InvalidConfig(f'{source}: the graph gives {outputs[policy.action_index].name} '
                            f'{list(action.shape)}, configured act_dim {act_dim}')
    for name, i in zip(policy.state_names, policy.state_index):
        shape = policy._state_shapes[name][0]
        if tuple(out[i].shape) != shape:
            raise InvalidConfig(f'{source}: state input {name} {list(shape)} comes back as '
                                f'{outputs[i].name} {list(out[i].shape)}')
