'''obs_history with files that take a stacked window: TorchScript and ONNX exports of a
humanoid-gym actor (15 frames, oldest first) and a HIMLoco estimator + actor (6 frames, newest
first), made by torch.jit.script and torch.onnx.export (test/support/stacked_exports.py).

The engine is fed one frame at a time; the file is fed the window the test builds by hand
(zeros before the first frame, in the project's order). TorchScript: the file's own actions,
bit for bit. ONNX: the package's torch conversion of the file run directly on the hand-built
window, bit for bit, and onnxruntime within the stated conversion bound (onnx.py).
'''

import importlib.util

import numpy as np
import pytest
import torch

from support import policy_exports
from support import stacked_exports

from flashrt_ros.runtime.engine import PolicyEngine
from flashrt_ros.runtime.policies import make_policy

STEPS, SNAP, REPLAY = 200, 100, 50
LAYOUTS = sorted(stacked_exports.LAYOUTS)


@pytest.fixture(scope='module')
def folder(tmp_path_factory):
    return tmp_path_factory.mktemp('stacked')


def _need(*names):
    missing = [n for n in names if importlib.util.find_spec(n) is None]
    if missing:
        pytest.skip(f'needs {", ".join(missing)} (pip install --no-deps -r '
                    'requirements/onnx.txt)')


def _engine(path, name, tmp_path, order=None):
    frame_dim, frames, file_order, act_dim = stacked_exports.LAYOUTS[name]
    policy = make_policy('mlp', frame_dim, act_dim, file=path, obs_history=frames,
                         history_order=order or file_order)
    return PolicyEngine(policy, device='cpu', capsule_dir=str(tmp_path))


def _frames(name):
    return policy_exports.observations(stacked_exports.LAYOUTS[name][0], n=STEPS, seed=7)


def _run(engine, frames):
    return torch.stack([engine.step(frame) for frame in frames])


def _check_episode(engine, frames, want, label):
    '''The run equals `want` bit for bit; a capsule at SNAP (window included) replays the
    next REPLAY steps exactly; reset_episode starts from a zero window again.'''
    first = _run(engine, frames[:SNAP])
    assert engine.snapshot('mid').manifest.step == SNAP
    got = torch.cat([first, _run(engine, frames[SNAP:])])
    diff = (got.double() - want.double()).abs().max().item()
    assert torch.equal(got, want), f'{label}: not bit-identical, max abs diff {diff:.3g}'
    assert engine.restore('mid').step == SNAP
    assert torch.equal(_run(engine, frames[SNAP:SNAP + REPLAY]), got[SNAP:SNAP + REPLAY])
    engine.reset_episode()
    assert torch.equal(_run(engine, frames[:REPLAY]), got[:REPLAY]), f'{label}: after reset'


@pytest.mark.parametrize('name', LAYOUTS)
def test_torchscript_window_equals_the_file_fed_by_hand(name, folder, tmp_path):
    path = stacked_exports.torchscript(name, folder)
    _, frames, order, _ = stacked_exports.LAYOUTS[name]
    seen = _frames(name)
    want = policy_exports.run_torchscript(path, stacked_exports.windows(seen, frames, order))
    assert torch.isfinite(want).all() and want.abs().max() > 0, 'degenerate reference'
    _check_episode(_engine(path, name, tmp_path), seen, want, f'{name} TorchScript')


@pytest.mark.parametrize('name', LAYOUTS)
def test_the_window_order_decides_the_actions(name, folder, tmp_path):
    # the test above can fail: a window in the other order gives other actions at every step
    path = stacked_exports.torchscript(name, folder)
    _, frames, order, _ = stacked_exports.LAYOUTS[name]
    other = 'newest_first' if order == 'oldest_first' else 'oldest_first'
    seen = _frames(name)[:frames + 1]
    want = policy_exports.run_torchscript(path, stacked_exports.windows(seen, frames, order))
    got = _run(_engine(path, name, tmp_path, order=other), seen)
    assert all(not torch.equal(a, b) for a, b in zip(got, want))


@pytest.mark.parametrize('exporter', sorted(stacked_exports.ONNX_EXPORTERS))
@pytest.mark.parametrize('name', [pytest.param(n, marks=pytest.mark.slow)  # 15-17 s each
                                  if n == 'himloco' else n for n in LAYOUTS])
def test_onnx_window_equals_the_conversion_fed_by_hand(name, exporter, folder, tmp_path):
    _need('onnx', 'onnx2pytorch', 'onnxruntime', *(['onnxscript'] if exporter == 'dynamo18'
                                                   else []))
    import onnxruntime as ort
    from flashrt_ros.runtime.policies.onnx import conversion_bound
    path = stacked_exports.onnx_file(name, folder, exporter)
    frame_dim, frames, order, act_dim = stacked_exports.LAYOUTS[name]
    seen = _frames(name)
    stacked = stacked_exports.windows(seen, frames, order)
    direct = make_policy('mlp', frames * frame_dim, act_dim, file=path)    # no obs_history
    with torch.no_grad():
        want = torch.stack([direct.outputs(torch.from_numpy(w[None]))[direct.action_index]
                            .reshape(-1) for w in stacked]).float()
    _check_episode(_engine(path, name, tmp_path), seen, want, f'{name} ONNX ({exporter})')

    session = ort.InferenceSession(path, providers=['CPUExecutionProvider'])
    theirs = np.stack([session.run(None, {'obs': w[None]})[0].reshape(-1) for w in stacked])
    ours = want.double().numpy()
    excess = [np.abs(a - b).max() / conversion_bound(b) for a, b in zip(ours, theirs)]
    print(f'\n{name} [{exporter}]: max |engine - onnxruntime| '
          f'{np.abs(ours - theirs).max():.3g}, at most {max(excess):.3g} of the bound')
    assert max(excess) <= 1.0
