'''The node under test in the starvation benchmark: the echo policy it runs (a TorchScript MLP
whose action element 0 is its observation element 0), its parameters, and how its process is
started: the installed executable (compared with the checkout), or the flashrt_ros tree of
another commit (--baseline).
'''

# Standard library only at import, as every starvation module: the client processes are
# spawned and import them again (starvation.py says why).
import os
import pathlib
import re
import subprocess
import sys
import tempfile

from .environment import ROOT

OBS_DIM, ACT_DIM, HIDDEN = 48, 12, 256
SERVICES = ('snapshot', 'restore', 'list_capsules')


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


def default_scheduler():
    '''The calling process back on the default scheduler (the node and the clients must not
    inherit the measuring process's --stream-priority).'''
    if os.sched_getscheduler(0) != os.SCHED_OTHER:
        os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))


def start_node(spec, args, log_path):
    '''The node's process; spec['process_priority'] > 0 starts it (every thread it makes)
    under SCHED_FIFO at that priority, as `chrt -f N` would, else on the default scheduler.'''
    env = dict(os.environ, **spec['env'])
    log_file = open(log_path, 'w')
    priority = spec.get('process_priority', 0)

    def scheduler():
        if priority:
            os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(priority))
        else:
            default_scheduler()
    proc = subprocess.Popen(spec['command'] + args, stdout=log_file, stderr=subprocess.STDOUT,
                            env=env, cwd=spec['cwd'], preexec_fn=scheduler)
    return proc, log_file
