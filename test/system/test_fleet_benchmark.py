"""CPU smoke tests of the fleet benchmarks (benchmarks/fleet.py, fleet_scale.py) in their
smallest configurations.

Checks structure, not speed: the three sections with a row per policy and size, every number
finite, every ratio a positive number, the header naming the commit, and the identity checks
measured in the run passed (exact fleet == single-session engines, parallel branches ==
sequential branches, bit for bit). A subprocess, as test_benchmarks does: the run sets torch's
thread count, which must not leak into the rest of the test session.
"""
import json
import math
import pathlib
import subprocess
import sys

from benchmarks import fleet_scale
from benchmarks.fleet import CONFIGS, POLICIES, SECTIONS
from benchmarks.sections import finite_numbers

ROOT = pathlib.Path(__file__).resolve().parents[2]
SMOKE = CONFIGS['smoke']


def test_fleet_smoke_run(tmp_path):
    out = tmp_path / 'fleet'
    result = subprocess.run(
        [sys.executable, '-m', 'benchmarks.fleet', '--smoke', '--device', 'cpu', '--commit',
         'cafe123', '--out', str(out)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    data = json.loads(out.with_suffix('.json').read_text())
    table = out.with_suffix('.md').read_text()

    env = data['environment']
    assert env['git_commit'] == 'cafe123' and env['commit_source'] == '--commit'
    for key in ('date', 'device_name', 'torch', 'python'):
        assert env[key], key
    assert finite_numbers(data) == []

    sizes = {'fleet_tick': SMOKE['ns'], 'fleet_capsule_ops': SMOKE['capsule_ns'],
             'branches': SMOKE['ks']}
    for section in SECTIONS:
        rows = data['sections'][section]['rows']
        size = 'k' if section == 'branches' else 'n'
        assert sorted((r['policy'], r[size]) for r in rows) == \
            sorted((p, n) for p in POLICIES for n in sizes[section]), section
        for r in rows:
            for name, ratio in r['ratios'].items():
                assert math.isfinite(ratio) and ratio > 0, (section, name, ratio)

    for r in data['sections']['fleet_tick']['rows']:
        assert r['exact_equals_engines'], r
        assert r['engines_built'] == r['n']
        assert 0 <= r['batched_vs_exact_max_abs_diff'] < 1e-3    # rounding, not a wrong result
        for variant in ('exact', 'batched', 'engines'):
            assert r[variant]['n'] == SMOKE['ticks'][r['n']] and r['steps_per_s'][variant] > 0
    for r in data['sections']['fleet_capsule_ops']['rows']:
        assert set(r['ops']) == {'snapshot', 'restore', 'fork', 'rollback'}
        assert r['ticks']['with_ops']['n'] == r['ticks']['without_ops']['n'] > 0
    for r in data['sections']['branches']['rows']:
        assert r['exact_bit_identical'] and r['exact_max_abs_diff'] == 0.0, r

    checks = data['checks']
    assert checks and all(c['passed'] for c in checks), [c for c in checks if not c['passed']]
    names = ' '.join(c['name'] for c in checks)
    assert names.count('equals sequential branch k bit for bit') == \
        len(POLICIES) * len(SMOKE['ks'])
    assert names.count('exact fleet actions equal') == len(POLICIES) * len(SMOKE['ns'])

    for needle in ('## 1. Fleet tick', '## 2. Capsule operations', '## 3. K branches',
                   'exact x engines', 'batched x engines', 'commit: cafe123',
                   f'torch {env["torch"]}', f'Identity checks: {len(checks)} / {len(checks)}'):
        assert needle in table, needle


def test_fleet_scale_smoke_run(tmp_path):
    """fleet_scale: a row per policy and size with every variant timed, the replay floor, the
    capsule rows, and its identity checks passed (invariant fleet == single invariant engines,
    a fleet capsule replayed in a single engine)."""
    out = tmp_path / 'scale'
    result = subprocess.run(
        [sys.executable, '-m', 'benchmarks.fleet_scale', '--smoke', '--device', 'cpu',
         '--commit', 'cafe123', '--out', str(out)], cwd=ROOT, capture_output=True, text=True,
        timeout=120)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    data = json.loads(out.with_suffix('.json').read_text())
    smoke = fleet_scale.CONFIGS['smoke']
    assert data['environment']['git_commit'] == 'cafe123'
    assert finite_numbers(data) == []
    ticks = data['sections']['ticks']
    assert sorted((r['policy'], r['n']) for r in ticks) == \
        sorted((p, n) for p in fleet_scale.POLICIES for n in smoke['ns'])
    for r in ticks:
        for variant in ('invariant', 'batched', 'exact', 'engines', 'replay_invariant',
                        'resident_invariant', 'resident_batched'):
            assert r[variant]['n'] == smoke['ticks'][r['n']], (r['n'], variant)
        assert r['invariant_equals_singles'] and r['ratios']['invariant_vs_batched'] > 0
        assert 0 <= r['invariant_vs_batched_max_abs_diff'] < 1e-3    # rounding only
    capsules = data['sections']['capsules']
    assert len(capsules) == len(fleet_scale.POLICIES) * len(smoke['capsule_ns'])
    assert all(r['replay_identical'] for r in capsules)
    checks = data['checks']
    # per N: invariant = singles, fed on the device = from the host, exact = engines
    per_policy = 3 * len(smoke['ns']) + len(smoke['capsule_ns'])
    assert len(checks) == len(fleet_scale.POLICIES) * per_policy
    assert all(c['passed'] for c in checks), [c for c in checks if not c['passed']]
    assert 'Identity checks: 14 / 14' in out.with_suffix('.md').read_text()
