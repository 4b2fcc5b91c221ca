"""CPU smoke test of the benchmark suite in its smallest configuration.

Checks structure, not speed: every section is present, every number is finite, and the
identity checks measured inside the run (byte-exact restore/fork/rollback, bit-exact actions
after restore, KV-only ablation diverging) passed. No timing assertions.
"""
import json
import pathlib
import subprocess
import sys

import pytest

from benchmarks.run import SECTIONS
from benchmarks.sections import finite_numbers

ROOT = pathlib.Path(__file__).resolve().parents[2]
MEASURED = ('capsule_ops', 'live_bytes_scaling', 'first_action', 'kv_ablation',
            'control_step', 'baseline')


def _run(tmp_path, *extra):
    out = tmp_path / 'bench'
    result = subprocess.run(
        [sys.executable, '-m', 'benchmarks.run', '--smoke', '--device', 'cpu', '--out',
         str(out), *extra], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    return json.loads(out.with_suffix('.json').read_text()), out.with_suffix('.md').read_text()


def test_smoke_run_has_every_section_finite_and_identical(tmp_path):
    data, table = _run(tmp_path)
    env = data['environment']
    for key in ('date', 'hostname', 'device_name', 'driver', 'torch', 'cuda', 'python'):
        assert key in env, key
    assert set(SECTIONS) <= set(data['sections'])
    for name in MEASURED:
        section = data['sections'][name]
        assert 'skipped' not in section, (name, section)
        assert section.get('rows') or section.get('policies'), name
    assert 'skipped' in data['sections']['ros']          # only with --ros
    assert finite_numbers(data) == []
    checks = data['checks']
    assert checks and all(c['passed'] for c in checks), [c for c in checks if not c['passed']]
    names = ' '.join(c['name'] for c in checks)
    for needle in ('restore byte-exact', 'fork byte-exact', 'rollback(1) byte-exact',
                   'bit for bit', 'KV-only restore changes the actions'):
        assert needle in names, needle
    assert all(r['bit_exact_vs_continued'] for r in data['sections']['first_action']['rows'])
    assert all(r['diverged'] for r in data['sections']['kv_ablation']['rows'])
    for heading in ('## 1.', '## 2.', '## 3.', '## 4.', '## 5.', '## 6.', '## 7.'):
        assert heading in table, heading


@pytest.mark.slow
def test_ros_section_runs_or_says_why(tmp_path):
    data, _ = _run(tmp_path, '--sections', 'ros')
    ros = data['sections']['ros']
    if 'skipped' in ros:
        assert ros['skipped'], 'a skipped section must say why'
        return
    assert finite_numbers(ros) == []
    assert ros['restore']['failures'] == 0 and ros['observation_to_action']['lost'] == 0
    assert ros['restore']['round_trip']['n'] > 0
