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
