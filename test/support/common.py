"""Deterministic observations and a wait on a condition; no ROS, no torch."""
import math
import time


def obs(t, dim=6):
    """A deterministic observation for index t."""
    return [math.sin(0.1 * t * (1 + j) + j) * (1 + 0.1 * j) for j in range(dim)]


def obs_range(start, count, dim=6):
    return [obs(t, dim) for t in range(start, start + count)]


def wait_for(predicate, timeout=30.0, what='condition'):
    """Polls predicate() until true; TimeoutError naming `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f'timed out waiting for {what}')
        time.sleep(0.01)
