"""Shared test set-up: markers that skip with a printed reason, ROS isolation, the fixtures
more than one test module uses, and test/ on sys.path for the helpers in test/support/.

Tests are in three layers: unit/ (no rclpy, no process of ours), ros/ (real rclpy nodes
in-process over Fast DDS), system/ (installed executables, launch, the ros2 CLI, SIGKILL,
pip, benchmark runs). Fixtures that need rclpy or mujoco import them when used, so the unit
layer runs without either.
"""
import fcntl
import logging
import os
import pathlib
import random
import sys
import tempfile

import pytest

TEST_DIR = pathlib.Path(__file__).resolve().parent
ROOT = TEST_DIR.parent
if str(TEST_DIR) not in sys.path:       # `from support.nodes import Harness`, in every layer
    sys.path.insert(0, str(TEST_DIR))


def _cuda_available():
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


_domain_lock = None      # held open for the whole test session


def _lock_domain(domain):
    """Holds domain's lock file until this process exits (the kernel drops the lock when the
    process dies, so a killed run frees its id); False when another run holds it."""
    global _domain_lock
    path = os.path.join(tempfile.gettempdir(), f'flashrt_ros_test_domain_{domain}.lock')
    handle = open(path, 'a')
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        handle.close()
        return False
    _domain_lock = handle
    return True


def _claim_domain():
    """A DDS domain id no other test run on this machine holds: each id has a lock file, and
    a run keeps the one it claims locked until it exits. Random order: runs seldom race for
    one id."""
    ids = list(range(1, 102))       # Fast DDS's default port mapping allows 0-232; keep clear
    random.shuffle(ids)
    for domain in ids:
        if _lock_domain(domain):
            return str(domain)
    raise RuntimeError('every ROS domain id 1-101 is held by another test run on this machine')


def pytest_configure(config):
    # Each test session gets a DDS domain of its own and stays on this host, so two runs on
    # one machine never talk to each other. A domain set by the caller is kept (CI, a
    # developer pinning one), but then the caller keeps parallel runs apart.
    if not os.environ.get('ROS_DOMAIN_ID'):
        os.environ['ROS_DOMAIN_ID'] = _claim_domain()
    elif os.environ['ROS_DOMAIN_ID'].isdigit() and \
            not _lock_domain(int(os.environ['ROS_DOMAIN_ID'])):
        # a pinned id is locked too, so that a run that claims one at random never takes it:
        # two runs in one domain call each other's nodes (the likely cause of a G1 test's
        # lifecycle call that timed out in a CI run beside pinned-domain runs)
        print(f'warning: ROS_DOMAIN_ID {os.environ["ROS_DOMAIN_ID"]} is held by another test '
              'run on this machine: their nodes can reach each other', file=sys.stderr)
    os.environ.setdefault('ROS_AUTOMATIC_DISCOVERY_RANGE', 'LOCALHOST')


def pytest_collection_modifyitems(config, items):
    skip_cuda = pytest.mark.skip(reason='needs a CUDA device: run on the GPU machine')
    for item in items:
        if 'cuda' in item.keywords and not _cuda_available():
            item.add_marker(skip_cuda)


def pytest_report_header(config):
    return 'cuda: %s' % ('available' if _cuda_available() else
                         'not available (cuda-marked tests are skipped)')


@pytest.fixture(autouse=True)
def _python_logging_as_it_was():
    """`launch` (imported by the launch and ros2-tool tests) installs a logger class whose
    loggers do not propagate; a logger made after that (the engine makes its own at its first
    warning) would never reach caplog in a later test. Put the class back after each test."""
    logger_class = logging.getLoggerClass()
    yield
    if logging.getLoggerClass() is not logger_class:
        logging.setLoggerClass(logger_class)


# -- fixtures shared by several test modules ---------------------------------------------------

@pytest.fixture
def ros():
    """rclpy initialised for one test; yields a list the test's Harnesses go in, closed (with
    rclpy) at the end. (test/system/test_ros_tools.py has a `ros` fixture of its own.)"""
    import rclpy
    rclpy.init()
    harnesses = []
    yield harnesses
    for h in harnesses:
        h.close()
    rclpy.shutdown()


@pytest.fixture
def make(ros, tmp_path):
    """make(params=RECURRENT, start=True, executor=None, timeout=30.0): a
    support.nodes.Harness, configured and active unless start=False, closed after the test;
    timeout: its client's, for each call and transition."""
    from support.nodes import Harness, RECURRENT

    def factory(params=RECURRENT, start=True, executor=None, timeout=30.0):
        h = Harness(tmp_path, params, start, executor, timeout)
        ros.append(h)
        return h
    return factory


from support.robots import G1  # noqa: E402 - test/ is on sys.path from here on


@pytest.fixture(scope='module')
def g1():
    """The Unitree G1 assets beside the repository (../shared/robots/unitree_g1): its upstream
    config, scene and policy; skips with the reason where they are absent."""
    if not G1.is_dir():
        pytest.skip(f'robot assets absent: {G1} (the G1 model, policy and config are kept in '
                    'shared/robots beside the repository, not in it)')
    torch = pytest.importorskip('torch', reason='torch missing: run tools/bootstrap.sh')
    from flashrt_ros.sim.robot_world import load_upstream_config
    cfg = load_upstream_config(G1 / 'deploy_mujoco_g1.yaml')
    # A 1x64 LSTM step is too small to share: a second torch thread made the 20 s walk 5x
    # slower on a busy 2-core machine (same results).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield dict(cfg=cfg, scene=G1 / 'scene.xml',
               policy=lambda: torch.jit.load(str(G1 / 'motion.pt')))
    torch.set_num_threads(threads)
