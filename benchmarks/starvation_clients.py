'''The busy planner of the starvation benchmark: client processes (each its own interpreter
and rclpy context) calling ~/snapshot, ~/restore and ~/list_capsules back to back, and what
they completed inside a streamed window.
'''

# Standard library only at import, as every starvation module: the client processes are
# spawned and import them again (starvation.py says why).
import multiprocessing
import os
import queue
import time

from .starvation_node import SERVICES

CALL_TIMEOUT_S = 30.0


def client_process(k, target, events, stop):
    '''One client process (its own rclpy context and node): snapshot(c<k>, overwrite),
    restore(c<k>), list_capsules, in a loop as fast as answers come, until `stop`. Each call
    is recorded as (service, completion time, round trip s, success); one 'ready' event after
    the first call, the records in one 'done' event at the end.'''
    from .starvation_node import default_scheduler

    default_scheduler()
    calls, errors = [], []
    try:
        import rclpy

        from flashrt_ros.client import call_service, spin_in_thread
        from flashrt_ros.interfaces import SERVICE_TYPES

        rclpy.init()
        node = rclpy.create_node(f'starvation_client_{k}_{os.getpid()}')
        spinner = spin_in_thread(node)
        try:
            clients = {n: node.create_client(SERVICE_TYPES[n], f'{target}/{n}')
                       for n in SERVICES}
            for name, cli in clients.items():
                if not cli.wait_for_service(timeout_sec=120.0):
                    raise TimeoutError(f'{target}/{name} did not appear')
            requests = {'snapshot': dict(name=f'c{k}', overwrite=True),
                        'restore': dict(name=f'c{k}'), 'list_capsules': {}}
            while not stop.is_set():
                for name in SERVICES:
                    request = SERVICE_TYPES[name].Request(**requests[name])
                    try:
                        response, seconds = call_service(clients[name], request,
                                                         CALL_TIMEOUT_S)
                    except TimeoutError as exc:
                        errors.append(str(exc))
                        continue
                    ok = bool(getattr(response, 'success', True))
                    if not ok:
                        errors.append(f'{name}: {response.message}')
                    calls.append((name, time.monotonic(), seconds, ok))
                    if len(calls) == 1:
                        events.put(('ready', k))
                    if stop.is_set():
                        break
        finally:
            spinner.shutdown()
            node.destroy_node()
            rclpy.try_shutdown()
    except Exception as exc:  # noqa: B902 - reported to the parent, which names the client
        errors.append(f'client {k} failed: {exc!r}')
        events.put(('failed', k, repr(exc)))
    events.put(('done', k, calls, errors[:20], len(errors)))


class Clients:
    '''n client processes ('spawn': each a fresh interpreter, its own rclpy context).'''

    def __init__(self, n, target):
        ctx = multiprocessing.get_context('spawn')
        self.events, self.stop = ctx.Queue(), ctx.Event()
        self.procs = [ctx.Process(target=client_process, args=(k, target, self.events,
                                                               self.stop), daemon=True)
                      for k in range(n)]
        self.done = {}

    def start(self, timeout):
        '''Starts them; returns when each has completed a first call.'''
        for p in self.procs:
            p.start()
        ready, deadline = set(), time.monotonic() + timeout
        while len(ready) < len(self.procs):
            try:
                event = self.events.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                raise TimeoutError(f'{len(ready)} of {len(self.procs)} clients made a first '
                                   f'call in {timeout} s')
            if event[0] == 'ready':
                ready.add(event[1])
            elif event[0] == 'failed':
                raise RuntimeError(f'client {event[1]} failed: {event[2]}')
            elif event[0] == 'done':
                self.done[event[1]] = event

    def finish(self, timeout=60.0):
        '''Stops them and collects every call they recorded.'''
        self.stop.set()
        deadline = time.monotonic() + timeout
        while len(self.done) < len(self.procs) and time.monotonic() < deadline:
            try:
                event = self.events.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                break
            if event[0] == 'done':
                self.done[event[1]] = event
        for p in self.procs:
            if p.pid is None:
                continue        # start() failed before this one was started
            p.join(timeout=max(1.0, deadline - time.monotonic()))
            if p.is_alive():
                p.terminate()
                p.join(timeout=5.0)
            if p.is_alive():
                # rclpy's SIGTERM handler can leave a client spinning on a shut-down context
                # (seen: one at a full core for 25 minutes, and this process hung at exit
                # joining it): never leave one behind
                p.kill()
                p.join(timeout=5.0)
        return self.done

    def calls_in(self, window):
        '''Service calls completed inside the streamed window: count, rate, per service,
        failures, round trips (CLOCK_MONOTONIC is one clock for every process).'''
        from .timing import stats

        t0, t1 = window
        inside = [c for e in self.done.values() for c in e[2] if t0 <= c[1] < t1]
        errors = [m for e in self.done.values() for m in e[3]]
        return {'clients': len(self.procs), 'clients_reporting': len(self.done),
                'completed': len(inside), 'per_s': len(inside) / (t1 - t0),
                'by_service': {n: sum(c[0] == n for c in inside) for n in SERVICES},
                'unsuccessful': sum(not c[3] for c in inside),
                'errors': sum(e[4] for e in self.done.values()), 'error_examples': errors[:5],
                'round_trip_us': stats([c[2] * 1e6 for c in inside])}
