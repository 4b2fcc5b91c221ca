"""A LeRobot SmolVLA on the engine (runtime/policies/lerobot_chunk.py), loaded from a
checkpoint folder as LeRobot writes one: its actions are LeRobot's own pipeline (pre-processor,
select_action, post-processor) bit for bit, chunk after chunk; a capsule taken mid-chunk
replays the same actions, across the next chunk's computation, every time and in a fresh
process. The model is a tiny SmolVLA that LeRobot itself builds offline (support/smolvla.py).
"""
import json
import subprocess
import sys

import numpy as np
import pytest
import torch

pytest.importorskip('lerobot.policies.smolvla.modeling_smolvla',
                    reason='needs lerobot 0.4.4 and transformers (requirements/vla.txt)')

from lerobot.policies.smolvla.modeling_smolvla import SmolVLAPolicy  # noqa: E402

from flashrt_ros.runtime.engine import PolicyEngine  # noqa: E402
from flashrt_ros.runtime.errors import InvalidConfig, InvalidObservation  # noqa: E402
from flashrt_ros.runtime.policies import gaussian_noise  # noqa: E402
from flashrt_ros.runtime.policies.lerobot_smolvla import SmolVLAChunkPolicy  # noqa: E402
from support.prefix import (check_a_capsule_replays, check_changed_bits_recompute,  # noqa
                            check_replays_here_and_in_a_fresh_process,
                            check_restarts_reuse_the_prefix, steps_in_a_fresh_process)
from support.smolvla import (ACT_DIM, CAMERAS, checkpoint, frames, pipeline, smolvla,  # noqa: E402
                             STATE_DIM, statistics, vectors, vlm_folder)

STEPS, CHUNK, SEED = 5, 8, 7      # n_action_steps, chunk_size, the engine's noise seed
# the chunk is one captured CUDA graph on CUDA (LeRobot's reference runs eagerly there)
DEVICES = ['cpu', pytest.param('cuda', marks=pytest.mark.cuda)]


@pytest.fixture(scope='module')
def folders(tmp_path_factory):
    vlm = vlm_folder(tmp_path_factory.mktemp('smolvlm'))
    return vlm, checkpoint(vlm, tmp_path_factory.mktemp('checkpoint'))


def _engine(folder, tmp_path, device='cpu'):
    return PolicyEngine(SmolVLAChunkPolicy.from_pretrained(folder, seed=SEED), device=device,
                        capsule_dir=str(tmp_path / 'capsules'))


def _on(device, batch):
    return {k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()}


@pytest.mark.parametrize('device', DEVICES)
def test_actions_equal_lerobots_pipeline_chunk_after_chunk(folders, tmp_path, device):
    _, folder = folders
    reference, (pre, post) = SmolVLAPolicy.from_pretrained(folder).eval().to(device), \
        pipeline(folder)
    engine = _engine(folder, tmp_path, device)
    assert engine.policy._chunk_graph.captured == (device == 'cuda')
    batch = frames(3 * STEPS + 2)
    got_all, chunks = [], {}
    for t, (frame, obs) in enumerate(zip(batch, vectors(folder, batch))):
        # LeRobot computes a chunk when its queue is empty: give it the noise the engine's
        # rng buffer draws for that chunk (seed SEED, counter = chunks so far)
        noise = gaussian_noise(torch.tensor([SEED], device=device),
                               torch.tensor([t // STEPS], device=device),
                               CHUNK * 16).view(1, CHUNK, 16)
        want = post(reference.select_action(_on(device, pre(dict(frame))), noise=noise))[0]
        got = engine.step(obs)
        assert got.shape == (ACT_DIM,) and torch.equal(got.cpu(), want.cpu()), t
        got_all.append(got.cpu())
        fresh = engine.policy.fresh_chunk(engine.policy.views)
        assert (fresh is not None) == (t % STEPS == 0), t
        if fresh is not None:
            chunks[t] = fresh
    # each chunk (what ~/action_chunk sends) is the actions its steps then took, held apart
    # from the arena that the next chunk overwrites
    for t, chunk in chunks.items():
        n = min(STEPS, len(got_all) - t)
        assert torch.equal(torch.from_numpy(chunk[:n]), torch.stack(got_all[t:t + n])), t
    state = engine.policy.views
    assert int(state['left']) == STEPS - (len(batch) % STEPS)
    assert int(state['rng'][1]) == 4 and state['prefix_pad'].any()
    # normalisation is in force: the same steps with the statistics ignored differ
    assert not torch.equal(engine.policy.observation_state_mean,
                           torch.zeros_like(engine.policy.observation_state_mean))


@pytest.mark.parametrize('device', DEVICES)
def test_a_fleet_computes_no_chunk_for_a_robot_left_out(folders, tmp_path, device):
    """Two robots, the second left out of most ticks (no new reading): only the first's
    chunks are computed (a left-out session's would be put back, at a whole VLA pass a tick);
    the first's actions are a one-robot engine's, the second's state stays bit for bit, and
    once it steps its actions are those of a one-robot engine from the start."""
    _, folder = folders
    fleet = PolicyEngine(SmolVLAChunkPolicy.from_pretrained(folder, seed=SEED), device=device,
                         capsule_dir=str(tmp_path / 'fleet'), sessions=2)
    alone, fresh = (_engine(folder, tmp_path / name, device) for name in ('alone', 'fresh'))
    policy, computed = fleet.policy, []
    replay = policy._chunk_graph.replay     # (the graph on CUDA, its function on the CPU)
    policy._chunk_graph.replay = lambda: computed.append(1) or replay()
    obs = vectors(folder, frames(2 * STEPS + 2, seed=5))
    second = fleet.arena.session_views[1]
    before = {n: v.clone() for n, v in second.items()}
    for o in obs:
        got = fleet.step_all(np.stack([o] * 2), active=np.array([True, False]))
        assert torch.equal(got[0], alone.step(o).cpu())
    assert len(computed) == 3           # the first robot's chunks, at steps 0, 5 and 10
    assert all(torch.equal(before[n], v) for n, v in second.items())
    for o in obs[:STEPS + 1]:
        got = fleet.step_all(np.stack([o] * 2), active=np.array([False, True]))
        assert torch.equal(got[1], fresh.step(o).cpu())


@pytest.mark.parametrize('device', DEVICES)
def test_a_capsule_mid_chunk_replays_the_same_actions_eight_times(folders, tmp_path, device):
    vlm, folder = folders
    engine = _engine(folder, tmp_path, device)
    obs_seq = vectors(folder, frames(2 * STEPS + 6, seed=1))
    # the replay crosses the next chunk, computed from the restored rng counter and inputs
    later = obs_seq[STEPS + 2:]
    want = check_a_capsule_replays(engine, obs_seq[:STEPS + 2], later)
    fresh = steps_in_a_fresh_process(
        engine, 'mid', 'from test_lerobot_chunk import _engine\n'
        f'e = _engine({folder!r}, pathlib.Path({str(tmp_path)!r}), {device!r})', later, tmp_path)
    assert torch.equal(fresh, want.cpu())


@pytest.mark.parametrize('device', DEVICES)
def test_the_prefix_is_reused_for_the_same_observation_only(folders, tmp_path, device):
    """A chunk whose observation is bit for bit the one the session's prefix came from skips
    the prefix pass, with LeRobot's actions all the same: a robot standing still, and an
    episode restarted (its start capsule, then the 'kv' buffers of a capsule taken after its
    first chunk), 8 times. One ulp off, or -0.0 for 0.0, and the prefix is computed again."""
    _, folder = folders
    reference, (pre, post) = SmolVLAPolicy.from_pretrained(folder).eval().to(device), \
        pipeline(folder)
    engine = _engine(folder, tmp_path, device)
    policy = engine.policy
    frame = frames(1, seed=3)[0]
    frame[next(iter(CAMERAS))][0, 0, 0] = 0.0     # a pixel of exactly 0.0 (its negative below)
    still = vectors(folder, [frame])[0]

    def lerobots(chunks):
        reference.reset()
        return [post(reference.select_action(_on(device, pre(dict(frame))), noise=gaussian_noise(
            torch.tensor([SEED], device=device), torch.tensor([t // STEPS], device=device),
            CHUNK * 16).view(1, CHUNK, 16)))[0].cpu() for t in range(chunks * STEPS)]

    engine.snapshot('start')
    want = lerobots(3)
    got = [engine.step(still).cpu() for _ in range(3 * STEPS)]
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert policy.prefix_reused == 2        # chunks 2 and 3: the prefix of chunk 1
    check_restarts_reuse_the_prefix(engine, still, want[0])
    # not the same bits: the prefix pass runs, the kept prefix is replaced
    nudged = [still.copy() for _ in range(2)]
    nudged[0][3] = np.nextafter(still[3], np.float32(np.inf))
    assert still[STATE_DIM] == 0 and not np.signbit(still[STATE_DIM])
    nudged[1][STATE_DIM] = -0.0
    for changed in nudged:
        check_changed_bits_recompute(engine, changed)


def test_the_finite_flag_covers_the_kept_prefix_but_not_its_key(folders, tmp_path):
    """prefix_obs, the kept prefix's key, is a copy of a checked observation and only ever
    compared with one: the finite flag leaves it out (a pass over 11 MB a step for three VGA
    cameras on the CPU), and a NaN there matches no observation, so the prefix pass runs
    again. The cache the model wrote stays covered: a NaN in it poisons the step."""
    _, folder = folders
    engine = _engine(folder, tmp_path)
    policy, still = engine.policy, vectors(folder, frames(1, seed=3))[0]
    engine.step(still)
    engine.snapshot('first')
    policy.views['prefix_obs'][0] = float('nan')
    engine.step(still)                      # a pop
    assert engine.last_step_finite
    engine.restore('first')
    policy.views['prefix_obs'][0] = float('nan')
    policy.views['left'].zero_()            # the next step computes a chunk
    reused = policy.prefix_reused
    engine.step(still)
    assert engine.last_step_finite and policy.prefix_reused == reused     # recomputed
    assert torch.equal(policy.views['prefix_obs'], torch.from_numpy(still))
    engine.restore('first')
    policy.views['prefix_k'][0, 0, 0, 0, 0] = float('nan')
    engine.step(still)
    assert not engine.last_step_finite


def test_no_statistics_and_unknown_cameras_are_refused(folders):
    vlm, _ = folders
    lerobot = smolvla(vlm)
    with pytest.raises(InvalidConfig, match='no mean/std statistics'):
        SmolVLAChunkPolicy(lerobot)
    stats = {'observation.state': {'mean': [0.0] * STATE_DIM, 'std': [1.0] * STATE_DIM}}
    with pytest.raises(InvalidConfig, match="normalises 'action'"):
        SmolVLAChunkPolicy(lerobot, stats=stats)
    with pytest.raises(InvalidConfig, match='cameras'):
        SmolVLAChunkPolicy(lerobot, stats=None, cameras={'observation.images.side': (3, 8, 8)})


def test_empty_cameras_are_lerobots_placeholders_not_the_robots(folders, tmp_path):
    """A checkpoint trained with empty_cameras: its config lists
    observation.images.empty_camera_0 among the images, which LeRobot fills itself (an image
    of -1, masked out) when the batch lacks it, as a robot's batch does. The node asks no
    camera for it, and the actions are LeRobot's pipeline's on the robot's cameras, bit for
    bit; a camera fed there (attended to) would change them, and is refused."""
    from flashrt_ros.runtime.policies.lerobot_checkpoint import (checkpoint_inputs,
                                                                 checkpoint_sizes)
    vlm, _ = folders
    folder = checkpoint(vlm, tmp_path / 'checkpoint', empty_cameras=1)
    placeholder = 'observation.images.empty_camera_0'
    reference = SmolVLAPolicy.from_pretrained(folder).eval()
    assert placeholder in reference.config.image_features
    cameras, _, _ = checkpoint_inputs(folder)
    assert list(cameras) == list(CAMERAS)
    assert checkpoint_sizes(folder)[1] == len(vectors(folder, frames(1))[0])
    pre, post = pipeline(folder)
    engine = _engine(folder, tmp_path)
    assert list(engine.policy.cameras) == list(CAMERAS)
    batch = frames(2 * STEPS + 1, seed=3)
    for t, (frame, obs) in enumerate(zip(batch, vectors(folder, batch))):
        noise = gaussian_noise(torch.tensor([SEED]), torch.tensor([t // STEPS]),
                               CHUNK * 16).view(1, CHUNK, 16)
        want = post(reference.select_action(pre(dict(frame)), noise=noise))[0]
        assert torch.equal(engine.step(obs), want), t
    # a frame fed as the placeholder is a camera to the model: other actions
    fed = dict(batch[0], **{placeholder: torch.zeros(3, *CAMERAS[next(iter(CAMERAS))][1:])})
    reference.reset()
    noise = gaussian_noise(torch.tensor([SEED]), torch.tensor([0]), CHUNK * 16).view(
        1, CHUNK, 16)
    first = post(reference.select_action(pre(dict(batch[0])), noise=noise))[0]
    reference.reset()
    assert not torch.equal(post(reference.select_action(pre(fed), noise=noise))[0], first)
    with pytest.raises(InvalidConfig, match='empty_cameras'):
        SmolVLAChunkPolicy.from_pretrained(folder, cameras={**CAMERAS, placeholder: (3, 8, 8)})


def test_an_instruction_longer_than_the_checkpoint_reads_is_told(folders):
    """LeRobot's tokenizer step cuts an instruction to tokenizer_max_length, and so does the
    node (the model reads no more; its actions are LeRobot's), but it says so: a warning with
    the instruction's whole length; one that fits, none."""
    import types

    from flashrt_ros.node.camera_readings import CameraReadings
    from flashrt_ros.runtime.policies.lerobot_checkpoint import checkpoint_inputs
    from support.smolvla import TASKS, TOKENS
    _, folder = folders
    cameras, tokens, tokenize = checkpoint_inputs(folder)
    warnings = []
    log = types.SimpleNamespace(warning=warnings.append, info=lambda _: None)
    setup = types.SimpleNamespace(cameras=cameras, tokens=tokens, tokenize=tokenize,
                                  state_dim=STATE_DIM)
    cfg = types.SimpleNamespace(joint_names=[f'j{i}' for i in range(STATE_DIM)],
                                instruction='', camera_sync='newest',
                                joint_offset=[], joint_scale=[], max_input_age=0.1)
    readings = CameraReadings(setup, cfg, 'cpu', None, log)
    readings.instruction('go')
    assert not warnings and tokenize.length('go') < tokens == TOKENS
    readings.instruction(TASKS[0])
    (told,) = warnings
    assert f'is {tokenize.length(TASKS[0])} tokens' in told and f'first {TOKENS}' in told
    ids, mask = tokenize(TASKS[0])      # what the model reads: LeRobot's cut, as before
    assert mask.all() and len(ids) == TOKENS


def test_a_checkpoint_trained_on_a_gpu_loads_without_one(folders, tmp_path):
    """A checkpoint lerobot-train wrote on a GPU names cuda in its config.json and in its
    processors' device steps (LeRobot's scripts override them with the run's device): the
    node loads it on a machine without CUDA too (it asserted there), and its tokens and
    actions are those of LeRobot's pipeline run on the CPU."""
    import shutil

    from flashrt_ros.runtime.policies.lerobot_checkpoint import checkpoint_inputs
    _, folder = folders
    gpu = tmp_path / 'gpu'
    shutil.copytree(folder, gpu)
    for name in ('config.json', 'policy_preprocessor.json', 'policy_postprocessor.json'):
        saved = json.loads((gpu / name).read_text())
        for step in saved.get('steps', []):
            if step['registry_name'] == 'device_processor':
                step['config']['device'] = 'cuda'
        if name == 'config.json':
            saved['device'] = 'cuda'
        (gpu / name).write_text(json.dumps(saved))
    _, _, tokenize = checkpoint_inputs(str(gpu))
    reference, (pre, post) = SmolVLAPolicy.from_pretrained(str(gpu)).eval().to('cpu'), \
        pipeline(str(gpu), device='cpu')
    engine = _engine(str(gpu), tmp_path)
    for t, frame in enumerate(frames(STEPS + 1, seed=2)):
        noise = gaussian_noise(torch.tensor([SEED]), torch.tensor([t // STEPS]),
                               CHUNK * 16).view(1, CHUNK, 16)
        want = post(reference.select_action(pre(dict(frame)), noise=noise))[0]
        obs = np.concatenate([frame['observation.state'].numpy(),
                              *[frame[k].numpy().ravel() for k in CAMERAS],
                              *tokenize(frame['task'])])
        assert torch.equal(engine.step(obs), want), t


def test_a_prompt_padded_to_its_own_length_is_padded_to_the_checkpoints(folders, tmp_path):
    """SmolVLA's default pad_language_to, longest: LeRobot's prompt is as long as each
    instruction, the engine's shapes are static. tokenize pads it to tokenizer_max_length
    (masked out) and says so; the actions agree with LeRobot's within a float32 rounding
    bound (1e-5: the attention sums over more keys, all masked), short prompts and full ones
    alike. (It failed: the short prompt's ids did not fit the observation.)"""
    import shutil
    import types

    from flashrt_ros.node.camera_readings import CameraReadings
    from flashrt_ros.runtime.policies.lerobot_checkpoint import checkpoint_inputs
    from support.smolvla import TASKS, TOKENS
    _, folder = folders
    longest = tmp_path / 'longest'
    shutil.copytree(folder, longest)
    config = json.loads((longest / 'config.json').read_text())
    config['pad_language_to'] = 'longest'
    (longest / 'config.json').write_text(json.dumps(config))
    saved = json.loads((longest / 'policy_preprocessor.json').read_text())
    (step,) = [s['config'] for s in saved['steps'] if s['registry_name'] == 'tokenizer_processor']
    step['padding'] = 'longest'
    (longest / 'policy_preprocessor.json').write_text(json.dumps(saved))
    cameras, tokens, tokenize = checkpoint_inputs(str(longest))
    assert tokenize.padded_from == 'longest' and tokens == TOKENS
    told = []       # the node says so at configure
    CameraReadings(types.SimpleNamespace(cameras=cameras, tokens=tokens, tokenize=tokenize,
                                         state_dim=STATE_DIM),
                   types.SimpleNamespace(joint_names=[f'j{i}' for i in range(STATE_DIM)],
                                         instruction='', camera_sync='newest',
                                         joint_offset=[], joint_scale=[], max_input_age=0.1),
                   'cpu', None, types.SimpleNamespace(warning=told.append))
    assert len(told) == 1 and 'within float rounding' in told[0]
    reference, (pre, post) = SmolVLAPolicy.from_pretrained(str(longest)).eval(), \
        pipeline(str(longest))
    engine = _engine(str(longest), tmp_path)
    short = 0
    for t, frame in enumerate(frames(2 * STEPS, seed=6)):
        frame['task'] = ('go', TASKS[0])[t // STEPS]
        fed = pre(dict(frame))
        short += fed['observation.language.tokens'].shape[-1] < TOKENS
        noise = gaussian_noise(torch.tensor([SEED]), torch.tensor([t // STEPS]),
                               CHUNK * 16).view(1, CHUNK, 16)
        want = post(reference.select_action(fed, noise=noise))[0]
        obs = np.concatenate([frame['observation.state'].numpy(),
                              *[frame[k].numpy().ravel() for k in CAMERAS],
                              *tokenize(frame['task'])])
        torch.testing.assert_close(engine.step(obs), want, rtol=1e-5, atol=1e-5)
    assert short == STEPS       # LeRobot's prompt was shorter than the engine's for 'go'


def test_a_checkpoint_that_compiles_is_refused_and_changes_nothing(folders, tmp_path):
    """compile_model: LeRobot would compile entry points the engine does not call and, while
    building the policy, switch every float32 matmul of the process to TF32; the load is
    refused and the process keeps its precision."""
    import shutil
    _, folder = folders
    compiling = tmp_path / 'compiling'
    shutil.copytree(folder, compiling)
    config = json.loads((compiling / 'config.json').read_text())
    config['compile_model'] = True
    (compiling / 'config.json').write_text(json.dumps(config))
    before = torch.get_float32_matmul_precision()
    with pytest.raises(InvalidConfig, match='compile_model'):
        SmolVLAChunkPolicy.from_pretrained(str(compiling))
    assert torch.get_float32_matmul_precision() == before == 'highest'


def test_the_model_digest_follows_the_model_not_its_path(folders, tmp_path):
    """Capsules check the model digest: the same weights and settings from a VLM folder at
    another path give the same digest (a moved checkpoint keeps its capsules), other denoising
    steps or statistics another."""
    vlm, _ = folders
    moved = vlm_folder(tmp_path / 'elsewhere')
    stats = statistics()
    digest = SmolVLAChunkPolicy(smolvla(vlm), stats=stats).model_digest()
    assert SmolVLAChunkPolicy(smolvla(moved), stats=stats).model_digest() == digest
    assert SmolVLAChunkPolicy(smolvla(vlm, num_steps=4), stats=stats).model_digest() != digest
    assert SmolVLAChunkPolicy(smolvla(vlm), stats=statistics(1)).model_digest() != digest


@pytest.fixture(scope='module')
def act_folder(tmp_path_factory):
    from flashrt_ros.runtime.policies.lerobot_demo import act_checkpoint
    return act_checkpoint(tmp_path_factory.mktemp('act'))


@pytest.mark.parametrize('kind', ['act', 'smolvla'])
def test_weights_missing_from_the_checkpoint_are_refused_not_left_random(folders, act_folder,
                                                                         tmp_path, kind):
    """LeRobot's loader keeps a weight missing from model.safetensors at its random initial
    value with a warning (from_pretrained's strict=False): the node would act on it. A
    weight left out, a config with a layer more than its weights, no weights file: each
    refused by name; the folder as written loads, a weight beyond the config's is left unused
    (as LeRobot leaves it), and LeRobot's class and module are as they were."""
    import shutil

    from safetensors.torch import load_file, save_file

    from flashrt_ros.runtime.policies import ACTChunkPolicy
    from flashrt_ros.runtime.policies.lerobot_checkpoint import load_lerobot
    cls, folder = (ACTChunkPolicy, act_folder) if kind == 'act' else \
        (SmolVLAChunkPolicy, folders[1])
    cls.from_pretrained(str(folder))

    def edited(name):
        copy = tmp_path / name
        shutil.copytree(folder, copy)
        return copy
    short = edited('short')
    weights = load_file(short / 'model.safetensors')
    save_file(dict(list(weights.items())[1:]), short / 'model.safetensors')
    none = edited('none')
    (none / 'model.safetensors').unlink()
    cases = [(short, 'lacks 1 of the weights'), (none, 'holds no model.safetensors')]
    if kind == 'act':       # (SmolVLA's layer counts are its VLM folder's)
        deeper = edited('deeper')
        config = json.loads((deeper / 'config.json').read_text())
        config['n_encoder_layers'] += 1
        (deeper / 'config.json').write_text(json.dumps(config))
        cases.append((deeper, 'lacks .* of the weights'))
    for bad, words in cases:
        with pytest.raises(InvalidConfig, match=words):
            cls.from_pretrained(str(bad))
    # a weight the config has no place for is left unused, as LeRobot leaves it
    extra = edited('extra')
    save_file({**weights, 'model.unused_head.weight': torch.ones(2)},
              extra / 'model.safetensors')
    assert load_lerobot(kind, str(extra)) is not None
    from lerobot.policies import pretrained
    from lerobot.policies.factory import get_policy_class
    assert 'load_state_dict' not in get_policy_class(kind).__dict__
    assert pretrained.log_model_loading_keys.__module__.startswith('lerobot.')


def test_a_folder_of_another_policy_or_of_none_is_refused_by_name(folders, act_folder,
                                                                  tmp_path):
    """policy_file names a checkpoint of another policy type: refused with both types (LeRobot
    would build the asked class on the other's config and fail on an attribute, or worse); a
    type this package does not serve, a config that is not a policy's, or no config at all
    are refused by name too, before LeRobot looks for the folder on the hub."""
    from flashrt_ros.runtime.policies import make_policy
    from flashrt_ros.runtime.policies.lerobot_checkpoint import checkpoint_sizes
    _, smolvla_folder = folders
    with pytest.raises(InvalidConfig, match='holds a LeRobot act policy .* not smolvla: set '
                                            'policy_type act'):
        make_policy('smolvla', 10, ACT_DIM, file=str(act_folder))
    with pytest.raises(InvalidConfig, match='holds a LeRobot smolvla policy .* not act'):
        make_policy('act', 10, ACT_DIM, file=str(smolvla_folder))
    other = tmp_path / 'groot'
    other.mkdir()
    (other / 'config.json').write_text(json.dumps({'type': 'groot'}))
    with pytest.raises(InvalidConfig, match='groot policy .* does not serve'):
        make_policy('pi05', 10, ACT_DIM, file=str(other))
    (other / 'config.json').write_text('[]')
    with pytest.raises(InvalidConfig, match='names no policy "type"'):
        make_policy('act', 10, ACT_DIM, file=str(other))
    for call in (lambda: make_policy('act', 10, ACT_DIM, file=str(tmp_path / 'none')),
                 lambda: checkpoint_sizes(tmp_path / 'none')):
        with pytest.raises(InvalidConfig, match='not a LeRobot checkpoint folder'):
            call()
    # ACT with an environment state and no joint state: nothing for the robot's joints
    import shutil
    stateless = tmp_path / 'stateless'
    shutil.copytree(act_folder, stateless)
    config = json.loads((stateless / 'config.json').read_text())
    config['input_features']['observation.environment_state'] = \
        config['input_features'].pop('observation.state')
    (stateless / 'config.json').write_text(json.dumps(config))
    with pytest.raises(InvalidConfig, match='act checkpoint without observation.state'):
        checkpoint_sizes(stateless)


@pytest.mark.parametrize('device', DEVICES)
def test_act_equals_lerobots_pipeline_and_a_capsule_replays(act_folder, tmp_path, device):
    """ACT (the images normalised per channel too): the engine equals LeRobot's pre-processor,
    select_action and post-processor bit for bit over three chunks; a capsule mid-chunk
    replays the same actions 8 times."""
    from lerobot.policies.act.modeling_act import ACTPolicy

    from flashrt_ros.runtime.policies import ACTChunkPolicy
    reference = ACTPolicy.from_pretrained(act_folder).eval().to(device)
    pre, post = pipeline(act_folder)
    engine = PolicyEngine(ACTChunkPolicy.from_pretrained(act_folder), device=device,
                          capsule_dir=str(tmp_path / 'capsules'))
    assert engine.policy._chunk_graph.captured == (device == 'cuda')
    batch = [{k: v for k, v in f.items() if k != 'task'} for f in frames(3 * STEPS, seed=3)]
    obs = [np.concatenate([f['observation.state'].numpy(),
                           *[f[k].numpy().ravel() for k in f if k.startswith('observation.im')]])
           for f in batch]
    assert engine.obs_dim == obs[0].size
    got = []
    for t, (frame, o) in enumerate(zip(batch, obs)):
        want = post(reference.select_action(_on(device, pre(dict(frame)))))[0]
        got.append(engine.step(o))
        assert torch.equal(got[-1].cpu(), want.cpu()), t
        if t == STEPS + 1:
            engine.snapshot('mid')
    later = torch.stack(got[STEPS + 2:])        # the run after the capsule, a chunk included
    for _ in range(8):
        engine.restore('mid')
        assert torch.equal(torch.stack([engine.step(o) for o in obs[STEPS + 2:]]), later)


@pytest.mark.parametrize('kind', ['act', 'diffusion'])
def test_an_input_the_node_does_not_feed_is_refused(kind):
    """A checkpoint trained with an environment-state input (ACT and Diffusion Policy take
    one): the node feeds the state and the cameras only; refused at load, naming it (ACT
    failed on its first step with a KeyError)."""
    from lerobot.configs.types import FeatureType, PolicyFeature

    from flashrt_ros.runtime.policies import ACTChunkPolicy, DiffusionChunkPolicy
    from flashrt_ros.runtime.policies.lerobot_demo import act, diffusion
    policy = (act if kind == 'act' else diffusion)(seed=0)
    policy.config.input_features['observation.environment_state'] = PolicyFeature(
        FeatureType.ENV, (4,))
    with pytest.raises(InvalidConfig, match='observation.environment_state'):
        (ACTChunkPolicy if kind == 'act' else DiffusionChunkPolicy)(policy)


def _check_act_equals_lerobots_pipeline(folder, tmp_path):
    """The engine's ACT on the checkpoint folder acts as LeRobot's pipeline, bit for bit."""
    from lerobot.policies.act.modeling_act import ACTPolicy

    from flashrt_ros.runtime.policies import ACTChunkPolicy
    reference = ACTPolicy.from_pretrained(folder).eval()
    pre, post = pipeline(folder)
    engine = PolicyEngine(ACTChunkPolicy.from_pretrained(folder), device='cpu',
                          capsule_dir=str(tmp_path / 'capsules'))
    for frame in [{k: v for k, v in f.items() if k != 'task'} for f in frames(2, seed=5)]:
        obs = np.concatenate([frame['observation.state'].numpy(), *[
            frame[k].numpy().ravel() for k in frame if k.startswith('observation.im')]])
        want = post(reference.select_action(pre(dict(frame))))[0]
        assert torch.equal(engine.step(obs), want)


def test_actions_are_unnormalised_with_the_post_processors_statistics(tmp_path):
    """LeRobot's pipeline unnormalises the actions with its post-processor's statistics (a
    file of their own), normalises the inputs with its pre-processor's: where a checkpoint's
    two differ (a post-processor saved again), the engine's actions are still LeRobot's bit
    for bit, not those of the pre-processor's copy."""
    import pathlib

    from safetensors.torch import load_file, save_file

    from flashrt_ros.runtime.policies.lerobot_demo import act_checkpoint
    folder = act_checkpoint(tmp_path / 'act')
    files = list(pathlib.Path(folder).glob('policy_postprocessor_*unnormalizer*.safetensors'))
    assert len(files) == 1, files
    saved = load_file(files[0])
    saved['action.mean'] = saved['action.mean'] + 1.0
    save_file(saved, files[0])
    _check_act_equals_lerobots_pipeline(folder, tmp_path)


@pytest.mark.parametrize('edit', ['eps', 'norm_map', 'features'])
def test_inputs_are_normalised_as_the_pre_processors_step_says(tmp_path, edit):
    """LeRobot's pipeline normalises with its pre-processor step's own eps, norm_map and
    features (policy_preprocessor.json), not config.json's normalization_mapping: a
    processor saved with an eps of its own, with cameras left unnormalised, or without one
    camera among its features still gives the engine LeRobot's actions bit for bit."""
    import pathlib

    from flashrt_ros.runtime.policies.lerobot_demo import act_checkpoint
    folder = act_checkpoint(tmp_path / 'act')
    path = pathlib.Path(folder) / 'policy_preprocessor.json'
    saved = json.loads(path.read_text())
    (step,) = [s['config'] for s in saved['steps'] if s['registry_name'] == 'normalizer_processor']
    if edit == 'eps':
        step['eps'] = 0.25
    elif edit == 'norm_map':
        step['norm_map']['VISUAL'] = 'IDENTITY'
    else:
        del step['features']['observation.images.wrist']
    path.write_text(json.dumps(saved))
    _check_act_equals_lerobots_pipeline(folder, tmp_path)


@pytest.mark.parametrize('side, edit', [
    ('preprocessor', {'registry_name': 'image_crop_resize_processor',
                      'config': {'crop_params_dict': None, 'resize_size': [16, 16]}}),
    ('preprocessor', 'bfloat16'), ('postprocessor', 'float16'),
    # LeRobot 0.6's Pi0 processors hold it always; enabled, the actions are relative
    ('preprocessor', {'registry_name': 'relative_actions_processor',
                      'config': {'enabled': True}}),
    ('postprocessor', {'registry_name': 'map_delta_action_to_robot_action', 'config': {}})])
def test_a_processor_step_the_node_does_not_run_is_refused(tmp_path, side, edit):
    """A step in a checkpoint's processors that LeRobot runs on every observation or action
    and the engine does not (a resize, a delta-action map), or a device step casting the
    floats, would make the node's actions differ from LeRobot's without an error: the
    checkpoint is refused at load, naming it."""
    import pathlib

    from flashrt_ros.runtime.policies import ACTChunkPolicy
    from flashrt_ros.runtime.policies.lerobot_demo import act_checkpoint
    folder = act_checkpoint(tmp_path / 'act')
    path = pathlib.Path(folder) / f'policy_{side}.json'
    saved = json.loads(path.read_text())
    if isinstance(edit, dict):
        saved['steps'].insert(1, edit)
        told = edit['registry_name']
    else:
        (step,) = [s['config'] for s in saved['steps'] if s['registry_name'] == 'device_processor']
        step['float_dtype'] = told = edit
    path.write_text(json.dumps(saved))
    with pytest.raises(InvalidConfig, match=told):
        ACTChunkPolicy.from_pretrained(folder)


@pytest.mark.parametrize('rename_map', [
    {'observation.images.top': 'observation.images.wrist',
     'observation.images.wrist': 'observation.images.top'},
    {'observation.images.front': 'observation.images.top'}])
def test_a_rename_map_between_the_models_own_inputs_is_refused(tmp_path, rename_map):
    """lerobot-train --rename_map saves the map in the pre-processor's rename step, and
    LeRobot renames every observation's keys with it. The node names its inputs by the
    model's features: a map that renames one of them (here the two cameras swapped) would
    swap what the model sees, without an error (an audit measured actions 0.18 apart), so it
    is refused, naming the map; one from other names (a dataset's) onto the model's changes
    nothing here, and the actions are LeRobot's bit for bit."""
    import pathlib

    from flashrt_ros.runtime.policies import ACTChunkPolicy
    from flashrt_ros.runtime.policies.lerobot_demo import act_checkpoint
    folder = act_checkpoint(tmp_path / 'act')
    path = pathlib.Path(folder) / 'policy_preprocessor.json'
    saved = json.loads(path.read_text())
    (step,) = [s['config'] for s in saved['steps']
               if s['registry_name'] == 'rename_observations_processor']
    step['rename_map'] = rename_map
    path.write_text(json.dumps(saved))
    if 'observation.images.front' in rename_map:
        _check_act_equals_lerobots_pipeline(folder, tmp_path)
        return
    with pytest.raises(InvalidConfig, match='rename_map'):
        ACTChunkPolicy.from_pretrained(folder)


def test_a_checkpoint_without_processor_files_is_refused_naming_the_migration(tmp_path):
    """LeRobot < 0.4 kept the normalisation in the model, with no processor files: refused
    naming LeRobot's migration script, not with a bare file-not-found."""
    import pathlib

    from flashrt_ros.runtime.policies import ACTChunkPolicy
    from flashrt_ros.runtime.policies.lerobot_demo import act_checkpoint
    folder = act_checkpoint(tmp_path / 'act')
    (pathlib.Path(folder) / 'policy_postprocessor.json').unlink()
    with pytest.raises(InvalidConfig, match='migrate_policy_normalization'):
        ACTChunkPolicy.from_pretrained(folder)


def test_a_peft_adapter_is_refused_naming_its_base(tmp_path):
    """A checkpoint lerobot-train saved with use_peft holds an adapter; LeRobot loads the base
    policy its adapter_config.json names (often a hub id) under it: refused by name, with the
    merge that makes a folder the node loads."""
    import pathlib

    from flashrt_ros.runtime.policies import ACTChunkPolicy, make_policy
    from flashrt_ros.runtime.policies.lerobot_demo import act_checkpoint
    folder = pathlib.Path(act_checkpoint(tmp_path / 'act'))
    config = json.loads((folder / 'config.json').read_text())
    (folder / 'config.json').write_text(json.dumps({**config, 'use_peft': True}))
    (folder / 'adapter_config.json').write_text(json.dumps(
        {'peft_type': 'LORA', 'base_model_name_or_path': 'lerobot/smolvla_base'}))
    for call in (lambda: ACTChunkPolicy.from_pretrained(folder),
                 lambda: make_policy('act', 1, ACT_DIM, file=str(folder))):
        with pytest.raises(InvalidConfig, match='PEFT adapter .* on lerobot/smolvla_base: '
                                                'merge it'):
            call()


@pytest.mark.parametrize('device', DEVICES)
def test_act_temporal_ensembling_equals_lerobots_and_a_capsule_replays(tmp_path, device):
    """ACT with temporal_ensemble_coeff: a chunk every step, each action the weighted average
    LeRobot's ACTTemporalEnsembler makes of every chunk's prediction for that step: equal to
    LeRobot's pipeline bit for bit over more steps than a chunk holds (the averages' counts
    saturate), across a reset; a capsule taken mid-run (the running averages and counts)
    replays the same actions 8 times."""
    from lerobot.policies.act.modeling_act import ACTPolicy

    from flashrt_ros.runtime.policies import ACTChunkPolicy
    from flashrt_ros.runtime.policies.lerobot_demo import act_checkpoint
    folder = act_checkpoint(tmp_path / 'act', temporal_ensemble_coeff=0.01, n_action_steps=1)
    reference = ACTPolicy.from_pretrained(folder).eval().to(device)
    pre, post = pipeline(folder)
    engine = PolicyEngine(ACTChunkPolicy.from_pretrained(folder), device=device,
                          capsule_dir=str(tmp_path / 'capsules'))
    assert engine.policy.fresh_chunk(engine.policy.views) is None    # no one chunk to publish
    frames_ = [{k: v for k, v in f.items() if k != 'task'}
               for f in frames(2 * CHUNK + 3, seed=5)]
    obs = [np.concatenate([f['observation.state'].numpy(),
                           *[f[k].numpy().ravel() for k in f if k.startswith('observation.im')]])
           for f in frames_]
    got = []
    for t, (frame, o) in enumerate(zip(frames_, obs)):
        if t == CHUNK + 1:          # a new episode: both start their averages afresh
            reference.reset()
            engine.reset_episode()
        want = post(reference.select_action(_on(device, pre(dict(frame)))))[0]
        got.append(engine.step(o))
        assert torch.equal(got[-1].cpu(), want.cpu()), t
        if t == CHUNK - 2:
            engine.snapshot('mid')
    later = torch.stack(got[CHUNK - 1:CHUNK + 1])       # before the reset
    for _ in range(8):
        engine.restore('mid')
        assert torch.equal(torch.stack([engine.step(o) for o in obs[CHUNK - 1:CHUNK + 1]]),
                           later)


def test_token_ids_that_are_not_the_models_are_refused_before_the_state_moves(
        folders, tmp_path):
    """A token id that is no integer, negative or past the vocabulary, or a mask value other
    than 0 and 1, would be embedded as another token without an error: refused, counted, and
    the state is what it was (the next good step gives the same action as without them)."""
    _, folder = folders
    engine, twin = _engine(folder, tmp_path / 'a'), _engine(folder, tmp_path / 'b')
    obs = vectors(folder, frames(2))
    tokens = engine.policy.tokens
    engine.step(obs[0])
    twin.step(obs[0])
    for position, value in ((-2 * tokens, 3.5), (-2 * tokens + 1, -1.0),
                            (-tokens - 1, 1e6), (-1, 0.5)):
        bad = obs[1].copy()
        bad[position] = value
        with pytest.raises(InvalidObservation, match='instruction'):
            engine.step(bad)
        with pytest.raises(InvalidObservation, match='instruction'):
            engine.step_all(torch.from_numpy(bad)[None])       # on the device path too
    assert engine.rejected_observations == 8
    assert torch.equal(engine.step(obs[1]), twin.step(obs[1]))


def test_a_diffusion_horizon_shorter_than_its_queue_draws_chunks_as_lerobot(tmp_path):
    """LeRobot's Diffusion queues the horizon's actions from the current observation on, at
    most n_action_steps: with n_obs_steps == horizon one a chunk, a chunk every step (its
    config accepts n_action_steps 3 there). The engine's queue of 3 took that one action
    three times, without an error (an audit measured actions 1.29 apart); now its queue is
    as long as LeRobot's and the actions are LeRobot's bit for bit."""
    from lerobot.policies.diffusion.modeling_diffusion import DiffusionPolicy

    from flashrt_ros.runtime.policies import DiffusionChunkPolicy
    from flashrt_ros.runtime.policies.lerobot_demo import DIFFUSION_SIZES, diffusion_checkpoint
    from flashrt_ros.runtime.policies.lerobot_diffusion import chunk_seed
    folder = diffusion_checkpoint(tmp_path / 'd', horizon=4, n_obs_steps=4, n_action_steps=3)
    reference, (pre, post) = DiffusionPolicy.from_pretrained(folder).eval(), pipeline(folder)
    engine = PolicyEngine(DiffusionChunkPolicy.from_pretrained(folder, seed=SEED),
                          device='cpu', capsule_dir=str(tmp_path / 'capsules'))
    rng, chunks = np.random.default_rng(5), 0
    for t in range(5):
        frame = {'observation.state': torch.from_numpy(rng.standard_normal(STATE_DIM)).float(),
                 **{k: torch.from_numpy(rng.random(s, dtype=np.float32))
                    for k, s in DIFFUSION_SIZES['demo']['cameras'].items()}}
        if len(reference._queues['action']) == 0:   # LeRobot draws a chunk: the engine's seed
            torch.default_generator.manual_seed(chunk_seed(SEED, chunks))
            chunks += 1
        want = post(reference.select_action(pre(dict(frame))))[0]
        got = engine.step(np.concatenate([frame[k].numpy().ravel() for k in frame]))
        assert torch.equal(got, want), t
    assert chunks == 5 and engine.policy.views['rng'][1].item() == 5


@pytest.mark.parametrize('scheduler', ['DDPM', 'DDIM'])
@pytest.mark.parametrize('device', DEVICES)
def test_diffusion_equals_lerobots_pipeline_and_a_capsule_replays(tmp_path, device, scheduler):
    """Diffusion Policy: an observation history (filled with the first observation of an
    episode) conditions a denoising whose noise (the prior, and with DDPM every step's
    variance) LeRobot draws from torch's generator: given the seed the engine derives for each
    chunk from its rng buffer, the engine equals LeRobot's pipeline bit for bit over three
    chunks and across a reset, leaves the caller's generator as it was, and a capsule taken
    mid-chunk (history, chunk, rng) replays the same actions 8 times and in a fresh process."""
    from lerobot.policies.diffusion.modeling_diffusion import DiffusionPolicy

    from flashrt_ros.runtime.policies import DiffusionChunkPolicy
    from flashrt_ros.runtime.policies.lerobot_demo import DIFFUSION_SIZES, diffusion_checkpoint
    from flashrt_ros.runtime.policies.lerobot_diffusion import chunk_seed
    folder = diffusion_checkpoint(tmp_path / 'diffusion', noise_scheduler_type=scheduler)
    reference = DiffusionPolicy.from_pretrained(folder).eval().to(device)
    pre, post = pipeline(folder)
    engine = PolicyEngine(DiffusionChunkPolicy.from_pretrained(folder, seed=SEED),
                          device=device, capsule_dir=str(tmp_path / 'capsules'))
    assert engine.policy._chunk_graph.captured == (device == 'cuda')
    cameras, steps = DIFFUSION_SIZES['demo']['cameras'], engine.policy.steps
    rng = np.random.default_rng(11)
    frames_ = [{'observation.state': torch.from_numpy(rng.standard_normal(STATE_DIM)).float(),
                **{k: torch.from_numpy(rng.random(s, dtype=np.float32))
                   for k, s in cameras.items()}} for _ in range(4 * steps)]
    obs = [np.concatenate([f['observation.state'].numpy(),
                           *[f[k].numpy().ravel() for k in cameras]]) for f in frames_]
    generator = torch.cuda.default_generators[0] if device == 'cuda' else \
        torch.default_generator
    got, chunks = [], 0
    for t, (frame, o) in enumerate(zip(frames_, obs)):
        if t == 3 * steps + 1:      # a new episode: both start their history afresh
            reference.reset()
            engine.reset_episode()
            chunks = 0
        if len(reference._queues['action']) == 0:   # LeRobot draws a chunk: the engine's seed
            generator.manual_seed(chunk_seed(SEED, chunks))
            chunks += 1
        want = post(reference.select_action(_on(device, pre(dict(frame)))))[0]
        before = generator.get_state()
        got.append(engine.step(o))
        assert torch.equal(generator.get_state(), before), t
        assert torch.equal(got[-1].cpu(), want.cpu()), t
        if t == steps + 1:
            engine.snapshot('mid')
    later = torch.stack(got[steps + 2:3 * steps])         # a chunk's computation included
    for _ in range(8):
        engine.restore('mid')
        assert torch.equal(torch.stack([engine.step(o) for o in obs[steps + 2:3 * steps]]),
                           later)
    engine.save('mid', 'mid.capsule')       # and in a fresh process (the same capsule_dir)
    np.save(tmp_path / 'later.npy', np.stack(obs[steps + 2:3 * steps]))
    script = (
        'import sys, json, numpy; sys.path[:0] = %r\n'
        'from flashrt_ros.runtime.engine import PolicyEngine\n'
        'from flashrt_ros.runtime.policies import DiffusionChunkPolicy\n'
        'e = PolicyEngine(DiffusionChunkPolicy.from_pretrained(%r, seed=%d), device=%r, '
        'capsule_dir=%r)\n'
        'e.load("mid.capsule", "mid")\n'
        'e.restore("mid")\n'
        'print(json.dumps([e.step(o).tolist() for o in numpy.load("later.npy")]))\n'
        % (sys.path, folder, SEED, device, str(tmp_path / 'capsules')))
    out = subprocess.run([sys.executable, '-c', script], capture_output=True, text=True,
                         cwd=str(tmp_path), timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert torch.equal(torch.tensor(json.loads(out.stdout.strip().splitlines()[-1])),
                       later.cpu())
    # the noise matters: the engine of another seed draws other chunks
    other = PolicyEngine(DiffusionChunkPolicy.from_pretrained(folder, seed=SEED + 1),
                         device=device, capsule_dir=str(tmp_path / 'other'))
    assert not torch.equal(torch.stack([other.step(o) for o in obs[:steps]]).cpu(),
                           torch.stack(got[:steps]).cpu())


def _bfloat16_expert(folder, tmp_path, device):
    return PolicyEngine(SmolVLAChunkPolicy.from_pretrained(
        folder, seed=SEED, expert_dtype='bfloat16'), device=device,
        capsule_dir=str(tmp_path / 'capsules'))


@pytest.mark.parametrize('device', DEVICES)
def test_a_bfloat16_expert_is_opt_in_and_lerobots_with_the_same_cast(folders, tmp_path, device):
    """expert_dtype bfloat16: the actions are those of LeRobot's pipeline with its action
    expert cast the same way (expert_in_bfloat16), bit for bit, and not those of LeRobot's own
    (a float32 expert), so it is never the default; the prefix is the float32 expert's, bit
    for bit (the prefix pass does not use the expert); a capsule mid-chunk replays 8 times and
    in a fresh process that casts again; a capsule of the other dtype, another dtype and
    real-time chunking are refused."""
    from flashrt_ros.runtime.errors import IncompatibleCapsule
    from flashrt_ros.runtime.policies.lerobot_smolvla import expert_in_bfloat16
    _, folder = folders
    engine = _bfloat16_expert(folder, tmp_path, device)
    plain = _engine(folder, tmp_path, device)
    assert engine.policy.config()['expert_dtype'] == 'bfloat16'
    batch = frames(2 * STEPS + 3, seed=8)
    obs = vectors(folder, batch)
    got = [engine.step(o).cpu() for o in obs]
    float32 = [plain.step(o).cpu() for o in obs]
    for name in ('prefix_k', 'prefix_v', 'prefix_pad'):
        assert torch.equal(engine.policy.views[name], plain.policy.views[name]), name
    cast = SmolVLAPolicy.from_pretrained(folder).eval().to(device)
    expert_in_bfloat16(cast)
    pre, post = pipeline(folder)
    want = [post(cast.select_action(_on(device, pre(dict(frame))), noise=gaussian_noise(
        torch.tensor([SEED], device=device), torch.tensor([t // STEPS], device=device),
        CHUNK * 16).view(1, CHUNK, 16)))[0].cpu() for t, frame in enumerate(batch)]
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    worst = max(float((g - f).abs().max()) for g, f in zip(got, float32))
    assert 0 < worst < 0.1, worst       # bfloat16's rounding (actions O(1) here)
    check_replays_here_and_in_a_fresh_process(
        engine, obs[:STEPS + 2], obs[STEPS + 2:],
        'from test_lerobot_chunk import _bfloat16_expert\n'
        f'e = _bfloat16_expert({folder!r}, pathlib.Path({str(tmp_path)!r}), {device!r})',
        tmp_path)
    plain.snapshot('f32')
    path = str(tmp_path / 'capsules' / 'f32.capsule')
    plain.save('f32', path)
    with pytest.raises(IncompatibleCapsule):
        engine.load(path, 'f32')
    model = SmolVLAPolicy.from_pretrained(folder)
    for wrong, match in ((dict(expert_dtype='float16'), "expert_dtype 'float16'"),
                         (dict(expert_dtype='bfloat16', rtc_delay=2, rtc_queue_threshold=3),
                          'real-time chunking')):
        with pytest.raises(InvalidConfig, match=match):
            SmolVLAChunkPolicy(model, stats={}, **wrong)
    assert model.model.vlm_with_expert.lm_expert.dtype == torch.float32     # not cast
