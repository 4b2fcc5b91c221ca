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


def publish_until(publish, predicate, timeout=30.0, what='condition', every=0.5):
    """publish() until predicate() holds, again every `every` s: a best-effort topic (a
    camera's) may lose a message, and the next one takes its place."""
    deadline = time.monotonic() + timeout
    while True:
        publish()
        resend = min(deadline, time.monotonic() + every)
        while time.monotonic() < resend:
            if predicate():
                return
            time.sleep(0.01)
        if time.monotonic() >= deadline:
            raise TimeoutError(f'timed out waiting for {what}')
