"""The README's main command, `bash tools/demo.sh`, as a user runs it: the policy node with the
demo policy and the demo driver; every check holds and it exits 0. (It found the demo broken
once: it took the first AMENT_PREFIX_PATH entry for this package's, which stopped being true
when the workspace gained simulation_interfaces.)"""
import os
import pathlib
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.ros
def test_demo_runs_every_check(tmp_path):
    env = dict(os.environ, ROS_AUTOMATIC_DISCOVERY_RANGE='LOCALHOST')
    log = tmp_path / 'demo.log'
    with open(log, 'w') as out:
        proc = subprocess.run(['bash', str(ROOT / 'tools' / 'demo.sh')], env=env,
                              stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                              timeout=600)
    text = log.read_text()
    assert proc.returncode == 0, text[-4000:]
    assert ' passed, 0 failed' in text and '[FAIL]' not in text, text[-4000:]
