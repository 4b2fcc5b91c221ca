"""demo_driver: drives a running flashrt_policy node like a robot and a task planner would.

Streams observations, snapshots mid-episode, keeps going, restores and replays the same
observations (actions must match bit for bit), rolls back, forks, saves and loads a capsule,
checks refusals, resets the episode, and prints a report with the measured latencies.
Exits 0 only if every check held.
"""
import math
import os
import statistics
import sys
import time

import rclpy

from flashrt_ros.client import PolicyClient, spin_in_thread


def observations(count, dim, offset=0):
    """Smooth joint-like signals, the same for the same (offset, index)."""
    return [[math.sin(0.05 * (offset + t) * (1 + j % 7) + j) * (1 + 0.1 * j)
             for j in range(dim)] for t in range(count)]


def percentile(values, q):
    xs = sorted(values)
    return xs[min(len(xs) - 1, max(0, math.ceil(q * len(xs)) - 1))]


class Demo:
    def __init__(self, client, obs_dim):
        self.client = client
        self.obs_dim = obs_dim
        self.checks = []
        self.latency = {}       # service -> [(round trip s, device us)]

    def check(self, name, ok, detail=''):
        self.checks.append((name, bool(ok), detail))
        print(f'  [{"PASS" if ok else "FAIL"}] {name}' + (f': {detail}' if detail else ''),
              flush=True)

    def call(self, service, expect=True, **fields):
        response, seconds = self.client.call(service, **fields)
        ok = getattr(response, 'success', True)
        if ok:
            self.latency.setdefault(service, []).append(
                (seconds, getattr(response, 'latency_us', float('nan'))))
        if ok != expect:
            self.check(f'{service} {fields} answered success={ok}', False, response.message)
        return response

    def run_steps(self, obs):
        return [self.client.step(o) for o in obs]

    def run(self):
        c, dim = self.client, self.obs_dim
        print('flashrt_ros demo: stepping the policy through its topics', flush=True)
        episode = observations(100, dim)
        first = self.run_steps(episode)
        self.check('100 observations -> 100 actions', len(first) == 100)

        r = self.call('snapshot', name='mid', overwrite=True)
        self.check('snapshot mid-episode', r.success, r.message)
        branch = observations(50, dim, offset=1000)
        original = self.run_steps(branch)
        r = self.call('restore', name='mid')
        self.check('restore', r.success, r.message)
        replay = self.run_steps(branch)
        self.check('actions after restore equal the original run, bit for bit',
                   replay == original, f'{len(branch)} steps')

        tail = observations(10, dim, offset=2000)
        before = self.run_steps(tail)
        r = self.call('rollback', steps=10)
        self.check('rollback 10 steps', r.success, r.message)
        after = self.run_steps(tail)
        self.check('actions after rollback equal the original, bit for bit', after == before)
        r = self.call('rollback', expect=False, steps=100000)
        self.check('rollback deeper than the ring is refused', not r.success, r.message)

        r = self.call('fork', source='', target='branch', overwrite=True)
        self.check('fork the live state', r.success, r.message)
        r = self.call('fork', source='mid', target='mid_copy', overwrite=True)
        self.check('fork a capsule', r.success and r.capsule.parent == 'mid', r.message)

        r = self.call('save_capsule', name='mid', path='')
        self.check('save capsule to disk', r.success and os.path.isfile(r.path),
                   f'{r.path} ({r.nbytes} bytes)')
        saved = r.path
        r = self.call('delete_capsule', name='mid')
        self.check('delete capsule', r.success, r.message)
        r = self.call('load_capsule', path=os.path.basename(saved), name='mid_loaded',
                      overwrite=True)
        self.check('load capsule from disk', r.success, r.message)
        r = self.call('restore', name='mid_loaded')
        loaded = self.run_steps(branch)
        self.check('actions after save/load/restore equal the original', loaded == original)

        r = self.call('restore', expect=False, name='no_such_capsule')
        self.check('unknown capsule is refused', not r.success, r.message)
        r = self.call('save_capsule', expect=False, name='branch', path='../../etc/x')
        self.check('save outside the capsule directory is refused', not r.success, r.message)
        c.publish_only([float('nan')] * dim)
        c.publish_only([0.0] * (dim + 1))

        r = self.call('reset_episode')
        self.check('reset episode', r.success, r.message)
        again = self.run_steps(episode[:20])
        self.check('first actions of the new episode equal the first episode\'s',
                   again == first[:20])

        for _ in range(200):
            self.call('restore', name='mid_copy')
        listing = self.call('list_capsules')
        self.check('list capsules', len(listing.capsules) >= 3,
                   ', '.join(f'{i.name}({i.tier},{i.nbytes}B)' for i in listing.capsules))
        time.sleep(1.2)     # one status period, so the refused observations are reported
        status = c.last_status
        self.check('status counts the 2 refused observations',
                   status is not None and status.rejected_observations >= 2,
                   f'rejected_observations={getattr(status, "rejected_observations", None)}')
        self.report(status)
        return all(ok for _, ok, _ in self.checks)

    def report(self, status):
        print('\nlatency (round trip through ROS; the operation\'s latency_us inside the node)')
        print(f'  {"service":<16}{"calls":>6}{"rt p50 us":>12}{"rt p99 us":>12}'
              f'{"op p50 us":>12}')
        for service, samples in self.latency.items():
            rts = [s * 1e6 for s, _ in samples]
            ops = [u for _, u in samples if not math.isnan(u)]
            op = f'{statistics.median(ops):12.1f}' if ops else f'{"-":>12}'
            print(f'  {service:<16}{len(rts):>6}{statistics.median(rts):12.1f}'
                  f'{percentile(rts, 0.99):12.1f}{op}')
        if status is not None:
            print(f'\npolicy {status.policy} on {status.device}, cuda graph '
                  f'{status.cuda_graph}, step latency p50 {status.step_latency_p50_us:.1f} us '
                  f'p99 {status.step_latency_p99_us:.1f} us, {status.capsules} capsules')
        passed = sum(ok for _, ok, _ in self.checks)
        print(f'\n{passed} passed, {len(self.checks) - passed} failed')


def main(args=None):
    rclpy.init(args=args)
    node = rclpy.create_node('flashrt_demo_driver')
    node.declare_parameter('policy', '/flashrt_policy')
    node.declare_parameter('obs_dim', 48)
    client = PolicyClient(node, node.get_parameter('policy').value, timeout=30.0)
    executor = spin_in_thread(node)
    ok = False
    try:
        client.wait_ready(timeout=60.0)
        ok = Demo(client, node.get_parameter('obs_dim').value).run()
    except TimeoutError as exc:
        print(f'demo failed: {exc}', file=sys.stderr)
    finally:
        executor.shutdown()
        node.destroy_node()
        rclpy.try_shutdown()
    sys.exit(0 if ok else 1)


if __name__ == '__main__':
    main()
