"""Shared test set-up: markers that skip with a printed reason, and ROS isolation."""
import fcntl
import os
import random
import tempfile

import pytest


def _cuda_available():
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


_domain_lock = None      # held open for the whole test session


def _claim_domain():
    """A DDS domain id no other test run on this machine holds: each id has a lock file, and
    a run keeps the one it claims locked until it exits (the kernel drops the lock when the
    process dies, so a killed run frees its id). Random order: runs seldom race for one id."""
    global _domain_lock
    ids = list(range(1, 102))       # Fast DDS's default port mapping allows 0-232; keep clear
    random.shuffle(ids)
    for domain in ids:
        path = os.path.join(tempfile.gettempdir(), f'flashrt_ros_test_domain_{domain}.lock')
        handle = open(path, 'a')
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            handle.close()
            continue
        _domain_lock = handle
        return str(domain)
    raise RuntimeError('every ROS domain id 1-101 is held by another test run on this machine')


def pytest_configure(config):
    # Each test session gets a DDS domain of its own and stays on this host, so two runs on
    # one machine never talk to each other. A domain set by the caller is kept (CI, a
    # developer pinning one), but then the caller keeps parallel runs apart.
    if 'ROS_DOMAIN_ID' not in os.environ:
        os.environ['ROS_DOMAIN_ID'] = _claim_domain()
    os.environ.setdefault('ROS_AUTOMATIC_DISCOVERY_RANGE', 'LOCALHOST')


def pytest_collection_modifyitems(config, items):
    skip_cuda = pytest.mark.skip(reason='needs a CUDA device: run on the GPU machine')
    for item in items:
        if 'cuda' in item.keywords and not _cuda_available():
            item.add_marker(skip_cuda)


def pytest_report_header(config):
    return 'cuda: %s' % ('available' if _cuda_available() else
                         'not available (cuda-marked tests are skipped)')
