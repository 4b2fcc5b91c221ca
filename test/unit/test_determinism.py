'''Determinism (issue 19): the engine reports a step that is not reproducible, from the probe it
runs at construction. (Every shipped kind replaying a restored capsule bit for bit, 8 times and
in a fresh process: test/system/test_determinism_benchmark.py.)
'''

import torch

from flashrt_ros.runtime.engine import PolicyEngine
from flashrt_ros.runtime.policies import make_policy


class _Unreproducible(torch.nn.Module):
    '''A user model whose step draws from the global RNG, outside the state: replays from
    one state differ, as with a kernel that is not reproducible.'''
    kind, obs_dim, act_dim, capacity = 'mlp', 4, 2, 0

    def state_specs(self):
        return []

    def bind(self, views, sessions=None):
        pass

    def reset_state(self):
        pass

    def model_digest(self):
        return 'unreproducible'

    def step(self, obs, action):
        action.copy_(obs[:2] + torch.rand(2, device=obs.device))


def test_engine_reports_a_step_that_is_not_reproducible(tmp_path, caplog):
    e = PolicyEngine(_Unreproducible(), capsule_dir=str(tmp_path))
    d = e.determinism
    assert d['probed'] and d['deterministic'] is False and d['replays'] == 3
    assert d['max_abs_diff'] > 0 and d['differing'] == [None]
    assert 'not reproducible' in caplog.text


def test_engine_reports_a_reproducible_step_and_can_skip_the_probe(tmp_path):
    policy = make_policy('history', 12, 4, d_model=32, n_layers=2, heads=2, capacity=128)
    d = PolicyEngine(policy, capsule_dir=str(tmp_path)).determinism
    assert d == {**d, 'probed': True, 'deterministic': True, 'differing': []}
    assert d['probe_ms'] >= 0 and d['graphs'] == 1          # CPU: the whole-capacity step
    skipped = PolicyEngine(policy, capsule_dir=str(tmp_path), determinism_probe=0)
    assert skipped.determinism == {'deterministic': None, 'replays': 0, 'probed': False}
