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

# Imports here are the standard library only, and so are those of the modules imported below
# (starvation_*, environment, report): the client processes are spawned and import them again
# (this one as __mp_main__), and each of them should cost the machine an rclpy node, not a
# torch.
import argparse
import os
import pathlib
import re
import subprocess
import sys
import tempfile
import time

from .environment import ROOT
from .report import log
from .starvation_clients import Clients
from .starvation_node import ACT_DIM, baseline_node, installed_node, node_parameters, \
    OBS_DIM, start_node, write_echo_policy
from .starvation_report import environment, summary, targets, write
from .starvation_stream import DRAIN_S, QOS_DEPTH, Stream


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
    proc, node_log = start_node(spec, args, log_path)
    # the floor: the clients call a twin node in its own process, so the streamed node shares
    # the machine with the same load but not its process (what no isolation inside it removes)
    twin = start_node(spec, node_parameters(name + '_twin', cfg['device'], capsules + '-twin',
                                            cfg['policy_file']),
                      pathlib.Path(workdir) / f'{token}-twin.log') if spec.get('twin') else None
    stream = Stream(rcl_node, target, cfg['rate'])
    spinner = spin_in_thread(rcl_node)
    clients = None

    try:
        log(f'[{label}] {spec["source"]}: waiting for {target}')
        stream.wait_ready(timeout=180.0)
        while twin and rcl_node.count_services(target + '_twin/snapshot') == 0:
            if twin[0].poll() is not None:      # up before the unloaded phase, or gone
                raise RuntimeError(f'the twin node exited ({twin[0].returncode})')
            time.sleep(0.05)
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
        clients = Clients(cfg['clients'], target + '_twin' if twin else target)
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
        if twin:
            _stop(*twin)
        out['exit_code'] = proc.returncode
        out['log_tail'] = log_path.read_text(errors='replace').splitlines()[-15:]
    return out


INSTRUMENT_SWITCH_INTERVAL = 0.0002     # s: see main()


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
    ap.add_argument('--floor', action='store_true',
                    help='also measure the current node while the clients call a twin node '
                    'in another process: the same machine load, none of it in the streamed '
                    "node's process (the floor that isolation inside the node can reach)")
    ap.add_argument('--node-priority', type=int, default=0, metavar='1-99',
                    help='also measure the current node (with the --param settings) with its '
                    'whole process under SCHED_FIFO at this priority (chrt -f N): DDS and '
                    'service threads included')
    ap.add_argument('--stream-priority', type=int, default=0, metavar='1-99',
                    help='run this process (the robot side: stream and its receiver) under '
                    'SCHED_FIFO, so that on a saturated machine the instrument does not add '
                    'its own scheduling delay to what it measures; 0: the default scheduler')
    ap.add_argument('--commit', default='',
                    help='the flashrt_ros commit of this tree, when it is not a git checkout')
    ap.add_argument('--out', default=str(ROOT / 'benchmarks' / 'results'),
                    help='output directory')
    args = ap.parse_args(argv)
    params = {'device': args.device, 'seconds': args.seconds, 'unloaded_s': args.unloaded_seconds,
              'warmup_s': args.warmup, 'clients': args.clients, 'rate': args.rate,
              'drain_s': DRAIN_S, 'qos': f'reliable, keep-last {QOS_DEPTH}',
              'obs_dim': OBS_DIM, 'act_dim': ACT_DIM, 'baseline': args.baseline,
              'node_params': args.param, 'stream_priority': args.stream_priority,
              'floor': args.floor, 'node_priority': args.node_priority,
              'stream_gil_switch_interval_s': INSTRUMENT_SWITCH_INTERVAL,
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
    # The stream's sender, its receiver and the executor thread share this process's GIL,
    # handed over after 5 ms by default: the instrument's own delay would count as the node's.
    sys.setswitchinterval(INSTRUMENT_SWITCH_INTERVAL)
    if args.stream_priority:
        # this thread and the threads made after it (stream, receiver, DDS); the node and
        # the client processes go back to the default scheduler as they start
        # (default_scheduler)
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(args.stream_priority))
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
    if args.node_priority:
        specs[f'current, process SCHED_FIFO {args.node_priority}'] = dict(
            spec, params=args.param, process_priority=args.node_priority)
    if args.floor:
        specs['floor: clients on a twin node'] = dict(spec, params=args.param, twin=True)
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
