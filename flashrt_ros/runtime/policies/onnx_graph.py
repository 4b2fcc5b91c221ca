'''Reading an ONNX policy graph (Isaac Lab's policy.onnx) and converting it to torch.

The converter is onnx2pytorch (0.6): it converts the LSTM and GRU nodes with initial_h /
initial_c as graph inputs, which is what these exporters emit. onnx2torch (1.5.15, the last
release) has no LSTM or GRU converter at all. An operator the converter cannot handle, or
would only guess at, is refused by name before anything runs (to_torch); onnx.py then checks
the converted module against ONNX's own reference implementation.
'''

import importlib
import re
import sys
import types
import warnings

import numpy as np
import torch

from ..errors import InvalidConfig
from .base import ACTIVATIONS

_INSTALL = 'pip install --no-deps -r requirements/onnx.txt'
USE_TORCHSCRIPT = ('use the TorchScript export (policy.pt, written beside policy.onnx) '
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
# onnx2pytorch runs these through torchvision, which is not installed (see converter)
_TORCHVISION = {'RoiAlign', 'MaxRoiPool', 'NonMaxSuppression', 'DeformConv', 'ImageDecoder'}
# why an operator onnx2pytorch has no converter for is refused: it would convert it anyway
_GUESSES = "no converter (it would guess, ignoring the node's attributes)"


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


def converter():
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
                            f'({last_line(exc)}): {_INSTALL}') from exc
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


class GraphValue:
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


def describe_io(inputs, outputs):
    return (f'inputs [{", ".join(map(str, inputs))}], '
            f'outputs [{", ".join(map(str, outputs))}]')


def pair_state(source, inputs, outputs):
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
                        f'{describe_io(inputs, outputs)}')


def activations(nodes):
    return sorted({_ACTIVATION_OPS[n.op_type] for n in nodes if n.op_type in _ACTIVATION_OPS})


def check_activation(source, activation, found):
    '''Refuse a configured activation that contradicts the graph's (`found`: activations()).'''
    if not activation:
        return
    if activation not in ACTIVATIONS:
        raise InvalidConfig(f'unknown activation {activation!r}; one of '
                            f'{sorted(ACTIVATIONS)}')
    seen_as = _SEEN_AS.get(activation, activation)
    if found and seen_as not in found and activation != 'identity':
        raise InvalidConfig(f"{source}: parameter 'activation' is {activation!r} but the "
                            f"graph's activations are {found}; leave it empty or set it "
                            "to the file's")


# ---------------------------------------------------------------- converting

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
                found.setdefault(node.op_type, last_line(exc))
                continue
        if any('No explicit conversion' in str(w.message) for w in caught):
            found.setdefault(node.op_type, _GUESSES)
    return found


def last_line(exc):
    lines = str(exc).strip().splitlines() or [exc.__class__.__name__]
    return lines[-1][:160]


def _refusal(source, refused):
    listed = '; '.join(f'{op}: {why}' for op, why in sorted(refused.items()))
    return InvalidConfig(f'{source}: the ONNX graph uses operators that cannot be converted to '
                         f'torch ({listed}); {USE_TORCHSCRIPT}')


def to_torch(source, model, opset, converted_by):
    '''The torch module of `model` (converted_by: what converter() returns); InvalidConfig
    naming every operator that cannot be converted, or would only be guessed at.'''
    onnx, convert, convert_operations, real_torchvision = converted_by
    refused = _refused_ops(model.graph.node, real_torchvision)
    if refused:
        raise _refusal(source, refused)
    with warnings.catch_warnings(record=True) as caught:
        # onnx2pytorch's own notices (e.g. torch's indexing deprecation inside its Slice)
        # are its business; a guessed conversion is ours and is refused below
        warnings.simplefilter('always')
        folded = _fold_weights(onnx, model, opset)
        try:
            module = convert(folded, enable_pruning=False)
        except Exception as exc:  # noqa: B902 - name every node it cannot take
            raise _refusal(source, _unconvertible(folded.graph, opset, convert_operations) or
                           {'(graph)': last_line(exc)}) from exc
    guessed = {m.group(1) for w in caught
               for m in [re.search(r'No explicit conversion for op_type=(\w+)', str(w.message))]
               if m}
    if guessed:
        raise _refusal(source, {op: _GUESSES for op in guessed})
    return module
