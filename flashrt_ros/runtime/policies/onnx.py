'''ONNX policy files (Isaac Lab's policy.onnx) converted onto the torch path, their recurrent
state (the h/c inputs that come back as outputs) kept in the arena.

Isaac Lab's `_OnnxPolicyExporter` writes an MLP actor as `obs -> actions` and a recurrent one
as `(obs, h_in[, c_in]) -> (actions, h_out[, c_out])`, state [num_layers, 1, hidden]: the graph
is a pure function and the caller carries the state. Here the caller is the policy: the state
inputs are arena views, and each step copies the returned state into them in place, so a
capsule holds everything that decides the next action.

The converter is onnx2pytorch (0.6): it converts the LSTM and GRU nodes with initial_h /
initial_c as graph inputs, which is what these exporters emit. onnx2torch (1.5.15, the last
release) has no LSTM or GRU converter at all. Nothing is taken on trust: before a graph is
accepted, the converted module runs a few steps beside ONNX's own reference implementation
(onnx.reference) and must agree with it; an op the converter cannot handle is refused by name.
'''

import hashlib
import importlib
import re
import sys
import types
import warnings

import numpy as np
import torch

from ..errors import InvalidConfig
from ..state import BufferSpec
from .base import ACTIVATIONS, Policy

_INSTALL = 'pip install --no-deps -r requirements/onnx.txt'
_USE_TORCHSCRIPT = ('use the TorchScript export (policy.pt, written beside policy.onnx) '
                    'instead')
# ONNX activation nodes -> names in base.ACTIVATIONS (SiLU exports as Sigmoid and Mul)
_ACTIVATION_OPS = {'Elu': 'elu', 'Relu': 'relu', 'Selu': 'selu', 'Tanh': 'tanh',
                   'Sigmoid': 'sigmoid', 'LeakyRelu': 'leakyrelu', 'Gelu': 'gelu',
                   'Softplus': 'softplus', 'Mish': 'mish'}
_SEEN_AS = {'lrelu': 'leakyrelu', 'swish': 'sigmoid', 'silu': 'sigmoid'}
# the step is traced once into a fixed sequence of kernels: a branch or loop would be frozen
# at whatever it did while tracing
_CONTROL_FLOW = {'If', 'Loop', 'Scan', 'SequenceMap'}
# a sampler's generator state would live outside the arena, so a capsule could not restore it
_RANDOM = {'RandomNormal', 'RandomNormalLike', 'RandomUniform', 'RandomUniformLike',
           'Bernoulli', 'Multinomial'}
# onnx2pytorch runs these through torchvision, which is not installed (see _converter)
_TORCHVISION = {'RoiAlign', 'MaxRoiPool', 'NonMaxSuppression', 'DeformConv', 'ImageDecoder'}
# How far a correct float32 conversion may stray from another float32 implementation, as a
# fraction of max(1, the output's largest |value|). Rounding error follows the magnitudes
# inside the graph, not each output element, so an element-wise relative bound would be
# meaningless near zero. Measured on Isaac Lab's G1 velocity export (480 inputs, 512-256-128
# ELU) over 20,000 observations: torch vs onnx.reference <= 1.3e-6, torch vs onnxruntime
# <= 2.8e-6, each <= 2.4e-6 from a float64 evaluation (test_onnx.py re-measures). A wrong
# conversion (a dropped ELU alpha) is ~1e-1 off.
CONVERSION_TOL = 1e-5
_CHECK_STEPS = 4


# ---------------------------------------------------------------- the converter

def _torchvision_stand_in():
    # onnx2pytorch imports torchvision at import time for the ops in _TORCHVISION alone.
    # torchvision wheels are built against one torch build (PyPI's are CUDA builds that fail
    # to load beside the CPU torch), so it is not a dependency: these stand-ins satisfy the
    # import and raise if ever called; graphs with those ops are refused before conversion.
    def unavailable(*args, **kwargs):
        raise RuntimeError('torchvision is not installed')

    root = types.ModuleType('torchvision')
    root.ops, root.io = types.ModuleType('torchvision.ops'), types.ModuleType('torchvision.io')
    for name in ('roi_align', 'roi_pool', 'deform_conv2d', 'nms', 'box_convert'):
        setattr(root.ops, name, unavailable)
    root.io.decode_image, root.io.ImageReadMode = unavailable, None
    return {'torchvision': root, 'torchvision.ops': root.ops, 'torchvision.io': root.io}


def _converter():
    '''(onnx, onnx2pytorch ConvertModel, convert_operations, torchvision usable), or
    InvalidConfig saying what to install.'''
    try:
        import onnx
        import onnx.reference  # noqa: F401 - the conversion check
    except ImportError as exc:
        raise InvalidConfig(f'ONNX policy files need the onnx package ({exc}): {_INSTALL}'
                            ) from exc
    if 'onnx2pytorch' in sys.modules:
        from onnx2pytorch import ConvertModel
        from onnx2pytorch.convert.operations import convert_operations
        return onnx, ConvertModel, convert_operations, not hasattr(
            sys.modules['onnx2pytorch'], '_flashrt_stand_in')
    try:
        import torchvision  # noqa: F401
        real = True
    except Exception:  # noqa: B902 - missing, or present but built for another torch
        for name in [n for n in sys.modules if n.split('.')[0] == 'torchvision']:
            del sys.modules[name]               # a failed import can leave submodules behind
        real = False
    stand_in = {} if real else _torchvision_stand_in()
    sys.modules.update(stand_in)
    try:
        module = importlib.import_module('onnx2pytorch')
        from onnx2pytorch import ConvertModel
        from onnx2pytorch.convert.operations import convert_operations
    except Exception as exc:  # noqa: B902 - missing, or failing to import beside this torch
        raise InvalidConfig(f'ONNX policy files need the onnx2pytorch converter '
                            f'({_last_line(exc)}): {_INSTALL}') from exc
    finally:
        for name in stand_in:               # nobody else may mistake them for torchvision
            sys.modules.pop(name, None)
    if not real:
        module._flashrt_stand_in = True
    return onnx, ConvertModel, convert_operations, real


# ---------------------------------------------------------------- reading the graph

def _torch_dtype(onnx, elem_type):
    try:
        return torch.from_numpy(np.zeros(0, onnx.helper.tensor_dtype_to_np_dtype(elem_type))
                                ).dtype
    except (KeyError, TypeError, ValueError):
        return None


class _Value:
    '''A graph input or output: name, shape (symbolic dims read as the batch of one), dtype.'''

    def __init__(self, onnx, info):
        self.name = info.name
        dims = info.type.tensor_type.shape.dim
        self.shape = tuple(d.dim_value if d.HasField('dim_value') else 1 for d in dims)
        self.known = info.type.tensor_type.HasField('shape') and all(
            d.HasField('dim_value') for d in dims)
        self.dtype = _torch_dtype(onnx, info.type.tensor_type.elem_type)

    def __str__(self):
        return f'{self.name} {list(self.shape)}'


def _describe(inputs, outputs):
    return (f'inputs [{", ".join(map(str, inputs))}], '
            f'outputs [{", ".join(map(str, outputs))}]')


def _pair_state(source, inputs, outputs):
    '''Index of the output that returns each state input: by name (h_in -> h_out) where every
    state has one, else by position after the first output (the action, as Isaac Lab and
    every exporter seen writes it).'''
    states = inputs[1:]
    index = {o.name: i for i, o in enumerate(outputs)}
    by_name = [index.get(s.name[:-3] + '_out') if s.name.endswith('_in') else None
               for s in states]
    if None not in by_name and len(set(by_name)) == len(by_name):
        return by_name
    if len(outputs) == len(states) + 1:
        return list(range(1, len(outputs)))
    raise InvalidConfig(f'{source}: cannot tell which outputs return the state inputs '
                        f'{[s.name for s in states]} (expected <name>_in -> <name>_out, or '
                        f'the action first and then one output per state input); found '
                        f'{_describe(inputs, outputs)}')


def _activations(nodes):
    return sorted({_ACTIVATION_OPS[n.op_type] for n in nodes if n.op_type in _ACTIVATION_OPS})


def _refused_ops(nodes, real_torchvision):
    '''{op: why} for nodes refused before conversion is tried.'''
    refused = {}
    for node in nodes:
        op = node.op_type
        if node.domain not in ('', 'ai.onnx'):
            refused[f'{node.domain}.{op}'] = f'an operator outside the ONNX standard ' \
                                             f'(domain {node.domain!r})'
        elif op in _CONTROL_FLOW:
            refused[op] = 'control flow (a policy step must be one fixed sequence of kernels)'
        elif op in _RANDOM:
            refused[op] = 'sampling inside the graph (its generator state could not be ' \
                          'snapshotted)'
        elif op in _TORCHVISION and not real_torchvision:
            refused[op] = 'needs torchvision, which is not installed'
    return refused


def _fold_weights(onnx, model, opset):
    '''A copy of `model` in which every node that computes only from stored tensors has been
    evaluated once and stored as a tensor itself.

    torch's dynamo exporter (its default since 2.9) leaves the LSTM/GRU gate reordering as
    Slice/Concat nodes over the weights once they exceed its constant-folding size limit (a
    64-unit LSTM on 48 observations already does), while onnx2pytorch takes RNN weights only
    as stored tensors.
    ONNX's reference implementation evaluates them here; slicing and concatenation are exact.
    '''
    from onnx import numpy_helper
    from onnx.reference import ReferenceEvaluator
    graph = model.graph
    known = {t.name: numpy_helper.to_array(t) for t in graph.initializer}
    outputs = {o.name for o in graph.output}
    kept, folded = [], []
    for node in graph.node:
        names = [n for n in node.input if n]
        if (node.domain not in ('', 'ai.onnx') or node.op_type in _CONTROL_FLOW | _RANDOM
                or outputs & set(node.output) or not all(n in known for n in names)):
            kept.append(node)
            continue
        try:
            values = ReferenceEvaluator(node, opsets={'': opset}).run(
                None, {n: known[n] for n in names})
        except Exception:  # noqa: B902 - left to the converter, which names what it refuses
            kept.append(node)
            continue
        for name, value in zip(node.output, values):
            known[name] = np.asarray(value)
            folded.append(name)
    if not folded:
        return model
    used = {n for node in kept for n in node.input} | outputs
    result = onnx.ModelProto()
    result.CopyFrom(model)
    del result.graph.node[:]
    result.graph.node.extend(kept)
    stored = [t for t in graph.initializer if t.name in used]
    stored += [numpy_helper.from_array(known[n], n) for n in folded if n in used]
    del result.graph.initializer[:]
    result.graph.initializer.extend(stored)
    # old exporters also list stored tensors as graph inputs: drop those no longer stored
    names = {t.name for t in stored}
    dropped = set(known) - names
    inputs = [v for v in graph.input if v.name not in dropped]
    del result.graph.input[:]
    result.graph.input.extend(inputs)
    return result


def _unconvertible(graph, opset, convert_operations):
    '''{op: why} for the nodes the converter refuses, one node at a time (it stops at the
    first otherwise), and those it would only guess at.'''
    found = {}
    for node in graph.node:
        single = types.SimpleNamespace(node=[node], initializer=graph.initializer,
                                       output=graph.output, input=graph.input)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter('always')
            try:
                list(convert_operations(single, opset, 0, False))
            except Exception as exc:  # noqa: B902 - every converter failure names its node
                found.setdefault(node.op_type, _last_line(exc))
                continue
        if any('No explicit conversion' in str(w.message) for w in caught):
            found.setdefault(node.op_type, 'no converter (it would guess, ignoring the '
                                           "node's attributes)")
    return found


def _last_line(exc):
    lines = str(exc).strip().splitlines() or [exc.__class__.__name__]
    return lines[-1][:160]


def _refuse_ops(source, refused):
    listed = '; '.join(f'{op}: {why}' for op, why in sorted(refused.items()))
    return InvalidConfig(f'{source}: the ONNX graph uses operators that cannot be converted to '
                         f'torch ({listed}); {_USE_TORCHSCRIPT}')


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
                          f'({_last_line(exc)}); it runs node by node (slower, and not '
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
                      f'({_last_line(exc)}); the conversion is not cross-checked',
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
                        f'than run wrong actions: {_USE_TORCHSCRIPT}')


def from_onnx(kind, path, obs_dim, act_dim, *, activation='', **options):
    '''An OnnxPolicy of `kind` ('mlp' | 'recurrent') from an ONNX file. Raises InvalidConfig
    naming what does not fit: state inputs for 'mlp', none for 'recurrent', dimensions, an
    activation that contradicts the file, operators the converter cannot handle.'''
    source = str(path)
    if kind not in ('mlp', 'recurrent'):
        raise InvalidConfig(f"{source}: an ONNX file is a policy of kind 'mlp' or "
                            f"'recurrent', not {kind!r}")
    onnx, convert, convert_operations, real_torchvision = _converter()
    try:
        model = onnx.load(source)
        graph_bytes = model.SerializeToString()
    except Exception as exc:  # noqa: B902 - missing file, protobuf and format errors alike
        raise InvalidConfig(f'{source}: cannot be read as an ONNX model '
                            f'({exc.__class__.__name__}: {str(exc)[:200]})') from exc
    graph = model.graph
    weights = {t.name for t in graph.initializer}
    inputs = [_Value(onnx, v) for v in graph.input if v.name not in weights]
    outputs = [_Value(onnx, v) for v in graph.output]
    if not inputs or not outputs:
        raise InvalidConfig(f'{source}: the graph has no inputs or no outputs; found '
                            f'{_describe(inputs, outputs)}')
    obs, states = inputs[0], inputs[1:]
    if kind == 'mlp' and states:
        raise InvalidConfig(f'{source}: the graph takes recurrent state inputs '
                            f'{[str(s) for s in states]} besides the observation {obs}: set '
                            "policy_type 'recurrent'")
    if kind == 'recurrent' and not states:
        raise InvalidConfig(f'{source}: the graph takes only the observation {obs} and keeps no '
                            "recurrent state (no h_in/c_in inputs): set policy_type 'mlp'; "
                            f'found {_describe(inputs, outputs)}')
    if obs.shape[-1:] != (obs_dim,) or int(np.prod(obs.shape)) != obs_dim:
        raise InvalidConfig(f'{source}: the graph takes the observation {obs}, configured '
                            f'obs_dim {obs_dim}')
    for value in inputs:
        if value.dtype is None or not value.dtype.is_floating_point:
            raise InvalidConfig(f'{source}: input {value} is not a float tensor; found '
                                f'{_describe(inputs, outputs)}')
    state_index = _pair_state(source, inputs, outputs)
    action_index = next(i for i in range(len(outputs)) if i not in state_index)
    if 'actions' in [o.name for o in outputs] and outputs[action_index].name != 'actions':
        action_index = [o.name for o in outputs].index('actions')
    for s, i in zip(states, state_index):
        if outputs[i].known and outputs[i].shape != s.shape:
            raise InvalidConfig(f'{source}: state input {s} comes back as {outputs[i]}, a '
                                'different shape')
    found = _activations(graph.node)
    if activation:
        if activation not in ACTIVATIONS:
            raise InvalidConfig(f'unknown activation {activation!r}; one of '
                                f'{sorted(ACTIVATIONS)}')
        seen_as = _SEEN_AS.get(activation, activation)
        if found and seen_as not in found and activation != 'identity':
            raise InvalidConfig(f"{source}: parameter 'activation' is {activation!r} but the "
                                f"graph's activations are {found}; leave it empty or set it "
                                "to the file's")
    opset = next((o.version for o in model.opset_import if o.domain in ('', 'ai.onnx')), 0)
    refused = _refused_ops(graph.node, real_torchvision)
    if refused:
        raise _refuse_ops(source, refused)
    with warnings.catch_warnings(record=True) as caught:
        # onnx2pytorch's own notices (e.g. torch's indexing deprecation inside its Slice)
        # are its business; a guessed conversion is ours and is refused below
        warnings.simplefilter('always')
        folded = _fold_weights(onnx, model, opset)
        try:
            module = convert(folded, enable_pruning=False)
        except Exception as exc:  # noqa: B902 - name every node it cannot take
            raise _refuse_ops(source, _unconvertible(folded.graph, opset,
                                                     convert_operations) or
                              {'(graph)': _last_line(exc)}) from exc
    guessed = {m.group(1) for w in caught
               for m in [re.search(r'No explicit conversion for op_type=(\w+)', str(w.message))]
               if m}
    if guessed:
        raise _refuse_ops(source, {op: 'no converter (it would guess, ignoring the node\'s '
                                       'attributes)' for op in guessed})
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
                                f'({_last_line(exc)}); {_USE_TORCHSCRIPT}') from exc
    action = out[policy.action_index]
    if action.numel() != act_dim:
        raise InvalidConfig(f'{source}: the graph gives {outputs[policy.action_index].name} '
                            f'{list(action.shape)}, configured act_dim {act_dim}')
    for name, i in zip(policy.state_names, policy.state_index):
        shape = policy._state_shapes[name][0]
        if tuple(out[i].shape) != shape:
            raise InvalidConfig(f'{source}: state input {name} {list(shape)} comes back as '
                                f'{outputs[i].name} {list(out[i].shape)}')
