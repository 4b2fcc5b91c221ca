"""The policy node with a LeRobot SmolVLA checkpoint (policy_type smolvla, policy_file the
checkpoint folder): observations in over ~/observation (state, camera images, the
instruction's token ids and mask), actions out bit for bit those of the same checkpoint on an
engine without ROS, and the capsule services mid-chunk: a snapshot restored replays the same
actions across the next chunk. The checkpoint is a tiny SmolVLA LeRobot writes offline.
"""
import pytest

pytest.importorskip('lerobot.policies.smolvla.modeling_smolvla',
                    reason='needs lerobot 0.4.4 and transformers (requirements/vla.txt)')

from support.smolvla import ACT_DIM, checkpoint, frames, OBS_DIM, vectors, vlm_folder  # noqa

STEPS = 5       # the checkpoint's n_action_steps


@pytest.fixture(scope='module')
def folder(tmp_path_factory):
    return checkpoint(vlm_folder(tmp_path_factory.mktemp('smolvlm')),
                      tmp_path_factory.mktemp('checkpoint'))


def _params(folder, **more):
    return dict(policy_type='smolvla', policy_file=folder, obs_dim=OBS_DIM, act_dim=ACT_DIM,
                seed=3, **more)


def test_node_steps_the_checkpoint_and_restores_mid_chunk(make, folder):
    h = make(_params(folder))
    obs = vectors(folder, frames(3 * STEPS, seed=2))
    first = h.steps(obs[:STEPS + 2])
    assert first == h.reference(obs[:STEPS + 2])
    assert h.call('snapshot', name='mid').success
    later = h.steps(obs[STEPS + 2:])                     # crosses into the third chunk
    assert first + later == h.reference(obs)
    for _ in range(2):
        assert h.call('restore', name='mid').success
        assert h.steps(obs[STEPS + 2:]) == later


@pytest.mark.parametrize('wrong', [dict(obs_dim=OBS_DIM - 1), dict(act_dim=ACT_DIM + 1),
                                   dict(policy_file=''), dict(noise_std=0.1)])
def test_what_is_not_the_checkpoint_is_refused_at_configure(make, folder, wrong):
    h = make(dict(_params(folder), **wrong), start=False)
    assert not h.client.change_state('configure')
    assert h.node.parts is None
