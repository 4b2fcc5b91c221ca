'''Does the policy node's control loop survive a busy planner? Observations streamed at a
fixed rate to the installed `policy_node` (its own process, as deployed), first alone, then
while client processes call ~/snapshot, ~/restore and ~/list_capsules as fast as answers come.

The policy is a TorchScript MLP (torch.jit.script, as exporters write) whose action element 0
is its observation element 0, the sequence number, so every action names its observation:
loss and latency are counted per message, not inferred from counts. `--baseline REF` measures
the node of another commit the same way, in the same run, side by side.

  python -m benchmarks.starvation                            # cpu, 20 s loaded, 8 clients
  python -m benchmarks.starvation --baseline 0ddb6a1 --out /tmp/starv

Targets (printed, and in the results): loaded loss < 1 % and loaded p99 < 2x unloaded p99.
Writes <out>/<date>-<device>-starvation-<commit>.{json,md}. See benchmarks/README.md.
'''

# Imports here are the standard library only: the client processes are spawned and import
# this module again, and each of them should cost the machine an rclpy node, not a torch.
import argparse
import array
import importlib.metadata
import json
import math
import multiprocessing
import os
import pathlib
import queue
import random
import re
import subprocess
import sys
import tempfile
import threading
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
OBS_DIM, ACT_DIM, HIDDEN = 48, 12, 256
SERVICES = ('snapshot', 'restore', 'list_capsules')
QOS_DEPTH = 100
DRAIN_S = 1.0           # an action later than this after the last send counts as lost
LOSS_TARGET_PCT = 1.0
P99_TARGET_RATIO = 2.0
CALL_TIMEOUT_S = 30.0


def log(msg):
    print(msg, flush=True)


# ------------------------------------------------------------------ the echo policy

def write_echo_policy(path, seed=0):
    '''A scripted MLP (48 -> 256 -> 256 -> 12, ELU, seeded weights) whose action element 0 is
    the observation's element 0, exactly: the MLP still runs every step (the node does the
    work of a real policy), only its first output is replaced.'''
    import torch

    class EchoPolicy(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(seed)
            self.mlp = torch.nn.Sequential(
                torch.nn.Linear(OBS_DIM, HIDDEN), torch.nn.ELU(),
                torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.ELU(),
                torch.nn.Linear(HIDDEN, ACT_DIM))

        def forward(self, obs):
            return torch.cat([obs[..., :1], self.mlp(obs)[..., 1:]], -1)

    module = torch.jit.script(EchoPolicy())
    module.save(str(path))
    # the file as the node will read it: the echo must survive save and load
    loaded = torch.jit.load(str(path))
    probe = torch.zeros(1, OBS_DIM)
    probe[0, 0] = float(2 ** 24 - 1)
    if loaded(probe)[0, 0].item() != float(2 ** 24 - 1):
        raise RuntimeError(f'{path}: action element 0 does not echo observation element 0')
    return {'file': pathlib.Path(path).name, 'format': 'TorchScript (torch.jit.script)',
            'layers': f'{OBS_DIM} -> {HIDDEN} -> {HIDDEN} -> {ACT_DIM}, ELU',
            'seed': seed, 'echo': 'action[0] = observation[0] (the sequence number)'}


# ------------------------------------------------------------------ the node under test

def node_parameters(name, device, capsule_dir, policy_file):
    return ['--ros-args', '-r', f'__node:={name}', '-p', f'device:={device}',
            '-p', f'capsule_dir:={capsule_dir}', '-p', 'policy_type:=mlp',
            '-p', f'policy_file:={policy_file}', '-p', f'obs_dim:={OBS_DIM}',
            '-p', f'act_dim:={ACT_DIM}']


def installed_node():
    '''How to start the installed executable (command, environment, what it runs), or None
    when it is not installed.'''
    from .ros_e2e import _executable     # here: ros_e2e imports torch (see the imports)

    exe = _executable()
    if exe is None:
        return None
    found = re.search(r'from (\S+) import main', pathlib.Path(exe).read_text())
    return {'command': [exe], 'env': {}, 'cwd': None, 'source': f'installed executable {exe}',
            'module': found.group(1) if found else '?',
            'installed_vs_checkout': installed_vs_checkout(pathlib.Path(exe).parents[2])}


def installed_vs_checkout(prefix):
    '''The checkout's flashrt_ros/*.py files that the install under `prefix` holds otherwise
    (or lacks): the install is a copy made at build time, so the node measured can be older
    than the commit named in the results.'''
    trees = sorted(prefix.glob('lib/python*/site-packages/flashrt_ros'))
    if not trees:
        return {'installed_tree': None, 'differs': ['no flashrt_ros under ' + str(prefix)]}
    differs = []
    for mine in sorted((ROOT / 'flashrt_ros').rglob('*.py')):
        rel = mine.relative_to(ROOT / 'flashrt_ros')
        theirs = trees[0] / rel
        if not theirs.exists() or theirs.read_bytes() != mine.read_bytes():
            differs.append(str(rel))
    return {'installed_tree': str(trees[0]), 'differs': differs}


def baseline_node(ref, workdir):
    '''The node of git commit `ref`: its flashrt_ros tree extracted beside the install (which
    provides the generated msg/srv: flashrt_ros/__init__.py merges the two trees).'''
    if (pathlib.Path(ref) / 'flashrt_ros').is_dir():
        # an extracted tree (a machine without git or the repository's history); its
        # COMMIT file, if any, names the commit
        tree = pathlib.Path(ref).resolve()
        named = tree / 'COMMIT'
        sha = named.read_text().strip() if named.exists() else tree.name
    else:
        sha = subprocess.run(['git', 'rev-parse', '--short', ref], cwd=ROOT,
                             capture_output=True, text=True, check=True).stdout.strip()
        tree = pathlib.Path(tempfile.mkdtemp(prefix=f'starvation-{sha}-', dir=workdir))
        archive = subprocess.run(['git', 'archive', ref, 'flashrt_ros'], cwd=ROOT,
                                 capture_output=True, check=True).stdout
        subprocess.run(['tar', '-x', '-C', str(tree)], input=archive, check=True)
    module = 'flashrt_ros.policy_node' if (tree / 'flashrt_ros' / 'policy_node.py').exists() \
        else 'flashrt_ros.node.policy_node'
    path = os.environ.get('PYTHONPATH', '')
    # cwd = the tree: `python -c` puts the working directory first on sys.path, and started
    # from the checkout it would import the checkout's flashrt_ros instead
    return {'command': [sys.executable, '-c', f'from {module} import main; main()'],
            'env': {'PYTHONPATH': str(tree) + (os.pathsep + path if path else '')},
            'cwd': str(tree), 'source': f'git archive {ref} ({sha}) flashrt_ros',
            'module': module, 'commit': sha}


def _start_node(spec, args, log_path):
    env = dict(os.environ, **spec['env'])
    log_file = open(log_path, 'w')
    proc = subprocess.Popen(spec['command'] + args, stdout=log_file, stderr=subprocess.STDOUT,
                            env=env, cwd=spec['cwd'])
    return proc, log_file


# ------------------------------------------------------------------ the planner's stream

class Stream:
    '''This process's side of the control loop: observations published on a paced thread,
    actions taken by a subscription; send and receive times (time.monotonic, one process)
    per sequence number.'''

    def __init__(self, rcl_node, target, rate):
        from rclpy.qos import HistoryPolicy, QoSProfile, ReliabilityPolicy
        from std_msgs.msg import Float32MultiArray

        from flashrt_ros.executors import publisher_events

        self.node, self.target, self.period = rcl_node, target, 1.0 / rate
        self._msg_type = Float32MultiArray
        qos = QoSProfile(history=HistoryPolicy.KEEP_LAST, depth=QOS_DEPTH,
                         reliability=ReliabilityPolicy.RELIABLE)
        self.pub = rcl_node.create_publisher(Float32MultiArray, f'{target}/observation', qos,
                                             event_callbacks=publisher_events())
        self.sub = rcl_node.create_subscription(Float32MultiArray, f'{target}/action',
                                                self._on_action, qos)
        rng = random.Random(0)
        self._rest = [rng.uniform(-1.0, 1.0) for _ in range(OBS_DIM - 1)]
        self.next_seq = 1
        self._lock = threading.Lock()
        self.received = {}      # element 0 (float) -> receive time; the first arrival kept
        self.duplicates = 0
        self._arrived = threading.Condition(self._lock)

    def _on_action(self, msg):
        now = time.monotonic()
        value = float(msg.data[0]) if len(msg.data) else math.nan
        with self._lock:
            if value in self.received:
                self.duplicates += 1
            else:
                self.received[value] = now
            self._arrived.notify_all()

    def _publish(self, seq):
        msg = self._msg_type()
        msg.data = array.array('f', [float(seq)] + self._rest)
        self.pub.publish(msg)

    def wait_ready(self, timeout):
        '''The node's capsule services in the graph and both topics matched, then one echo.'''
        from flashrt_ros.client import wait_matched

        deadline = time.monotonic() + timeout
        for name in SERVICES:
            while self.node.count_services(f'{self.target}/{name}') == 0:
                if time.monotonic() > deadline:
                    raise TimeoutError(f'{self.target}/{name} did not appear in {timeout} s')
                time.sleep(0.05)
        wait_matched([self.pub], [self.sub], deadline,
                     f'{self.target} observation/action did not connect in {timeout} s')
        while True:         # one observation answered: the node is active and stepping
            seq = self._take_seq()
            self._publish(seq)
            with self._lock:
                if self._arrived.wait_for(lambda: float(seq) in self.received, 1.0):
                    return
            if time.monotonic() > deadline:
                raise TimeoutError(f'{self.target} answered no observation in {timeout} s')

    def _take_seq(self):
        seq, self.next_seq = self.next_seq, self.next_seq + 1
        if seq >= 2 ** 24:      # float32 holds integers exactly only below 2**24
            raise OverflowError('sequence numbers ran past 2**24')
        return seq

    def run(self, seconds):
        '''Streams for `seconds` on a thread, paced: message k at t0 + k * period (a late
        message goes at once; the schedule is kept, not restarted). Returns the sends,
        seq -> (scheduled time, send time), and the streamed window (t0, t0 + seconds).'''
        sends, window, count = {}, [], int(round(seconds / self.period))

        def loop():
            t0 = time.monotonic()
            for k in range(count):
                at = t0 + k * self.period
                delay = at - time.monotonic()
                if delay > 0:
                    time.sleep(delay)
                seq = self._take_seq()
                sends[seq] = (at, time.monotonic())
                self._publish(seq)
            window.extend((t0, t0 + count * self.period))
        thread = threading.Thread(target=loop, name='observation-stream', daemon=True)
        thread.start()
        thread.join()
        return sends, tuple(window)

    def result(self, sends, window, drain_s=DRAIN_S):
        '''Waits until `drain_s` after the last send, then counts: lost = sent without an
        action by then; latency = receive - send per observation answered.'''
        from .timing import stats

        last = max(sent for _, sent in sends.values())
        time.sleep(max(0.0, last + drain_s - time.monotonic()))
        with self._lock:
            received = dict(self.received)
        latencies, lags, lost = [], [], []
        for seq, (at, sent) in sends.items():
            lags.append((sent - at) * 1e6)
            got = received.get(float(seq))
            if got is None:
                lost.append(seq)
            else:
                latencies.append((got - sent) * 1e6)
        sent = len(sends)
        return {'sent': sent, 'received': sent - len(lost), 'lost': len(lost),
                'lost_pct': 100.0 * len(lost) / sent if sent else math.nan,
                'latency_us': stats(latencies),
                # the sender's own lateness against its schedule: a starved sender shows
                # here, not as the node's latency
                'send_lag_us': stats(lags),
                'window_s': window[1] - window[0], 'lost_seqs': lost}

    def echo_check(self, sent_seqs):
        '''Every action's element 0 is an integer this stream sent (the echo holds).'''
        with self._lock:
            values = list(self.received)
            duplicates = self.duplicates
        foreign = [v for v in values if v not in sent_seqs]
        return {'actions': len(values), 'echoing_a_sent_sequence': len(values) - len(foreign),
                'not_echoing': len(foreign), 'not_echoing_examples': foreign[:5],
                'duplicates': duplicates}

    def close(self):
        self.node.destroy_publisher(self.pub)
        self.node.destroy_subscription(self.sub)


# ------------------------------------------------------------------ CPU accounting

def cpu_sample(pids):
    '''(time, machine ticks, idle ticks, {name: ticks of those processes}) from /proc, or
    None where there is no /proc. The machine is shared: a phase's figures are read next to
    how busy the cores were and what the node itself got.'''
    try:
        with open('/proc/stat') as f:
            ticks = [int(x) for x in f.readline().split()[1:9]]
    except OSError:
        return None
    used = {}
    for name, group in pids.items():
        used[name] = 0
        for pid in group:
            try:
                with open(f'/proc/{pid}/stat') as f:
                    fields = f.read().rsplit(')', 1)[1].split()
                used[name] += int(fields[11]) + int(fields[12])    # utime, stime
            except (OSError, IndexError, ValueError):
                continue        # a process that ended: its last ticks are not counted
    return time.monotonic(), sum(ticks), ticks[3] + ticks[4], used


def cpu_use(before, after):
    '''Machine busy % (of all cores) and each process group's % of one core between two
    samples.'''
    if before is None or after is None:
        return {}
    seconds, total = after[0] - before[0], after[1] - before[1]
    hz = os.sysconf('SC_CLK_TCK')
    out = {'machine_busy_pct': 100.0 * (total - (after[2] - before[2])) / max(total, 1)}
    for name in after[3]:
        out[f'{name}_pct_of_a_core'] = 100.0 * (after[3][name] - before[3].get(name, 0)) / \
            hz / seconds
    return out


# ------------------------------------------------------------------ the busy planner

def client_process(k, target, events, stop):
    '''One client process (its own rclpy context and node): snapshot(c<k>, overwrite),
    restore(c<k>), list_capsules, in a loop as fast as answers come, until `stop`. Each call
    is recorded as (service, completion time, round trip s, success); one 'ready' event after
    the first call, the records in one 'done' event at the end.'''
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


# ------------------------------------------------------------------ one node, both phases

def measure(label, spec, cfg, rcl_node, workdir):
    '''One node in its own process: warm-up, unloaded phase, loaded phase. A node that does
    not come up, or clients that do not, leave a `failed` reason beside what was measured.'''
    from flashrt_ros.client import spin_in_thread

    from .ros_e2e import _stop

    token = re.sub(r'[^A-Za-z0-9_]+', '_', label)       # node and file names
    name = f'starvation_{token}_{os.getpid()}'
    target = '/' + name
    capsules = tempfile.mkdtemp(prefix=f'capsules-{token}-', dir=workdir)
    log_path = pathlib.Path(workdir) / f'{token}-node.log'
    args = node_parameters(name, cfg['device'], capsules, cfg['policy_file']) + [
        a for p in spec.get('params', ()) for a in ('-p', p)]
    phases, lost = {}, {}
    out = {'source': spec['source'], 'module': spec['module'], 'node_name': name,
           'log': str(log_path), 'phases': phases}
    for key in ('commit', 'installed_vs_checkout'):
        if key in spec:
            out[key] = spec[key]
    proc, node_log = _start_node(spec, args, log_path)
    stream = Stream(rcl_node, target, cfg['rate'])
    spinner = spin_in_thread(rcl_node)
    clients = None

    try:
        log(f'[{label}] {spec["source"]}: waiting for {target}')
        stream.wait_ready(timeout=180.0)
        log(f'[{label}] warm-up {cfg["warmup_s"]:g} s (not counted)')
        stream.run(cfg['warmup_s'])
        log(f'[{label}] unloaded: {cfg["unloaded_s"]:g} s at {cfg["rate"]:g} Hz')
        load, pids = os.getloadavg()[0], {'node': [proc.pid], 'planner': [os.getpid()]}
        before = cpu_sample(pids)
        sends, window = stream.run(cfg['unloaded_s'])
        cpu = cpu_use(before, cpu_sample(pids))
        unloaded = stream.result(sends, window)
        lost['unloaded'] = unloaded.pop('lost_seqs')
        unloaded.update(load_average_1m=load, cpu=cpu,
                        service_calls={'completed': 0, 'per_s': 0.0})
        phases['unloaded'] = unloaded
        log(f'[{label}] loaded: starting {cfg["clients"]} clients')
        clients = Clients(cfg['clients'], target)
        clients.start(timeout=180.0)
        load = os.getloadavg()[0]
        log(f'[{label}] loaded: {cfg["seconds"]:g} s at {cfg["rate"]:g} Hz, '
            f'{cfg["clients"]} clients calling')
        pids['clients'] = [p.pid for p in clients.procs]
        before = cpu_sample(pids)
        sends, window = stream.run(cfg['seconds'])
        cpu = cpu_use(before, cpu_sample(pids))
        clients.stop.set()      # the stream is over; the drain runs while they wind down
        loaded = stream.result(sends, window)
        clients.finish()
        lost['loaded'] = loaded.pop('lost_seqs')
        loaded.update(load_average_1m=load, cpu=cpu, service_calls=clients.calls_in(window))
        phases['loaded'] = loaded
        out['targets'] = targets(phases)
        log(f'[{label}] ' + summary(phases, out['targets']))
    except (TimeoutError, RuntimeError, OSError) as exc:
        out['failed'] = str(exc)
        log(f'[{label}] FAILED: {exc} (node log: {log_path})')
    finally:
        if clients is not None and len(clients.done) < len(clients.procs):
            clients.finish(timeout=10.0)
        # a lost action that came after all (e.g. while the clients were stopping) was late
        # beyond the drain, not dropped: said apart
        time.sleep(0.5)
        with stream._lock:
            arrived = set(stream.received)
        for key, seqs in lost.items():
            phases[key]['lost_arrived_later'] = sum(float(s) in arrived for s in seqs)
        out['echo'] = stream.echo_check({float(s) for s in range(1, stream.next_seq)})
        spinner.shutdown()
        stream.close()
        _stop(proc, node_log)
        out['exit_code'] = proc.returncode
        out['log_tail'] = log_path.read_text(errors='replace').splitlines()[-15:]
    return out


def targets(phases):
    loaded, unloaded = phases['loaded'], phases['unloaded']
    ratio = loaded['latency_us']['p99'] / unloaded['latency_us']['p99']
    loss_ok = loaded['lost_pct'] < LOSS_TARGET_PCT
    p99_ok = ratio < P99_TARGET_RATIO
    out = {'loaded_loss_pct': loaded['lost_pct'], 'loss_below_1pct': bool(loss_ok),
           'loaded_over_unloaded_p99': ratio, 'p99_below_2x_unloaded': bool(p99_ok),
           'passed': bool(loss_ok and p99_ok),
           # the verdict stands as measured; this says whether the reference it is judged
           # against was itself sound
           'unloaded_kept_up': bool(unloaded['lost_pct'] < LOSS_TARGET_PCT)}
    if not out['unloaded_kept_up']:
        out['note'] = (f'the unloaded phase already lost {unloaded["lost_pct"]:.1f} %: the node '
                       'did not keep up with the rate without clients on this machine (see '
                       'the CPU columns), so its latency is set by full queues (keep-last '
                       f'{QOS_DEPTH} at {unloaded["sent"] / unloaded["window_s"]:g} Hz: '
                       f'{QOS_DEPTH * unloaded["window_s"] / unloaded["sent"]:g} s per queue, '
                       'publisher and subscription) and the p99 ratio compares two saturated '
                       'phases')
    return out


def summary(phases, t):
    parts = [f'{n}: sent {p["sent"]}, lost {p["lost"]} ({p["lost_pct"]:.2f} %), p50/p99/max '
             f'{_ms(p["latency_us"]["p50"])}/{_ms(p["latency_us"]["p99"])}/'
             f'{_ms(p["latency_us"]["max"])} ms, {p["service_calls"]["per_s"]:.0f} calls/s'
             for n, p in phases.items()]
    return '; '.join(parts) + f' -> {"PASS" if t["passed"] else "FAIL"}'


def _ms(us):
    return f'{us / 1000:.2f}' if math.isfinite(us) else 'n/a'


def _pct(x):
    return 'n/a' if x is None else f'{x:.0f}'


# ------------------------------------------------------------------ report

def environment(device, commit):
    import torch

    from .run import environment as base_environment
    env = base_environment(torch.device(device), 'starvation', commit)
    env.update(cpu_count=os.cpu_count(), ros_domain_id=os.environ.get('ROS_DOMAIN_ID', ''),
               discovery_range=os.environ.get('ROS_AUTOMATIC_DISCOVERY_RANGE', ''),
               # the nodes inherit it: torch's intra-op threads are a large part of a CPU
               # node's cost (README: "Control loop under a busy planner")
               omp_num_threads=os.environ.get('OMP_NUM_THREADS', ''))
    try:
        import rclpy
        env.update(rclpy=importlib.metadata.version('rclpy'),
                   rmw=rclpy.get_rmw_implementation_identifier())
    except ImportError:     # a skipped run still says where it was skipped
        env.update(rclpy='not importable', rmw='')
    if env['commit_source'] == 'git':
        # what the measured tree holds beyond that commit (the lead's work in progress)
        env['modified'] = subprocess.run(
            ['git', 'status', '--porcelain', '--', 'flashrt_ros'], cwd=ROOT,
            capture_output=True, text=True).stdout.splitlines()
    return env


def render(result):
    env, p = result['environment'], result['parameters']
    md = [f'# Control loop under a busy planner ({env["date"][:10]})', '',
          f'{env["device_name"]} ({env["device"]}), {env.get("cpu_count", "?")} CPUs, load '
          f'{env["load_average_1m"]:.2f} at start, torch {env["torch"]}, rclpy '
          f'{env.get("rclpy", "?")} ({env.get("rmw", "?")}), Python {env["python"]}, '
          f'flashrt_ros {env["git_commit"]}{" (dirty)" if env["git_dirty"] else ""}', '']
    if 'skipped' in result:
        return '\n'.join(md + [f'Skipped: {result["skipped"]}', ''])
    md += [f'Stream: {p["rate"]:g} Hz, Float32MultiArray[{OBS_DIM}] -> [{ACT_DIM}], reliable, '
           f'keep-last {QOS_DEPTH}; warm-up {p["warmup_s"]} s, unloaded {p["unloaded_s"]} s, '
           f'loaded {p["seconds"]} s with {p["clients"]} client processes calling '
           f'snapshot/restore/list_capsules back to back; lost = no action {DRAIN_S:g} s '
           f'after the last send. Policy: {result["policy"]["layers"]} TorchScript, '
           f'action[0] = observation[0].', '',
           'CPU: machine = busy share of all cores over the phase; node = the node process, '
           '% of one core.', '',
           '| node | phase | sent | lost | lost % | p50 ms | p99 ms | max ms | '
           'sender late p99 ms | service calls/s | machine CPU % | node CPU % |',
           '|---|---|---|---|---|---|---|---|---|---|---|---|']
    for label, node in result['nodes'].items():
        for phase, r in node['phases'].items():
            lat = r['latency_us']
            md.append(f'| {label} | {phase} | {r["sent"]} | {r["lost"]} | '
                      f'{r["lost_pct"]:.2f} | {_ms(lat["p50"])} | {_ms(lat["p99"])} | '
                      f'{_ms(lat["max"])} | {_ms(r["send_lag_us"]["p99"])} | '
                      f'{r["service_calls"]["per_s"]:.0f} | '
                      f'{_pct(r["cpu"].get("machine_busy_pct"))} | '
                      f'{_pct(r["cpu"].get("node_pct_of_a_core"))} |')
        if 'failed' in node:
            md.append(f'| {label} | failed: {node["failed"]} | | | | | | | | | | |')
    md += ['', f'Targets: loaded loss < {LOSS_TARGET_PCT:g} %, loaded p99 < '
               f'{P99_TARGET_RATIO:g}x unloaded p99.', '',
           '| node | source | loaded loss % | loaded p99 / unloaded p99 | verdict |',
           '|---|---|---|---|---|']
    for label, node in result['nodes'].items():
        t = node.get('targets')
        if t is None:
            md.append(f'| {label} | {node["source"]} | | | FAIL (did not run) |')
            continue
        md.append(f'| {label} | {node["source"]} ({node["module"]}) | '
                  f'{t["loaded_loss_pct"]:.2f} | {t["loaded_over_unloaded_p99"]:.2f}x | '
                  f'{"PASS" if t["passed"] else "FAIL"} |')
    md += [f'\n{label}: {node["targets"]["note"]}.' for label, node in result['nodes'].items()
           if 'note' in node.get('targets', {})]
    for label, node in result['nodes'].items():
        differs = node.get('installed_vs_checkout', {}).get('differs')
        if differs:
            md.append(f'\n{label}: the installed tree is not the checkout measured: '
                      f'{len(differs)} file(s) differ ({", ".join(differs[:6])}'
                      f'{", ..." if len(differs) > 6 else ""}).')
    return '\n'.join(md) + '\n'


def write(result, out_dir):
    env = result['environment']
    from .run import device_slug
    commit = re.sub(r'[^A-Za-z0-9]+', '-', env['git_commit']).strip('-') or 'unknown'
    if not re.fullmatch(r'[0-9a-f]{4,40}', commit):
        commit = 'unknown'
    stem = pathlib.Path(out_dir) / (f'{env["date"][:10]}-{device_slug(env)}-starvation-'
                                    f'{commit}')
    stem.parent.mkdir(parents=True, exist_ok=True)
    stem.with_suffix('.json').write_text(json.dumps(result, indent=1, default=str) + '\n')
    table = render(result)
    stem.with_suffix('.md').write_text(table)
    log('')
    log(table)
    log(f'written: {stem}.json, {stem}.md')
    return stem


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    ap.add_argument('--device', default='cpu', choices=('cpu', 'cuda'))
    ap.add_argument('--seconds', type=float, default=20.0, help='loaded phase (s)')
    ap.add_argument('--unloaded-seconds', type=float, default=10.0, help='unloaded phase (s)')
    ap.add_argument('--warmup', type=float, default=2.0, help='uncounted stream first (s)')
    ap.add_argument('--clients', type=int, default=8, help='client processes calling services')
    ap.add_argument('--rate', type=float, default=200.0, help='observations per second')
    ap.add_argument('--baseline', default='', metavar='REF|DIR',
                    help='also measure the node of this git commit, side by side')
    ap.add_argument('--param', action='append', default=[], metavar='NAME:=VALUE',
                    help='also measure the current node with this parameter (repeatable)')
    ap.add_argument('--commit', default='',
                    help='the flashrt_ros commit of this tree, when it is not a git checkout')
    ap.add_argument('--out', default=str(ROOT / 'benchmarks' / 'results'),
                    help='output directory')
    args = ap.parse_args(argv)
    params = {'device': args.device, 'seconds': args.seconds, 'unloaded_s': args.unloaded_seconds,
              'warmup_s': args.warmup, 'clients': args.clients, 'rate': args.rate,
              'drain_s': DRAIN_S, 'qos': f'reliable, keep-last {QOS_DEPTH}',
              'obs_dim': OBS_DIM, 'act_dim': ACT_DIM, 'baseline': args.baseline,
              'node_params': args.param,
              'command': 'python -m benchmarks.starvation ' + ' '.join(
                  sys.argv[1:] if argv is None else argv)}
    try:
        import rclpy
    except ImportError as exc:
        return skipped(f'rclpy not importable: {exc!r}', args, params)
    spec = installed_node()
    if spec is None:
        return skipped('policy_node executable not found on AMENT_PREFIX_PATH (source '
                       'tools/env.sh)', args, params)
    env = environment(args.device, args.commit)
    workdir = tempfile.mkdtemp(prefix='frt-starvation-')
    policy_file = pathlib.Path(workdir) / 'echo_policy.pt'
    result = {'environment': env, 'parameters': params,
              'policy': write_echo_policy(policy_file), 'nodes': {}}
    cfg = dict(params, policy_file=str(policy_file))
    specs = {}
    if args.baseline:
        try:
            specs['baseline'] = baseline_node(args.baseline, workdir)
        except subprocess.CalledProcessError as exc:
            log(f'--baseline {args.baseline}: {exc} {(exc.stderr or b"").decode()[-500:]}')
            return 2
    specs['current'] = spec
    if args.param:      # the same node again, with these parameters, side by side
        specs['current ' + ' '.join(args.param)] = dict(spec, params=args.param)
    log(f'starvation: {args.rate:g} Hz, {args.clients} clients, {args.device}, logs in '
        f'{workdir}')
    rclpy.init()
    try:
        for label, node_spec in specs.items():
            token = re.sub(r'[^A-Za-z0-9_]+', '_', label)
            rcl_node = rclpy.create_node(f'starvation_planner_{token}_{os.getpid()}')
            try:
                result['nodes'][label] = measure(label, node_spec, cfg, rcl_node, workdir)
            finally:
                rcl_node.destroy_node()
    finally:
        rclpy.try_shutdown()
    write(result, args.out)
    return 0


def skipped(reason, args, params):
    '''No ROS here: says why, writes a result that says so, and exits 0 (as ros_e2e).'''
    log(f'starvation benchmark skipped: {reason}')
    write({'environment': environment(args.device, args.commit), 'parameters': params,
           'skipped': reason}, args.out)
    return 0


if __name__ == '__main__':
    sys.exit(main())
