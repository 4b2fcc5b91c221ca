"""benchmarks/vla.py and vla_inputs.py --smoke, camera_ticks.py short: each runs, writes its
report, and its identity checks hold (the engine equals LeRobot's pipeline; a restore replays
the same actions; a restarted episode with its first prefix kept gives the same first action
without the prefix pass; the device-assembled observation acts as the host-packed one)."""
from importlib.metadata import version
import json
import pathlib
import subprocess
import sys

import pytest

pytest.importorskip('lerobot.policies.smolvla.modeling_smolvla',
                    reason='needs lerobot 0.4.4 and transformers (requirements/vla.txt)')
ROOT = pathlib.Path(__file__).resolve().parents[2]


# LeRobot's kernels; ours in both passes with a bfloat16 expert (the GPU runs' rows), whose
# report adds a check against LeRobot's own float32 expert
KERNELS = {'lerobot': [], 'fused+prefix': ['--denoise-kernels', 'fused+prefix',
                                           '--expert-dtype', 'bfloat16']}


@pytest.mark.parametrize('kernels', sorted(KERNELS))
def test_vla_benchmark_smoke_run(tmp_path, kernels):
    out = tmp_path / 'vla'
    result = subprocess.run([sys.executable, '-m', 'benchmarks.vla', '--smoke', '--out',
                             str(out), '--commit', 'cafe123', *KERNELS[kernels]], cwd=ROOT,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    data = json.loads(out.with_suffix('.json').read_text())
    assert data['environment']['git_commit'] == 'cafe123'
    assert data['environment']['lerobot'] == version('lerobot')
    (row,) = data['sections']['rows']
    for key in ('lerobot_chunk', 'engine_chunk', 'engine_restore_and_pop', 'engine_snapshot',
                'engine_chunk_kept_prefix'):
        assert row[key]['n'] == 3 and row[key]['p50'] > 0, key
    assert row['capsule_bytes'] > 0 and row['ratios']['chunk_vs_restore_and_pop'] > 0
    assert row['ratios']['chunk_vs_kept_prefix'] > 0
    checks = 3 if kernels == 'lerobot' else 4
    assert [c['passed'] for c in data['checks']] == [True] * checks
    report = out.with_suffix('.md').read_text()
    assert f'Identity checks: {checks} / {checks}' in report
    assert f'LeRobot {version("lerobot")}' in report


def test_vla_inputs_benchmark_smoke_run(tmp_path):
    """benchmarks/vla_inputs.py --smoke: both paths timed, the device path's actions the
    host path's bit for bit (its identity check)."""
    out = tmp_path / 'inputs'
    result = subprocess.run([sys.executable, '-m', 'benchmarks.vla_inputs', '--smoke',
                             '--device', 'cpu', '--out', str(out), '--commit', 'cafe123'],
                            cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    data = json.loads(out.with_suffix('.json').read_text())
    rows = data['sections']['rows']
    assert [r['cameras'].split()[0] for r in rows] == ['smolvla', 'act']
    for row in rows:
        for path in ('host', 'device'):
            assert row[path]['pop']['n'] > 0 and row[path]['chunk']['n'] == 3, path
            assert row[path]['pop']['p50'] > 0 and row[path]['chunk']['p50'] > 0, path
        assert row['observation_mb'] > 3.9 * row['frames_mb']      # float32 vs uint8 pixels
    assert [c['passed'] for c in data['checks']] == [True, True]


def test_camera_ticks_benchmark_short_run(tmp_path):
    """benchmarks/camera_ticks.py, two short blocks: the policy node in its own process steps
    through ROS while a camera process streams JPEG frames, both conditions are timed (pops
    and chunks apart), and the per-frame parts beside them."""
    out = tmp_path / 'cameras'
    result = subprocess.run([sys.executable, '-m', 'benchmarks.camera_ticks', '--blocks', '1',
                             '--block-ticks', '10', '--out', str(out), '--commit', 'cafe123'],
                            cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    data = json.loads(out.with_suffix('.json').read_text())
    ticks = data['sections']['ticks']
    assert ticks['tree_commit'] == 'cafe123' and ticks['ticks'] == 20
    for condition in ('quiet', 'streaming'):
        pops, chunks = ticks['results'][condition]
        assert (pops['n'], chunks['n']) == (8, 2) and pops['p50'] > 0 and chunks['p50'] > 0
    parts = data['sections']['frames']
    assert len(parts) == 4 and all(p['p50'] > 0 for p in parts.values())
    assert [c['passed'] for c in data['checks']] == [True]
