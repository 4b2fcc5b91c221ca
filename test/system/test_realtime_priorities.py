"""process_priority and control_priority on the installed node, in its own process (as
deployed; in this test process they would put pytest itself under SCHED_FIFO): every thread
of the node under SCHED_FIFO at process_priority, the control thread at control_priority."""
import os
import pathlib
import subprocess
import time

import pytest

from support.ros_tools import installed_executable

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _wait_log(path, words, proc, seconds=120.0):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        text = path.read_text(errors='replace')
        if any(w in text for w in words):
            return text
        if proc.poll() is not None:
            raise RuntimeError(f'the node exited ({proc.returncode}):\n{text[-3000:]}')
        time.sleep(0.05)
    raise TimeoutError(f'none of {words} in the node log within {seconds} s:\n{text[-3000:]}')


def test_process_and_control_priorities_reach_every_thread(tmp_path):
    log_path = tmp_path / 'node.log'
    name = f'rt_priorities_{os.getpid()}'
    proc = subprocess.Popen(
        [installed_executable('policy_node'), '--ros-args', '--params-file',
         str(ROOT / 'config' / 'policy.yaml'),
         '-r', f'__node:={name}', '-p', 'device:=cpu', '-p', f'capsule_dir:={tmp_path}',
         '-p', 'process_priority:=5', '-p', 'control_priority:=7'],
        stdout=open(log_path, 'w'), stderr=subprocess.STDOUT)
    try:
        text = _wait_log(log_path, ('control thread: SCHED_FIFO priority 7',
                                    'could not enable SCHED_FIFO'), proc)
        if 'could not enable SCHED_FIFO' in text:
            pytest.skip('this user may not use SCHED_FIFO (no CAP_SYS_NICE or rtprio limit); '
                        'the node said so and ran on the default scheduler')
        assert 'process_priority: every thread under SCHED_FIFO priority 5' in text
        tids = [int(t) for t in os.listdir(f'/proc/{proc.pid}/task')]
        policies = {tid: os.sched_getscheduler(tid) for tid in tids}
        assert set(policies.values()) == {os.SCHED_FIFO}, policies
        priorities = sorted(os.sched_getparam(tid).sched_priority for tid in tids)
        assert priorities.count(7) == 1 and set(priorities) == {5, 7}, priorities
    finally:
        proc.terminate()
        proc.wait(timeout=30)
