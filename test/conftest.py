"""Shared test set-up: markers that skip with a printed reason, and ROS isolation."""
import os
import random

import pytest


def _cuda_available():
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def pytest_configure(config):
    # Each test session gets its own DDS domain and stays on this host, so two runs on one
    # machine (or a developer's running demo) never talk to each other.
    os.environ.setdefault('ROS_DOMAIN_ID', str(random.randint(1, 100)))
    os.environ.setdefault('ROS_AUTOMATIC_DISCOVERY_RANGE', 'LOCALHOST')


def pytest_collection_modifyitems(config, items):
    skip_cuda = pytest.mark.skip(reason='needs a CUDA device: run on the GPU machine')
    for item in items:
        if 'cuda' in item.keywords and not _cuda_available():
            item.add_marker(skip_cuda)


def pytest_report_header(config):
    return 'cuda: %s' % ('available' if _cuda_available() else
                         'not available (cuda-marked tests are skipped)')
