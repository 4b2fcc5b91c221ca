#!/usr/bin/env python3
"""Plots a push with and without the safety supervisor: pelvis height and base tilt over time,
and when the supervisor tripped, headless (matplotlib Agg), into a PNG.

The logs come from the G1 safety test (test/system/test_g1_safety.py), run with
FLASHRT_PUSH_LOG=<prefix>: <prefix>.plain.csv and <prefix>.safe.csv (time, z, tilt, trips).
    FLASHRT_PUSH_LOG=/tmp/push python -m pytest test/system/test_g1_safety.py -k rollback
    python3 scripts/plot_push.py --log /tmp/push --out docs/g1_push.png
Needs numpy and matplotlib.
"""
import argparse
import csv

import numpy as np


def read(path):
    with open(path, newline='') as f:
        rows = list(csv.DictReader(f))
    return {k: np.array([float(r[k]) for r in rows]) for k in ('time', 'z', 'tilt', 'trips')}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--log', required=True, help='the FLASHRT_PUSH_LOG prefix')
    parser.add_argument('--out', required=True, help='PNG to write')
    parser.add_argument('--max-tilt', type=float, default=0.5, help='the tilt detector limit')
    args = parser.parse_args()
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    plain, safe = read(f'{args.log}.plain.csv'), read(f'{args.log}.safe.csv')
    # x: control periods as they happened (a rollback sends the simulated time back)
    for log in (plain, safe):
        log['tick'] = np.arange(len(log['z'])) * 0.02
    fig, (top, bottom) = plt.subplots(2, 1, sharex=True, figsize=(8, 5.5))
    top.plot(plain['tick'], plain['z'], label='no supervisor', color='tab:red')
    top.plot(safe['tick'], safe['z'], label='tilt:rollback (world + policy)', color='tab:blue')
    top.set_ylabel('pelvis height (m)')
    top.legend(loc='lower left')
    bottom.plot(plain['tick'], plain['tilt'], color='tab:red')
    bottom.plot(safe['tick'], safe['tilt'], color='tab:blue')
    bottom.axhline(args.max_tilt, color='gray', linestyle='--', label='tilt limit')
    trips = np.flatnonzero(np.diff(safe['trips'], prepend=0) > 0)
    for k in trips:
        for ax in (top, bottom):
            ax.axvline(safe['tick'][k], color='tab:blue', alpha=0.3)
    bottom.set_ylabel('base tilt (rad)')
    bottom.set_xlabel('control periods x 0.02 s, as they ran (each trip: world and policy '
                      'go back to a safe capsule)')
    bottom.legend(loc='upper left')
    fig.suptitle('Unitree G1 pushed sideways at 3 m/s after 2 s; vertical lines: trips '
                 f'({len(trips)})')
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f'wrote {args.out}')


if __name__ == '__main__':
    main()
