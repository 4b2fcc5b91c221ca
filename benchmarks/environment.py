"""Where and on what a benchmark ran: the checkout's root (ROOT), the environment record every
results file starts with (date, host, device, driver, versions, load, the flashrt_ros commit
measured), the device a --device argument names, and the device's slug and the results path
for file names.

Standard library only at import (torch is imported when a record is made): the starvation
benchmark's client processes import the modules that import this one, and each of them should
cost the machine an rclpy node, not a torch.
"""

import datetime
from importlib import metadata
import os
import pathlib
import platform
import re
import socket
import subprocess

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _run(cmd):
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=10,
                              cwd=ROOT).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ''


def project_commit(given=''):
    """The flashrt_ros commit measured: `given` (--commit, for a copy of the tree that is not
    a git checkout, e.g. on a lent GPU machine), else this repository's HEAD, only when ROOT
    is itself the top of a git checkout (not some enclosing repository)."""
    if given:
        return {'git_commit': given, 'git_dirty': False, 'commit_source': '--commit'}
    top = _run(['git', 'rev-parse', '--show-toplevel'])
    if not top or pathlib.Path(top).resolve() != ROOT:
        return {'git_commit': 'unknown (not a git checkout; pass --commit)', 'git_dirty': False,
                'commit_source': 'none'}
    return {'git_commit': _run(['git', 'rev-parse', '--short', 'HEAD']),
            'git_dirty': bool(_run(['git', 'status', '--porcelain', '--', 'flashrt_ros'])),
            'commit_source': 'git'}


def environment(device, mode, commit=''):
    import torch

    cuda = device.type == 'cuda'
    env = {'date': datetime.datetime.now().astimezone().isoformat(timespec='seconds'),
           'hostname': socket.gethostname(), 'mode': mode, 'device': str(device),
           'device_name': torch.cuda.get_device_name(device) if cuda else
           (platform.processor() or platform.machine()),
           'driver': _run(['nvidia-smi', '--query-gpu=driver_version',
                           '--format=csv,noheader']).splitlines()[0:1] if cuda else [],
           'torch': torch.__version__, 'cuda': torch.version.cuda or '',
           'python': platform.python_version(), 'cpu_threads': torch.get_num_threads(),
           # other work on the machine at the start: CPU figures move with it
           'load_average_1m': os.getloadavg()[0],
           **project_commit(commit)}
    env['driver'] = env['driver'][0] if env['driver'] else ''
    env.update(_libraries())
    return env


def _libraries():
    """The versions of the model libraries a VLA run measures against, where installed
    (their metadata only: nothing imported)."""
    found = {}
    for name in ('lerobot', 'transformers'):
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return found


def device_slug(env):
    return 'cpu' if env['device'] == 'cpu' else \
        re.sub(r'[^a-z0-9]+', '-', env['device_name'].lower()).strip('-')


def resolve_device(name):
    """The torch device of a --device argument: 'auto' is CUDA where present, else the CPU."""
    import torch
    if name == 'auto':
        name = 'cuda' if torch.cuda.is_available() else 'cpu'
    return torch.device(name)


def results_stem(given, stem):
    """The stem results are written under (<stem>.json, <stem>.md): --out as given (a .json
    or .md suffix dropped), else benchmarks/results/<stem>."""
    out = pathlib.Path(given or ROOT / 'benchmarks' / 'results' / stem)
    return out.with_suffix('') if out.suffix in ('.json', '.md') else out
