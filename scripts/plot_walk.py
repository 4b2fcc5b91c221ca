#!/usr/bin/env python3
"""Plots a walk: pelvis height and distance over time, headless (matplotlib Agg), into a PNG.

From a log (CSV with a header, or JSON: a list of rows or an object of columns) with columns
time, x, y, z (the base position, world frame; e.g. recorded from flashrt_sim's ~/base_pose):
    python3 scripts/plot_walk.py --log walk.csv --out walk.png
Or run the world itself, no ROS: RobotWorld + the pretrained G1 policy (unitree_rl_gym's
motion.pt under its deploy loop), for N simulated seconds, optionally saving the log too:
    python3 scripts/plot_walk.py --direct --seconds 20 --vx 0.5 --out walk.png --save-log walk.csv
Needs numpy and matplotlib (requirements/runtime.txt); --direct also needs mujoco, torch, PyYAML
and the robot folder (default: ../shared/robots/unitree_g1 beside the repository).
"""
import argparse
import csv
import json
import pathlib
import sys
import time

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
COLUMNS = ('time', 'x', 'y', 'z')


def read_log(path):
    """{column: float64 array} from a CSV or JSON log."""
    path = pathlib.Path(path)
    if path.suffix.lower() == '.json':
        data = json.loads(path.read_text())
        if isinstance(data, dict):
            cols = {k: data[k] for k in COLUMNS}
        else:
            cols = {k: [row[k] for row in data] for k in COLUMNS}
    else:
        with open(path, newline='') as f:
            rows = list(csv.DictReader(f))
        cols = {k: [row[k] for row in rows] for k in COLUMNS}
    return {k: np.asarray(v, dtype=np.float64) for k, v in cols.items()}


def write_log(path, log):
    with open(path, 'w', newline='') as f:
        out = csv.writer(f)
        out.writerow(COLUMNS)
        for row in zip(*(log[k] for k in COLUMNS)):
            out.writerow([repr(float(v)) for v in row])


def run_direct(robot, seconds, vx):
    """The G1 walking under RobotWorld + UpstreamController; base position once a period."""
    sys.path.insert(0, str(ROOT))   # this checkout's package, not an older installed copy
    import torch

    from flashrt_ros.sim.robot_world import load_upstream_config, upstream_world, \
        UpstreamController
    robot = pathlib.Path(robot)
    if not robot.is_dir():
        sys.exit(f'robot folder {robot} is absent: pass --robot DIR (with scene.xml, '
                 'motion.pt and deploy_mujoco_g1.yaml)')
    # A 1x64 LSTM step is too small to share: more threads only wait on each other (5x
    # slower on a busy 2-core machine).
    torch.set_num_threads(1)
    cfg = load_upstream_config(robot / 'deploy_mujoco_g1.yaml')
    world = upstream_world(robot / 'scene.xml', cfg)
    controller = UpstreamController(torch.jit.load(str(robot / 'motion.pt')), cfg,
                                    command=[vx, 0.0, 0.0])
    periods = int(round(seconds / (world.sim_dt * world.decimation)))
    rows = []
    t0 = time.perf_counter()
    for i in range(periods + 1):
        rows.append((world.sim_time, *world.base_position()))
        if i < periods:
            world.step(controller(world))
    print(f'{periods} periods ({world.sim_time:.2f} s simulated) in '
          f'{time.perf_counter() - t0:.2f} s')
    return {k: np.array([r[i] for r in rows]) for i, k in enumerate(COLUMNS)}


def plot(log, out, title):
    import matplotlib
    matplotlib.use('Agg')           # headless: no display needed
    import matplotlib.pyplot as plt
    t, x, y, z = (log[k] for k in COLUMNS)
    fig, (ax_z, ax_x) = plt.subplots(2, 1, sharex=True, figsize=(8, 6))
    ax_z.plot(t, z)
    ax_z.set_ylabel('pelvis height (m)')
    ax_z.grid(True)
    ax_x.plot(t, x - x[0], label='forward (x)')
    ax_x.plot(t, y - y[0], '--', label='sideways (y)')
    ax_x.set_xlabel('simulation time (s)')
    ax_x.set_ylabel('distance from start (m)')
    ax_x.legend()
    ax_x.grid(True)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument('--log', help='CSV or JSON log with columns time, x, y, z')
    source.add_argument('--direct', action='store_true',
                        help='run RobotWorld + the G1 policy here (no ROS)')
    parser.add_argument('--seconds', type=float, default=20.0, help='--direct: sim seconds')
    parser.add_argument('--vx', type=float, default=0.5, help='--direct: command vx (m/s)')
    parser.add_argument('--robot', default=str(ROOT.parent / 'shared/robots/unitree_g1'),
                        help='--direct: folder with scene.xml, motion.pt, the deploy yaml')
    parser.add_argument('--save-log', help='--direct: also write the log as CSV here')
    parser.add_argument('--out', default='walk.png', help='PNG to write (walk.png)')
    args = parser.parse_args(argv)
    if args.direct:
        log = run_direct(args.robot, args.seconds, args.vx)
        if args.save_log:
            write_log(args.save_log, log)
        source = f'RobotWorld + motion.pt, command vx {args.vx} m/s'
    else:
        log = read_log(args.log)
        source = pathlib.Path(args.log).name
    if len(log['time']) < 2:
        sys.exit('the log has fewer than two rows: nothing to plot')
    summary = (f'{log["time"][-1] - log["time"][0]:.1f} s: forward '
               f'{log["x"][-1] - log["x"][0]:.2f} m, pelvis {log["z"].min():.3f} - '
               f'{log["z"].max():.3f} m')
    plot(log, args.out, f'{source}\n{summary}')
    print(f'{summary}; wrote {args.out}')


if __name__ == '__main__':
    main()
