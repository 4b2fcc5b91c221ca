"""A LeRobot SmolVLA on the engine (runtime/policies/lerobot_chunk.py): its actions are
LeRobot's own select_action bit for bit, chunk after chunk; a capsule taken mid-chunk
replays the same actions, across the next chunk's computation, every time and in a fresh
process. The model is a tiny SmolVLA that LeRobot itself builds offline (support/smolvla.py).
"""
import copy
import json
import subprocess
import sys

import numpy as np
import pytest
import torch

pytest.importorskip('lerobot.policies.smolvla.modeling_smolvla',
                    reason='needs lerobot 0.4.4 and transformers (requirements/vla.txt)')

from flashrt_ros.runtime.engine import PolicyEngine  # noqa: E402
from flashrt_ros.runtime.errors import InvalidConfig  # noqa: E402
from flashrt_ros.runtime.policies import gaussian_noise  # noqa: E402
from flashrt_ros.runtime.policies.lerobot_chunk import SmolVLAChunkPolicy  # noqa: E402
from support.smolvla import ACT_DIM, CAMERAS, smolvla, STATE_DIM, TOKENS, vlm_folder  # noqa

STEPS, CHUNK = 5, 8      # n_action_steps, chunk_size


@pytest.fixture(scope='module')
def vlm(tmp_path_factory):
    return vlm_folder(tmp_path_factory.mktemp('smolvlm'))


def _observations(count, seed=0):
    """(LeRobot batches, the same as flashrt_ros observation vectors)."""
    rng = np.random.default_rng(seed)
    batches, vectors = [], []
    for _ in range(count):
        state = rng.standard_normal(STATE_DIM).astype(np.float32)
        images = {k: rng.random(s, dtype=np.float32) for k, s in CAMERAS.items()}
        tokens = rng.integers(len(CAMERAS) + 5, 200, TOKENS)
        mask = np.arange(TOKENS) < rng.integers(3, TOKENS + 1)     # a padded instruction
        batches.append({'observation.state': torch.from_numpy(state)[None],
                        **{k: torch.from_numpy(v)[None] for k, v in images.items()},
                        'observation.language.tokens': torch.from_numpy(tokens)[None],
                        'observation.language.attention_mask': torch.from_numpy(mask)[None]})
        vectors.append(np.concatenate([state, *[v.ravel() for v in images.values()],
                                       tokens.astype(np.float32), mask.astype(np.float32)]))
    return batches, vectors


def _engine(vlm, tmp_path, seed=0):
    policy = SmolVLAChunkPolicy(smolvla(vlm, seed, CHUNK, STEPS), seed=7)
    return PolicyEngine(policy, device='cpu', capsule_dir=str(tmp_path / 'capsules'))


def test_actions_equal_lerobot_select_action_chunk_after_chunk(vlm, tmp_path):
    reference = smolvla(vlm, 0, CHUNK, STEPS)
    engine = PolicyEngine(SmolVLAChunkPolicy(copy.deepcopy(reference), seed=7), device='cpu',
                          capsule_dir=str(tmp_path / 'capsules'))
    batches, vectors = _observations(3 * STEPS + 2)
    for t, (batch, obs) in enumerate(zip(batches, vectors)):
        # LeRobot computes a chunk when its queue is empty; give it the noise the engine's
        # rng buffer draws for that chunk (seed 7, counter = chunks so far)
        noise = gaussian_noise(torch.tensor([7]), torch.tensor([t // STEPS]),
                               CHUNK * 16).view(1, CHUNK, 16)
        want = reference.select_action(dict(batch), noise=noise)[0]
        got = engine.step(obs)
        assert got.shape == (ACT_DIM,) and torch.equal(got, want), t
    state = engine.policy.views
    assert int(state['left']) == STEPS - (len(vectors) % STEPS)
    assert int(state['rng'][1]) == 4 and state['prefix_pad'].any()


def test_a_capsule_mid_chunk_replays_the_same_actions_eight_times(vlm, tmp_path):
    engine = _engine(vlm, tmp_path)
    _, vectors = _observations(2 * STEPS + 6, seed=1)
    for obs in vectors[:STEPS + 2]:
        engine.step(obs)
    engine.snapshot('mid')
    # the replay crosses the next chunk, computed from the restored rng counter and inputs
    later = vectors[STEPS + 2:]
    want = torch.stack([engine.step(obs) for obs in later])
    for _ in range(8):
        engine.restore('mid')
        assert torch.equal(torch.stack([engine.step(obs) for obs in later]), want)
    path = tmp_path / 'capsules' / 'mid.capsule'
    engine.save('mid', str(path))
    script = (
        'import sys, json, torch; sys.path[:0] = %r\n'
        'from test_lerobot_chunk import _engine, _observations, STEPS\n'
        'import pathlib\n'
        'e = _engine(%r, pathlib.Path(%r))\n'
        'e.load(%r, "mid")\n'
        'e.restore("mid")\n'
        'later = _observations(2 * STEPS + 6, seed=1)[1][STEPS + 2:]\n'
        'print(json.dumps([e.step(o).tolist() for o in later]))\n'
        % (sys.path, vlm, str(tmp_path), str(path)))
    out = subprocess.run([sys.executable, '-c', script], capture_output=True, text=True,
                         cwd=str(tmp_path), timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    fresh = torch.tensor(json.loads(out.stdout.strip().splitlines()[-1]))
    assert torch.equal(fresh, want)


def test_cameras_outside_the_config_are_refused(vlm):
    lerobot = smolvla(vlm)
    with pytest.raises(InvalidConfig, match='cameras'):
        SmolVLAChunkPolicy(lerobot, cameras={'observation.images.side': (3, 32, 32)})
    with pytest.raises(InvalidConfig, match='cameras'):
        SmolVLAChunkPolicy(lerobot, cameras={'observation.images.top': (1, 32, 32)})
