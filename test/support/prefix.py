"""Checks of the kept prefix (runtime/policies/lerobot_prefix.py) that every language chunk
policy's tests share: an engine whose 'start' capsule was taken before its first chunk."""
import torch


def check_restarts_reuse_the_prefix(engine, still, first, times=8):
    """The episode restarted from 'start', given back the 'kv' buffers of a capsule taken
    after its first chunk on `still` ('first', taken here), skips the prefix pass with the
    same first action (`first`), `times` times."""
    policy = engine.policy
    engine.restore('start')
    engine.step(still)
    engine.snapshot('first')                # after the first chunk: its prefix
    for i in range(times):
        engine.restore('start')
        engine.restore('first', kinds=['kv'])
        reused = policy.prefix_reused
        assert torch.equal(engine.step(still).cpu(), first), i
        assert policy.prefix_reused == reused + 1, i


def check_changed_bits_recompute(engine, changed):
    """After check_restarts_reuse_the_prefix: the same restart on an observation of other
    bits (`changed`, numpy float32) runs the prefix pass and keeps that observation."""
    policy = engine.policy
    engine.restore('start')
    engine.restore('first', kinds=['kv'])
    reused = policy.prefix_reused
    engine.step(changed)
    assert policy.prefix_reused == reused
    assert torch.equal(policy.views['prefix_obs'].cpu().view(torch.int32),
                       torch.from_numpy(changed).view(torch.int32))


def steps_in_a_fresh_process(engine, capsule, make_engine, observations, tmp_path,
                             timeout=600):
    """Saves `engine`'s capsule `capsule` to tmp_path/capsules (the tests' capsule_dir); the
    actions (a CPU tensor) of a new Python process that runs `make_engine` (statements that
    bind `e` to an engine, with this process's sys.path), loads that file as `capsule`,
    restores it and steps through `observations` (numpy float32 vectors)."""
    import json
    import subprocess
    import sys

    import numpy as np
    path = engine.save(capsule, str(tmp_path / 'capsules' / f'{capsule}.capsule')).path
    np.save(tmp_path / 'later.npy', np.stack(observations))
    script = ('import sys, json, pathlib, numpy; sys.path[:0] = %r\n%s\n'
              'e.load(%r, %r)\ne.restore(%r)\n'
              'print(json.dumps([e.step(o).tolist() for o in numpy.load(%r)]))\n'
              % (sys.path, make_engine, str(path), capsule, capsule,
                 str(tmp_path / 'later.npy')))
    out = subprocess.run([sys.executable, '-c', script], capture_output=True, text=True,
                         cwd=str(tmp_path), timeout=timeout)
    assert out.returncode == 0, out.stderr[-3000:]
    return torch.tensor(json.loads(out.stdout.strip().splitlines()[-1]))


def check_a_capsule_replays(engine, before, later, name='mid', times=8):
    """Steps through `before`, takes capsule `name`, steps through `later`; then, `times`
    times, restores it and steps through `later` again: the same actions, which it returns."""
    for obs in before:
        engine.step(obs)
    engine.snapshot(name)
    want = torch.stack([engine.step(obs) for obs in later])
    for i in range(times):
        engine.restore(name)
        assert torch.equal(torch.stack([engine.step(obs) for obs in later]), want), i
    return want


def check_replays_here_and_in_a_fresh_process(engine, before, later, make_engine, tmp_path):
    """The identity rule for a new episode of `engine`: check_a_capsule_replays (capsule 'mid'
    after `before`, `later` replayed 8 times), then the same actions from that capsule in a
    fresh process that builds its engine with `make_engine` (steps_in_a_fresh_process)."""
    engine.reset_episode()
    again = check_a_capsule_replays(engine, before, later)
    fresh = steps_in_a_fresh_process(engine, 'mid', make_engine, later, tmp_path)
    assert torch.equal(fresh, again.cpu())
