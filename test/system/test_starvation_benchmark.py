"""Smoke run of the starvation benchmark (benchmarks/starvation.py) against the installed
policy node: a short stream alone and with two client processes calling the capsule services.

Checks structure and the echo, not speed: both phases present with their figures, the stream
delivered actions and every action names a sequence number this run sent (the policy file's
action[0] is its observation[0]). A subprocess, as the other benchmark tests: the run starts
rclpy and spawns processes, which must not leak into the test session.
"""
import json
import math
import pathlib
import subprocess
import sys

import pytest

from benchmarks.ros_e2e import _executable

pytest.importorskip('rclpy', reason='rclpy missing: run tools/bootstrap.sh first')
pytestmark = pytest.mark.ros

# the checkout: the folder above this file that holds benchmarks/ (wherever test/ files it)
ROOT = next(p for p in pathlib.Path(__file__).resolve().parents if (p / 'benchmarks').is_dir())


def test_starvation_smoke_run(tmp_path):
    if _executable() is None:
        pytest.skip('policy_node executable not found on AMENT_PREFIX_PATH: run '
                    'tools/bootstrap.sh, source tools/env.sh')
    result = subprocess.run(
        [sys.executable, '-m', 'benchmarks.starvation', '--seconds', '2', '--clients', '2',
         '--unloaded-seconds', '1', '--warmup', '0.5', '--commit', 'cafe123',
         '--out', str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    [json_file] = tmp_path.glob('*-starvation-cafe123.json')
    data = json.loads(json_file.read_text())
    assert json_file.with_suffix('.md').exists()

    env = data['environment']
    assert env['git_commit'] == 'cafe123' and env['cpu_count'] >= 1
    for key in ('date', 'torch', 'rclpy', 'python'):
        assert env[key], key
    assert data['parameters']['clients'] == 2 and data['parameters']['seconds'] == 2
    node = data['nodes']['current']
    assert 'failed' not in node, (node['failed'], node['log_tail'])
    assert set(node['phases']) == {'unloaded', 'loaded'}
    for name, phase in node['phases'].items():
        assert phase['sent'] > 0 and phase['received'] > 0, (name, phase)
        assert phase['sent'] == phase['received'] + phase['lost']
        assert 0 <= phase['lost_pct'] <= 100
        assert phase['latency_us']['n'] == phase['received']
        assert math.isfinite(phase['latency_us']['p99']) and phase['latency_us']['p50'] > 0
    calls = node['phases']['loaded']['service_calls']
    assert calls['completed'] > 0 and calls['per_s'] > 0, calls
    assert set(calls['by_service']) == {'snapshot', 'restore', 'list_capsules'}
    # every action echoes a sequence number that was sent, none twice
    echo = node['echo']
    assert echo['actions'] > 0 and echo['not_echoing'] == 0 and echo['duplicates'] == 0, echo
    assert echo['echoing_a_sent_sequence'] == echo['actions']
    targets = node['targets']
    assert isinstance(targets['passed'], bool) and targets['loaded_over_unloaded_p99'] > 0
