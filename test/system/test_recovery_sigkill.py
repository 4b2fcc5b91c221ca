"""Recovery across processes: the policy node's executable (a recurrent policy, a SmolVLA
mid-chunk) killed with SIGKILL and restarted with restore_on_start, and capsule files that a
writer killed mid-write can never leave loadable. (The in-process recovery tests:
test/ros/test_recovery.py.)"""
import contextlib
import os
import random
import signal
import subprocess
import sys
import time

import pytest

rclpy = pytest.importorskip('rclpy', reason='rclpy missing: run tools/bootstrap.sh first')
pytestmark = pytest.mark.ros

from flashrt_ros.client import PolicyClient, spin_in_thread  # noqa: E402
from flashrt_ros.runtime.capsule_file import read_file  # noqa: E402
from support.common import obs_range, wait_for  # noqa: E402
from support.nodes import RECURRENT, reference_actions  # noqa: E402
from support.ros_tools import installed_executable, stop_gently  # noqa: E402


def _node_process(params, domain):
    args = [installed_executable('policy_node'), '--ros-args']
    for key, value in params.items():
        args += ['-p', f'{key}:={value}']
    env = dict(os.environ, ROS_DOMAIN_ID=domain)
    log = open(os.environ.get('FLASHRT_TEST_NODE_LOG', os.devnull), 'a')
    return subprocess.Popen(args, env=env, stdout=log, stderr=subprocess.STDOUT)


def _endpoints(node):
    """GIDs of the policy's observation subscriptions and action publishers in the graph."""
    subs = node.get_subscriptions_info_by_topic('/flashrt_policy/observation')
    pubs = node.get_publishers_info_by_topic('/flashrt_policy/action')
    return {bytes(e.endpoint_gid) for e in subs}, {bytes(e.endpoint_gid) for e in pubs}


def _wait_for_new_process(node, client, old):
    """A SIGKILLed participant stays in the DDS graph until its lease runs out, so
    wait_ready alone could be satisfied by the dead process: wait for new endpoints too."""
    def fresh():
        subs, pubs = _endpoints(node)
        return subs - old[0] and pubs - old[1]
    wait_for(fresh, timeout=60.0, what='the restarted node in the ROS graph')
    client.wait_ready(timeout=60.0)
    return tuple(a | b for a, b in zip(old, _endpoints(node)))


@contextlib.contextmanager
def _client(name, timeout):
    """(client node, PolicyClient, the node processes the test starts): the processes stopped
    and ROS shut down after."""
    rclpy.init()
    client_node = rclpy.create_node(name)
    executor = spin_in_thread(client_node)
    procs = []
    try:
        yield client_node, PolicyClient(client_node, timeout=timeout), procs
    finally:
        for p in procs:
            stop_gently(p, timeout=10)
        executor.shutdown()
        client_node.destroy_node()
        rclpy.shutdown()


@pytest.mark.slow
def test_sigkill_then_restore_on_start_resumes_the_same_actions(tmp_path):
    capsules = tmp_path / 'capsules'
    params = dict(RECURRENT, device='cpu', capsule_dir=str(capsules), checkpoint_every=10,
                  checkpoint_to_disk=True, status_period=0.2)
    observations = obs_range(0, 40)
    _, ref = reference_actions(params, observations, tmp_path / 'reference')
    domain = os.environ['ROS_DOMAIN_ID']
    with _client('recovery_client', 30.0) as (client_node, client, procs):
        seen = (set(), set())
        procs.append(_node_process(params, domain))
        seen = _wait_for_new_process(client_node, client, seen)
        assert [client.step(o) for o in observations[:25]] == ref[:25]
        files = sorted(p.name for p in capsules.glob('*.capsule'))
        assert files == ['checkpoint-00000001.capsule', 'checkpoint-00000002.capsule',
                         'episode_start.capsule'], files
        procs[0].send_signal(signal.SIGKILL)
        procs[0].wait(timeout=10)

        # Restarted process: resumes after step 20, the newest checkpoint.
        procs.append(_node_process(dict(params, restore_on_start='latest'), domain))
        seen = _wait_for_new_process(client_node, client, seen)
        assert [client.step(o) for o in observations[20:30]] == ref[20:30]
        r, _ = client.call('reset_episode')       # episode_start came back from its file
        assert r.success and "'episode_start'" in r.message, r.message
        assert client.step(observations[0]) == ref[0]
        procs[1].send_signal(signal.SIGKILL)
        procs[1].wait(timeout=10)

        # A newest checkpoint that fails its checksum is skipped for the one before it. The
        # second process took checkpoint 3 (after step 30); spoil it.
        newest = sorted(capsules.glob('checkpoint-*.capsule'))[-1]
        raw = bytearray(newest.read_bytes())
        raw[-1] ^= 0xFF
        newest.write_bytes(bytes(raw))
        procs.append(_node_process(dict(params, restore_on_start='latest'), domain))
        _wait_for_new_process(client_node, client, seen)
        assert [client.step(o) for o in observations[20:25]] == ref[20:25]


@pytest.mark.slow
def test_a_vla_killed_mid_chunk_resumes_the_same_actions(tmp_path):
    """A SmolVLA checkpoint on the node's executable (chunks of 5 actions), a checkpoint
    capsule every 3 steps on disk: SIGKILLed at step 8, restarted with restore_on_start
    latest, it resumes after step 6 (mid-chunk: the queue, its cursor and the rng counter
    come back from the file) with the actions of the run that was never killed."""
    pytest.importorskip('lerobot.policies.smolvla.modeling_smolvla',
                        reason='needs lerobot 0.4.4 and transformers (requirements/vla.txt)')
    from support.smolvla import ACT_DIM, checkpoint, frames, OBS_DIM, vectors, vlm_folder
    folder = checkpoint(vlm_folder(tmp_path / 'vlm'), tmp_path / 'checkpoint')
    capsules = tmp_path / 'capsules'
    params = dict(policy_type='smolvla', policy_file=folder, obs_dim=OBS_DIM, act_dim=ACT_DIM,
                  seed=3, device='cpu', capsule_dir=str(capsules), checkpoint_every=3,
                  checkpoint_to_disk=True, status_period=0.2)
    observations = vectors(folder, frames(16, seed=5))
    _, ref = reference_actions(params, observations, tmp_path / 'reference')
    with _client('vla_recovery_client', 60.0) as (client_node, client, procs):
        procs.append(_node_process(params, os.environ['ROS_DOMAIN_ID']))
        seen = _wait_for_new_process(client_node, client, (set(), set()))
        assert [client.step(o) for o in observations[:8]] == ref[:8]
        procs[0].send_signal(signal.SIGKILL)
        procs[0].wait(timeout=10)
        procs.append(_node_process(dict(params, restore_on_start='latest'),
                                   os.environ['ROS_DOMAIN_ID']))
        _wait_for_new_process(client_node, client, seen)
        assert [client.step(o) for o in observations[6:]] == ref[6:]


WRITER = '''
import sys, time, torch
from flashrt_ros.runtime.capsule import Manifest
from flashrt_ros.runtime.capsule_file import write_file
data = torch.arange(8 << 20, dtype=torch.int64).to(torch.uint8)   # 8 MB
i = 0
while True:
    i += 1
    m = Manifest(name='c', parent='', tier='device', pinned=False, step=i, episode=0,
                 position=0, nbytes=data.numel(), schema_digest='s' * 64, model_digest='m' * 64,
                 created=time.time())
    write_file(sys.argv[1] + '/c%d.capsule' % (i % 3), m, data)
    print(i, flush=True)
'''


@pytest.mark.slow
def test_crash_during_write_never_leaves_a_loadable_partial_file(tmp_path):
    rng = random.Random(7)
    kills = 0
    for _ in range(6):
        proc = subprocess.Popen([sys.executable, '-c', WRITER, str(tmp_path)],
                                stdout=subprocess.PIPE, text=True)
        for _ in range(rng.randint(1, 4)):       # let it write a few files first
            assert proc.stdout.readline(), 'writer died'
        time.sleep(rng.uniform(0.0, 0.05))       # then kill it somewhere inside a write (a
        # random moment on purpose: nothing to wait for)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        kills += 1
        for path in tmp_path.glob('*.capsule'):
            manifest, data = read_file(str(path))   # every visible file is complete
            assert data.numel() == 8 << 20 and manifest.step >= 1
        for path in tmp_path.glob('.tmp-*'):    # leftovers keep a temp name, never *.capsule
            path.unlink()
    assert kills == 6
