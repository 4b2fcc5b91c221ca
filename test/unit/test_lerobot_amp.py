"""Checkpoints saved with `use_amp: true`. LeRobot's robot-side scripts (lerobot-record's
predict_action; LeRobot 0.6's rollout alike) run them under CUDA's autocast (float16) and as
they are on the CPU. The engine does the same (LeRobotChunkPolicy.autocast): its actions are
predict_action's bit for bit on each device, the chunk a captured graph on CUDA, and a capsule
replays them; options whose kernels are not LeRobot's own are refused with use_amp."""
import json
from contextlib import nullcontext
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip('lerobot.policies.smolvla.modeling_smolvla',
                    reason='needs lerobot 0.4.4 and transformers (requirements/vla.txt)')

from lerobot.policies.factory import get_policy_class  # noqa: E402
try:        # LeRobot 0.6 moved it
    from lerobot.common.control_utils import predict_action
except ImportError:
    from lerobot.utils.control_utils import predict_action

from flashrt_ros.runtime.engine import PolicyEngine  # noqa: E402
from flashrt_ros.runtime.errors import InvalidConfig  # noqa: E402
from flashrt_ros.runtime.policies import (ACTChunkPolicy, DiffusionChunkPolicy,  # noqa: E402
                                          gaussian_noise)
from flashrt_ros.runtime.policies.lerobot_chunk import LeRobotChunkPolicy  # noqa: E402
from flashrt_ros.runtime.policies import lerobot_demo as demo  # noqa: E402
from flashrt_ros.runtime.policies.lerobot_diffusion import chunk_seed  # noqa: E402
from flashrt_ros.runtime.policies.lerobot_smolvla import SmolVLAChunkPolicy  # noqa: E402
from support.smolvla import pipeline, vectors  # noqa: E402

SEED, TASK = 7, 'pick up the red cube'
DEVICES = ['cpu', pytest.param('cuda', marks=pytest.mark.cuda)]
KINDS = {'act': (ACTChunkPolicy, demo.ACT_SIZES['demo']['cameras']),
         'diffusion': (DiffusionChunkPolicy, demo.DIFFUSION_SIZES['demo']['cameras']),
         'smolvla': (SmolVLAChunkPolicy, demo.CAMERAS)}


def _use_amp(folder):
    folder = Path(folder)
    config = json.loads((folder / 'config.json').read_text())
    config['use_amp'] = True
    (folder / 'config.json').write_text(json.dumps(config, indent=4))
    return folder


def _checkpoint(kind, tmp_path, **options):
    '''A use_amp checkpoint of kind, as lerobot-train writes one with --policy.use_amp=true.'''
    if kind == 'smolvla':
        vlm = demo.vlm_folder(tmp_path / 'smolvlm')
        return _use_amp(demo.checkpoint(vlm, tmp_path / kind, **options))
    make = demo.act_checkpoint if kind == 'act' else demo.diffusion_checkpoint
    return _use_amp(make(tmp_path / kind, **options))


def _robot(cameras, count, seed=3):
    '''Observations as a robot gives predict_action: the state, each camera HWC uint8.'''
    rng = np.random.default_rng(seed)
    return [{'observation.state': rng.standard_normal(demo.STATE_DIM).astype(np.float32),
             **{k: rng.integers(0, 256, (h, w, c), dtype=np.uint8)
                for k, (c, h, w) in cameras.items()}} for _ in range(count)]


def _vectors(kind, folder, robot, cameras):
    '''The engine's observation vectors of the robot's frames: the images in [0, 1] as
    predict_action makes them (float32, / 255), and SmolVLA's instruction tokens.'''
    frames = [{'observation.state': torch.from_numpy(f['observation.state']),
               **{k: (torch.from_numpy(f[k]).float() / 255).permute(2, 0, 1)
                  for k in cameras}, 'task': TASK} for f in robot]
    if kind == 'smolvla':
        return vectors(folder, frames)
    return [np.concatenate([f['observation.state'].numpy(),
                            *[f[k].numpy().ravel() for k in cameras]]) for f in frames]


@pytest.mark.parametrize('kind', sorted(KINDS))
@pytest.mark.parametrize('device', DEVICES)
def test_actions_are_predict_actions_with_use_amp(kind, device, tmp_path):
    """Three chunks (Diffusion's first across a history, SmolVLA's across its prefix pass):
    each action equals predict_action(use_amp=True) bit for bit; a capsule mid-chunk replays
    the rest 8 times. On CUDA autocast is in force: the actions differ from the same
    checkpoint's without use_amp."""
    _compare_with_predict_action(kind, device, tmp_path, nullcontext, device == 'cuda')


@pytest.mark.parametrize('kind', sorted(KINDS))
def test_the_autocast_path_runs_on_the_cpu_too(kind, tmp_path, monkeypatch):
    """The CUDA path's autocast where CI runs (no GPU): the engine's autocast() made the CPU's
    (bfloat16, as lerobot-eval runs use_amp there) and predict_action run under the same, the
    actions are equal bit for bit and differ from float32's. It checks what the CUDA test
    checks with float16, on the same code path: that everything the chunk computes (prefix
    pass, denoising steps, the chunk's graph function) is under autocast() and that the
    autocast dtypes it gives (the prefix cache's, the actions') are handled."""
    def cpu_autocast():
        return torch.autocast('cpu', dtype=torch.bfloat16, cache_enabled=False)
    monkeypatch.setattr(LeRobotChunkPolicy, 'autocast',
                        lambda self: cpu_autocast() if self.amp else nullcontext())
    _compare_with_predict_action(kind, 'cpu', tmp_path, cpu_autocast, True)


def _compare_with_predict_action(kind, device, tmp_path, around_lerobot, autocast_in_force):
    cls, cameras = KINDS[kind]
    folder = _checkpoint(kind, tmp_path)
    reference = get_policy_class(cls.kind).from_pretrained(folder).eval().to(device)
    assert reference.config.use_amp
    pre, post = pipeline(folder, device=device)
    engine = PolicyEngine(cls.from_pretrained(folder, seed=SEED), device=device,
                          capsule_dir=str(tmp_path / 'capsules'))
    assert engine.policy._chunk_graph.captured == (device == 'cuda')
    if kind == 'smolvla':   # the cache's layout, learnt under autocast once, not at each bind
        passes, prefix = [], engine.policy._prefix
        engine.policy._prefix = lambda *a, **k: passes.append(1) or prefix(*a, **k)
        engine.policy.bind(engine.arena.session_views[0])      # (checks the cache's dtype)
        assert passes == []
        del engine.policy._prefix
    steps = engine.policy.steps
    robot = _robot(cameras, 3 * steps)
    obs = _vectors(kind, folder, robot, cameras)
    got, chunks = [], 0
    for t, (frame, o) in enumerate(zip(robot, obs)):
        if t % steps == 0:      # LeRobot computes a chunk: the engine's noise for it
            if kind == 'diffusion':
                generator = torch.cuda.default_generators[0] if device == 'cuda' else \
                    torch.default_generator
                generator.manual_seed(chunk_seed(SEED, chunks))
            elif kind == 'smolvla':
                noise = gaussian_noise(torch.tensor([SEED], device=device),
                                       torch.tensor([chunks], device=device),
                                       engine.policy.noise_shape[1] *
                                       engine.policy.noise_shape[2])
                reference.model.sample_noise = \
                    lambda shape, _, n=noise: n.view(shape).to(torch.float32)
            chunks += 1
        with around_lerobot():
            want = predict_action(dict(frame), reference, torch.device(device), pre, post,
                                  use_amp=True, task=TASK)[0]
        got.append(engine.step(o))
        assert torch.equal(got[-1].cpu(), want.float().cpu()), t
        if t == steps + 1:
            engine.snapshot('mid')
    later = torch.stack(got[steps + 2:])        # the rest, the third chunk's computation in it
    for _ in range(8):
        engine.restore('mid')
        assert torch.equal(torch.stack([engine.step(o) for o in obs[steps + 2:]]), later)
    if autocast_in_force:
        config = json.loads((folder / 'config.json').read_text())
        config['use_amp'] = False
        (folder / 'config.json').write_text(json.dumps(config))
        full = PolicyEngine(cls.from_pretrained(folder, seed=SEED), device=device,
                            capsule_dir=str(tmp_path / 'full'))
        assert not torch.equal(torch.stack([full.step(o) for o in obs]), torch.stack(got))


def test_options_whose_kernels_are_not_lerobots_are_refused_with_use_amp(tmp_path):
    """Compiled or fused kernels, a part cast to bfloat16, real-time chunking and ACT's
    temporal ensembling are not measured under autocast: refused by name, on every device."""
    smolvla = _checkpoint('smolvla', tmp_path)
    for options, named in (({'denoise_kernels': 'compiled'}, 'denoise_kernels compiled'),
                           ({'prefix_kernels': 'compiled'}, 'prefix_kernels compiled'),
                           ({'expert_dtype': 'bfloat16'}, 'expert_dtype bfloat16'),
                           ({'rtc_delay': 2, 'rtc_queue_threshold': 4}, 'rtc_delay')):
        with pytest.raises(InvalidConfig, match=f'use_amp .* with {named} is not supported'):
            SmolVLAChunkPolicy.from_pretrained(smolvla, **options)
    act = _checkpoint('act', tmp_path, temporal_ensemble_coeff=0.01, n_action_steps=1)
    with pytest.raises(InvalidConfig, match='use_amp with temporal ensembling'):
        ACTChunkPolicy.from_pretrained(act)
    assert SmolVLAChunkPolicy.from_pretrained(smolvla).config()['use_amp'] is True
