"""LeRobot's Pi0 and Pi0.5 on the engine (runtime/policies/lerobot_pi0.py): their actions are
LeRobot's own
(its normaliser, predict_action_chunk with the same noise, its unnormaliser, select_action's
queue) bit for bit, chunk after chunk; a capsule taken mid-chunk replays the same actions
across the next chunk, 8 times and in a fresh process; with denoise_kernels 'compiled' within
rounding of LeRobot's and exact every time. The model is LeRobot's PI0Policy at
reduced sizes (support/pi0.py). Pi0 needs LeRobot >= 0.6 (Python >= 3.12): CI's Python 3.11
has LeRobot 0.4.4, so these run under tools/test_lerobot06.sh and on the GPU machine.
"""
import contextlib
from importlib.metadata import version

import numpy as np
import pytest
import torch

pytest.importorskip('lerobot.policies.pi0.modeling_pi0', reason='needs lerobot')
if tuple(int(p) for p in version('lerobot').split('.')[:2]) < (0, 6):
    pytest.skip(f'Pi0 needs LeRobot >= 0.6 (Python >= 3.12; this has {version("lerobot")}): '
                'bash tools/test_lerobot06.sh', allow_module_level=True)

from flashrt_ros.runtime.engine import PolicyEngine  # noqa: E402
from flashrt_ros.runtime.errors import InvalidConfig, InvalidObservation  # noqa: E402
from flashrt_ros.runtime.policies import gaussian_noise, Pi05ChunkPolicy, Pi0ChunkPolicy  # noqa
from flashrt_ros.runtime.policies import lerobot_pi0  # noqa: E402
from flashrt_ros.runtime.policies.lerobot_pi0 import vision_in_bfloat16  # noqa: E402
from support.rtc import lerobots_rtc_actions, rtc_config  # noqa: E402
from support.prefix import (check_a_capsule_replays, check_changed_bits_recompute,  # noqa
                            check_replays_here_and_in_a_fresh_process,
                            check_restarts_reuse_the_prefix, steps_in_a_fresh_process)
from support.pi0 import (ACT_DIM, CAMERA, checkpoint, CHUNK, frames, pi0, raw_frames,  # noqa
                         small_sizes, STEPS, vector)

SEED = 7
DEVICES = ['cpu', pytest.param('cuda', marks=pytest.mark.cuda)]


CLASSES = {'pi0': Pi0ChunkPolicy, 'pi05': Pi05ChunkPolicy}


@pytest.fixture(scope='module', params=sorted(CLASSES))
def model(request):
    return pi0(kind=request.param)


def _engine(model, device, tmp_path):
    policy, stats = model
    cls = CLASSES[policy.config.type]
    return PolicyEngine(cls(policy, stats=stats, seed=SEED), device=device,
                        capsule_dir=str(tmp_path / 'capsules'))


def _lerobots(model, device, batch):
    """LeRobot's pipeline on the frames: a chunk (the engine's noise for it) whenever its
    queue is empty, then the queue's next action, as select_action does."""
    from lerobot.processor.factory import make_default_pre_post_processors
    policy, stats = model
    policy.config.device = device
    pre, post = make_default_pre_post_processors(policy.config, stats)
    out, queue = [], []
    for t, frame in enumerate(batch):
        if not queue:
            noise = gaussian_noise(torch.tensor([SEED], device=device),
                                   torch.tensor([t // STEPS], device=device),
                                   CHUNK * 32).view(1, CHUNK, 32)
            chunk = policy.predict_action_chunk(pre(dict(frame)), noise=noise)[:, :STEPS]
            queue = list(post(chunk)[0])
        out.append(queue.pop(0).cpu())
    return out


@pytest.mark.parametrize('device', DEVICES)
def test_actions_equal_lerobots_pipeline_chunk_after_chunk(model, tmp_path, device):
    engine = _engine(model, device, tmp_path)
    assert engine.policy._chunk_graph.captured == (device == 'cuda')
    batch = frames(3 * STEPS + 1, engine.policy.vocabulary)
    got = [engine.step(vector(f)).cpu() for f in batch]
    want = _lerobots(model, device, batch)
    assert all(g.shape == (ACT_DIM,) and torch.equal(g, w) for g, w in zip(got, want))
    assert int(engine.policy.views['rng'][1]) == 4


@pytest.mark.parametrize('device', DEVICES)
def test_a_capsule_mid_chunk_replays_the_same_actions_eight_times(model, tmp_path, device):
    engine = _engine(model, device, tmp_path)
    obs = [vector(f) for f in frames(2 * STEPS + 3, engine.policy.vocabulary, seed=1)]
    later = obs[STEPS + 1:]       # crosses into the third chunk
    want = check_a_capsule_replays(engine, obs[:STEPS + 1], later)
    fresh = steps_in_a_fresh_process(
        engine, 'mid', 'from test_lerobot_pi0 import _engine\nfrom support.pi0 import pi0\n'
        f'e = _engine(pi0(kind={model[0].config.type!r}), {device!r}, '
        f'pathlib.Path({str(tmp_path)!r}))', later, tmp_path)
    assert torch.equal(fresh, want.cpu())


@pytest.mark.parametrize('device', DEVICES)
def test_use_amp_runs_as_lerobots_robot_scripts_run_it(model, tmp_path, device, monkeypatch):
    """A checkpoint saved with use_amp: LeRobot's predict_action (lerobot-record, the
    rollout) runs it under CUDA's autocast, float16, and as it is on the CPU; the engine
    likewise: LeRobot's actions bit for bit over three chunks (the kept prefix in the dtype
    the autocast prefix pass gives), a capsule mid-chunk replayed 8 times; on CUDA they are
    not the actions without use_amp."""
    monkeypatch.setattr(model[0].config, 'use_amp', True)
    engine = _engine(model, device, tmp_path)
    batch = frames(3 * STEPS + 1, engine.policy.vocabulary, seed=2)
    got = [engine.step(vector(f)).cpu() for f in batch]
    with torch.autocast('cuda') if device == 'cuda' else contextlib.nullcontext():
        want = _lerobots(model, device, batch)
    assert all(torch.equal(g, w.float()) for g, w in zip(got, want))
    assert engine.policy.config()['use_amp'] is True
    obs = [vector(f) for f in batch]
    check_a_capsule_replays(engine, obs[:STEPS + 1], obs[STEPS + 1:])
    if device == 'cuda':
        monkeypatch.setattr(model[0].config, 'use_amp', False)
        full = _engine(model, device, tmp_path / 'full')
        assert not torch.equal(torch.stack([full.step(o).cpu() for o in obs]),
                               torch.stack(got))


def _compiled(kind, device, tmp_path, prefix='lerobot', denoise='compiled', dtype='float32'):
    """An engine of a model of its own (the compile replaces the model's denoise_step)."""
    policy, stats = pi0(kind=kind, dtype=dtype)
    return PolicyEngine(CLASSES[kind](policy, stats=stats, seed=SEED,
                                      denoise_kernels=denoise, prefix_kernels=prefix),
                        device=device, capsule_dir=str(tmp_path / 'capsules'))


@pytest.mark.parametrize('prefix', ['lerobot', 'compiled'])
@pytest.mark.parametrize('device', DEVICES)
def test_compiled_denoising_is_lerobots_within_rounding_and_exact_every_time(
        model, tmp_path, device, prefix):
    """denoise_kernels 'compiled' (lerobot_prefix.py), as the H200 benchmark runs it: the
    actions within 1e-4 of LeRobot's kernels (random weights at these sizes, actions O(1)),
    the kept prefix LeRobot's bit for bit (the prefix pass is not compiled; with
    prefix_kernels 'compiled' too, within 1e-4 of its scale and reused exactly), a capsule
    mid-chunk replayed 8 times, and a fresh process that compiles again: the same bits. In a
    process of its own: inductor's graphs of one kind held 9-11 GB on the CPU, and the two
    kinds in one process ran a 24 GB machine out of memory (torch._dynamo.reset() did not
    give it back)."""
    _check_compiled_apart(tmp_path, model[0].config.type, device, prefix)


def _check_compiled_apart(tmp_path, *args):
    """_check_compiled(kind, device, tmp_path, prefix, ...) in a process of its own."""
    import subprocess
    import sys
    kind, device, *rest = args
    script = (f'import sys, pathlib; sys.path[:0] = {sys.path!r}\n'
              'from test_lerobot_pi0 import _check_compiled\n'
              f'_check_compiled({kind!r}, {device!r}, pathlib.Path({str(tmp_path)!r}), '
              f'{", ".join(repr(a) for a in rest)})')
    out = subprocess.run([sys.executable, '-c', script], capture_output=True, text=True,
                         cwd=str(tmp_path), timeout=1200)
    assert out.returncode == 0, out.stderr[-4000:]


def _check_compiled(kind, device, tmp_path, prefix, denoise='compiled', dtype='float32'):
    import gc
    lerobot = _engine(pi0(kind=kind, dtype=dtype), device, tmp_path)
    obs = [vector(f) for f in frames(2 * STEPS + 3, lerobot.policy.vocabulary, seed=2)]
    want = torch.stack([lerobot.step(o) for o in obs]).cpu()
    theirs = {n: lerobot.policy.views[n].clone() for n in ('prefix_k', 'prefix_v', 'prefix_pad')}
    del lerobot     # its model (a 2 GB float32 vocabulary) gone before the compile and the
    gc.collect()    # fresh process: on a 24 GB machine the three together ran out of memory
    compiled = _compiled(kind, device, tmp_path, prefix, denoise, dtype)
    assert compiled.policy.config()['denoise_kernels'] == denoise
    assert compiled.policy.config().get('prefix_kernels', 'lerobot') == prefix
    compiled.snapshot('start')
    got = torch.stack([compiled.step(o) for o in obs]).cpu()
    worst = float((got.double() - want.double()).abs().max())
    # float32: float32's rounding at these sizes; bfloat16: its 8-bit mantissa through the
    # layers, against actions of O(1)
    assert worst <= (1e-4 if dtype == 'float32' else 0.03), worst
    for name in ('prefix_k', 'prefix_v', 'prefix_pad'):
        kept = compiled.policy.views[name]
        if prefix == 'lerobot' or name == 'prefix_pad':
            assert torch.equal(kept, theirs[name]), name
        else:
            off = float((kept.double() - theirs[name].double()).abs().max())
            assert off <= 1e-4 * float(theirs[name].double().abs().max()), (name, off)
    if prefix == 'compiled':    # the kept prefix of its own kernels, reused exactly
        check_restarts_reuse_the_prefix(compiled, obs[0], got[0])
    check_replays_here_and_in_a_fresh_process(
        compiled, obs[:STEPS + 1], obs[STEPS + 1:], 'from test_lerobot_pi0 import _compiled\n'
        f'e = _compiled({kind!r}, {device!r}, pathlib.Path({str(tmp_path)!r}), {prefix!r}, '
        f'{denoise!r}, {dtype!r})', tmp_path)


@pytest.mark.parametrize('dtype', ['float32', 'bfloat16'])
@pytest.mark.parametrize('device', DEVICES)
@pytest.mark.parametrize('kind', sorted(CLASSES))
def test_fused_denoising_is_lerobots_within_rounding_and_exact_every_time(
        tmp_path, device, dtype, kind):
    """denoise_kernels 'fused' (pi05_expert.py: the expert's step of our own, Pi0.5's time
    conditioning and Pi0's norm scales computed once, attention over a static cache): the
    actions within rounding of LeRobot's (float32 1e-4; bfloat16, the dtype Pi0 and Pi0.5 ship
    in, 0.03 on actions of O(1)), with every step's conditioning in play (support/pi0.py), the
    kept prefix LeRobot's bit for bit, a capsule mid-chunk replayed 8 times and a fresh process
    that compiles again: the same bits. In a process of its own, as the compiled test."""
    _check_compiled_apart(tmp_path, kind, device, 'lerobot', 'fused', dtype)


@pytest.mark.parametrize('dtype', ['float32', 'bfloat16'])
@pytest.mark.parametrize('kind', sorted(CLASSES))
def test_the_fused_steps_run_eagerly_are_lerobots_bit_for_bit(tmp_path, monkeypatch, kind,
                                                              dtype):
    """The fused steps are LeRobot's arithmetic rearranged, not another one: run eagerly on
    the CPU (their compile left out), Pi0's and Pi0.5's actions over three chunks are
    LeRobot's bit for bit in either dtype, Pi0's state token and its mask included; so what
    the compiled steps differ by is the compiler's rounding."""
    monkeypatch.setattr(lerobot_pi0, 'compiled', lambda fn: fn)
    policy, stats = model = pi0(kind=kind, dtype=dtype)
    lerobot = _engine(model, 'cpu', tmp_path)
    fused = PolicyEngine(CLASSES[kind](policy, stats=stats, seed=SEED, denoise_kernels='fused'),
                         device='cpu', capsule_dir=str(tmp_path / 'fused'))
    assert fused.policy.config()['denoise_kernels'] == 'fused'
    for f in frames(2 * STEPS + 3, lerobot.policy.vocabulary, seed=3):
        want, got = lerobot.step(vector(f)), fused.step(vector(f))
        assert torch.equal(got, want), float((got - want).abs().max())


def test_weights_that_did_not_load_are_refused_not_left_random(folder, tmp_path):
    """Pi0's and Pi0.5's from_pretrained catch a failed load, or a missing model.safetensors,
    print it and return the model with its random initial weights: refused, by name; the
    folder as written loads, and LeRobot's class is as it was."""
    import shutil

    from lerobot.policies.factory import get_policy_class
    from safetensors.torch import load_file, save_file

    from flashrt_ros.runtime.policies.lerobot_checkpoint import checkpoint_type
    cls = CLASSES[checkpoint_type(folder)]
    short, none = tmp_path / 'short', tmp_path / 'none'
    for copy in (short, none):
        shutil.copytree(folder, copy)
    weights = load_file(short / 'model.safetensors')
    save_file(dict(list(weights.items())[1:]), short / 'model.safetensors')
    (none / 'model.safetensors').unlink()
    with small_sizes():     # (the test checkpoint's sizes: support/pi0.py)
        cls.from_pretrained(str(folder))
        for bad, words in ((short, 'lacks 1 of the weights its config describes'),
                           (none, 'holds no model.safetensors')):
            with pytest.raises(InvalidConfig, match=words):
                cls.from_pretrained(str(bad))
    assert 'load_state_dict' not in get_policy_class(cls.kind).__dict__


def test_a_prompt_cut_to_the_checkpoints_length_is_refused_where_it_holds_the_state(folder):
    """LeRobot's tokenizer step cuts a prompt to tokenizer_max_length. Pi0.5's prompt ends
    with the state and the "Action:" cue, so a long instruction would cut them off: refused,
    naming the counts, while one that fits uses every slot it needs and no more. Pi0's
    prompt is the instruction alone: cut as LeRobot cuts it, its whole length told
    (tokenize.length, for the node's warning)."""
    from flashrt_ros.runtime.policies.lerobot_checkpoint import checkpoint_inputs
    _, tokens, tokenize = checkpoint_inputs(folder)
    state = np.zeros(ACT_DIM, np.float32)
    long = 'pick up the red cube and put it in the blue box ' * 3
    if not tokenize.state_in_prompt:
        ids, mask = tokenize(long)
        assert mask.all() and tokenize.length(long) > tokens
        assert tokenize.length('open the drawer') == int(tokenize('open the drawer')[1].sum())
        return
    fits = tokenize('open the drawer', state)[1]
    assert tokenize.length('open the drawer', state) == int(fits.sum()) < tokens
    with pytest.raises(InvalidObservation, match=rf'is {tokenize.length(long, state)} '
                       rf'tokens, the checkpoint reads {tokens} \(tokenizer_max_length\)'):
        tokenize(long, state)
    assert np.array_equal(tokenize('open the drawer', state)[1], fits)    # settings put back


@pytest.mark.parametrize('device', DEVICES)
def test_the_prefix_is_reused_for_the_same_observation_only(model, tmp_path, device):
    """A chunk whose observation is bit for bit the one its session's prefix came from runs
    the denoising steps alone, with LeRobot's actions all the same: a robot standing still,
    and an episode restarted (its start capsule, then the 'kv' buffers of a capsule taken
    after its first chunk) 8 times. One ulp off and the prefix is computed again."""
    engine = _engine(model, device, tmp_path)
    policy = engine.policy
    frame = frames(1, policy.vocabulary, seed=5)[0]
    still = vector(frame)
    want = _lerobots(model, device, [frame] * (3 * STEPS))
    engine.snapshot('start')
    assert all(torch.equal(engine.step(still).cpu(), w) for w in want)
    assert policy.prefix_reused == 2        # chunks 2 and 3: the prefix of chunk 1
    check_restarts_reuse_the_prefix(engine, still, want[0])
    nudged = still.copy()
    nudged[0] = np.nextafter(still[0], np.float32(np.inf))
    check_changed_bits_recompute(engine, nudged)


@pytest.mark.parametrize('device', DEVICES)
def test_a_bfloat16_vision_tower_is_opt_in_and_lerobots_with_the_same_cast(model, device):
    """vision_dtype bfloat16 (a bfloat16 checkpoint): the actions are those of LeRobot's model
    with its vision tower and projector cast the same way, bit for bit, and not those of
    LeRobot's own (float32 vision), so it is never the default. Refused for a float32 model
    or another dtype, leaving the model as it was."""
    kind = model[0].config.type
    cls = CLASSES[kind]
    policy, stats = pi0(kind=kind, dtype='bfloat16')
    engine = PolicyEngine(cls(policy, stats=stats, seed=SEED, vision_dtype='bfloat16'),
                          device=device)
    assert engine.policy.config()['vision_dtype'] == 'bfloat16'
    batch = frames(2 * STEPS, engine.policy.vocabulary, seed=6)
    got = [engine.step(vector(f)).cpu() for f in batch]
    cast, own = (pi0(kind=kind, dtype='bfloat16') for _ in range(2))
    vision_in_bfloat16(cast[0])
    assert all(torch.equal(g, w) for g, w in zip(got, _lerobots(
        (cast[0].to(device), stats), device, batch)))
    assert not all(torch.equal(g, w) for g, w in zip(got, _lerobots(
        (own[0].to(device), stats), device, batch)))
    tower = model[0].model.paligemma_with_expert.paligemma.model.vision_tower
    for wrong, match in (('bfloat16', 'needs a bfloat16 model'), ('float16', 'float32')):
        with pytest.raises(InvalidConfig, match=match):
            cls(model[0], stats=model[1], vision_dtype=wrong)
        assert next(tower.parameters()).dtype == torch.float32


@pytest.fixture(scope='module', params=sorted(CLASSES))
def folder(request, tmp_path_factory):
    return checkpoint(tmp_path_factory.mktemp(request.param), kind=request.param)


def test_tokens_from_the_checkpoint_give_lerobots_actions_from_raw_inputs(folder):
    """What the node assembles (lerobot_checkpoint.checkpoint_inputs: the raw state, the
    image, the task tokenized by the checkpoint's own pre-processor; for Pi0.5 with each
    observation's state, which its prompt holds) gives, on a policy loaded from the folder,
    LeRobot's pipeline loaded from it (pre-processor, predict_action_chunk with the same
    noise, post-processor) from the raw frames, bit for bit over three chunks."""
    from lerobot.configs.policies import PreTrainedConfig
    from lerobot.policies.factory import get_policy_class, make_pre_post_processors

    from flashrt_ros.runtime.policies.lerobot_checkpoint import checkpoint_inputs
    config = PreTrainedConfig.from_pretrained(folder)
    cameras, tokens, tokenize = checkpoint_inputs(folder)
    assert tokenize.state_in_prompt == (config.type == 'pi05')
    with small_sizes():
        engine = PolicyEngine(CLASSES[config.type].from_pretrained(folder, seed=SEED), 'cpu')
        lerobot = get_policy_class(config.type).from_pretrained(folder).eval()
    pre, post = make_pre_post_processors(config, folder)
    batch = raw_frames(3 * STEPS, seed=3)
    got, want, queue = [], [], []
    for t, frame in enumerate(batch):
        state = frame['observation.state'].numpy()
        got.append(engine.step(np.concatenate(
            [state, frame[CAMERA].numpy().ravel(), *tokenize(frame['task'], state)])))
        if not queue:
            noise = gaussian_noise(torch.tensor([SEED]), torch.tensor([t // STEPS]),
                                   CHUNK * 32).view(1, CHUNK, 32)
            chunk = lerobot.predict_action_chunk(pre(dict(frame)), noise=noise)[:, :STEPS]
            queue = list(post(chunk)[0])
        want.append(queue.pop(0))
    assert all(torch.equal(g, w) for g, w in zip(got, want))


def test_pi05_tokens_belong_to_one_observation(folder):
    """Pi0.5's prompt holds the state: tokens are refused without it, and a state in another
    bin gives other tokens (Pi0's depend on the text alone)."""
    from flashrt_ros.runtime.policies.lerobot_checkpoint import checkpoint_inputs
    _, _, tokenize = checkpoint_inputs(folder)
    state = np.zeros(ACT_DIM, np.float32)
    moved = state.copy()
    moved[2] = 1.5
    if not tokenize.state_in_prompt:
        assert np.array_equal(tokenize('open the drawer')[0],
                              tokenize('open the drawer', moved)[0])
        return
    with pytest.raises(ValueError, match='holds the state'):
        tokenize('open the drawer')
    ids, mask = tokenize('open the drawer', state)
    assert mask.sum() < len(mask)       # the whole prompt fits: the state is in the tokens
    assert not np.array_equal(ids, tokenize('open the drawer', moved)[0])


def test_the_prompt_holds_the_state_where_the_pre_processor_puts_it(tmp_path):
    """Whether the prompt holds the state is the pre-processor's to say (Pi0.5's step), not
    the checkpoint's type: a Pi0 folder whose policy_preprocessor.json writes the state into
    the prompt gets each observation's state in its tokens, as LeRobot's pipeline loaded from
    it gives them. Before, the type decided: the tokens left the state out, with no error.
    (Found by an audit.)"""
    import json

    from lerobot.configs.policies import PreTrainedConfig
    from lerobot.policies.factory import make_pre_post_processors

    from flashrt_ros.runtime.policies.lerobot_checkpoint import checkpoint_inputs
    folder = checkpoint(tmp_path / 'pi0', kind='pi0')
    path = tmp_path / 'pi0' / 'policy_preprocessor.json'
    saved = json.loads(path.read_text())
    names = [step.get('registry_name') for step in saved['steps']]
    normalizer = saved['steps'].pop(names.index('normalizer_processor'))
    at = [step.get('registry_name') for step in saved['steps']].index('tokenizer_processor')
    # the state normalised first, then written into the prompt (Pi0.5's order)
    saved['steps'][at:at] = [normalizer, {
        'registry_name': 'pi05_prepare_state_tokenizer_processor_step',
        'config': {'max_state_dim': 32, 'task_key': 'task'}}]
    path.write_text(json.dumps(saved))
    _, _, tokenize = checkpoint_inputs(folder)
    assert tokenize.state_in_prompt
    pre, _ = make_pre_post_processors(PreTrainedConfig.from_pretrained(folder), folder)
    frame = raw_frames(1, seed=5)[0]
    frame['observation.state'] = torch.linspace(-2, 2, ACT_DIM)
    want = pre(dict(frame))['observation.language.tokens'].reshape(-1).numpy()
    got = tokenize(frame['task'], frame['observation.state'].numpy())[0]
    assert np.array_equal(got, want.astype(np.float32))


@pytest.mark.parametrize('device', DEVICES)
def test_real_time_chunking_equals_lerobots_loop_and_a_capsule_in_flight_replays(
        model, tmp_path, device):
    """Real-time chunking (runtime/policies/lerobot_rtc.py): LeRobot's own RTC loop (its
    guidance through euler_integrate, its ActionQueue) bit for bit over four chunks, delay 1,
    launched with 2 actions left; a capsule taken in flight replays the rest 8 times."""
    from lerobot.processor.factory import make_default_pre_post_processors
    policy, stats = model
    cls = CLASSES[policy.config.type]
    engine = PolicyEngine(cls(policy, stats=stats, seed=SEED, rtc_delay=1,
                              rtc_queue_threshold=2, rtc_execution_horizon=3),
                          device=device, capsule_dir=str(tmp_path / 'capsules'))
    batch = frames(20, engine.policy.vocabulary, seed=5)
    got = []
    for t, f in enumerate(batch):
        got.append(engine.step(vector(f)).cpu())
        if t == CHUNK - 2:      # launched at CHUNK - 2, landing at CHUNK - 1
            assert engine.policy.views['left'].tolist()[1] == 0
            engine.snapshot('flight')
    policy.config.device = device
    pre, post = make_default_pre_post_processors(policy.config, stats)
    want = lerobots_rtc_actions(policy, pre, post, batch, rtc_config(3, 'linear'), 1, 2, SEED,
                                (1, CHUNK, 32), device)
    assert all(torch.equal(g, w) for g, w in zip(got, want)), \
        [t for t, (g, w) in enumerate(zip(got, want)) if not torch.equal(g, w)]
    later = [vector(f) for f in batch[CHUNK - 1:]]
    for _ in range(8):
        engine.restore('flight')
        assert all(torch.equal(engine.step(o).cpu(), w) for o, w in zip(later,
                                                                        want[CHUNK - 1:]))


def test_what_the_engine_cannot_honour_is_refused(model, tmp_path):
    """Relative actions change the actions outside the model: refused at construction, as
    are the fused denoising kernels with real-time chunking (its guidance differentiates
    through the step: not measured yet). A token id outside the vocabulary is refused before
    the state moves."""
    policy, stats = model
    cls = CLASSES[policy.config.type]
    with pytest.raises(InvalidConfig, match='fused with real-time chunking'):
        cls(policy, stats=stats, denoise_kernels='fused', rtc_delay=1, rtc_queue_threshold=3)
    policy.config.use_relative_actions = True
    try:
        with pytest.raises(InvalidConfig, match='relative actions'):
            CLASSES[policy.config.type](policy, stats=stats)
    finally:
        policy.config.use_relative_actions = False
    engine = _engine(model, 'cpu', tmp_path)
    good = [vector(f) for f in frames(2, engine.policy.vocabulary, seed=2)]
    engine.step(good[0])
    engine.snapshot('before')
    bad = good[1].copy()
    bad[-2 * engine.policy.tokens] = engine.policy.vocabulary      # one past the last id
    with pytest.raises(InvalidObservation, match='token ids'):
        engine.step(bad)
    twin = _engine(model, 'cpu', tmp_path / 'twin')
    twin.step(good[0])
    assert torch.equal(engine.step(good[1]), twin.step(good[1]))


def test_the_benchmark_runs_with_our_kernels_and_its_checks_hold(tmp_path):
    """benchmarks/vla_pi0.py --smoke on the CPU, at this file's reduced sizes (its own are the
    published ones, 4 B parameters), with both passes' kernels ours (prefix compiled, the
    fused steps): it runs, writes its report, and its checks hold (within 1 % of LeRobot's
    actions, a restore replays, a kept prefix gives the same first action). A run with other
    kernels once failed at its float bound, after the chunk, on the GPU."""
    import json
    import os
    import pathlib
    import subprocess
    import sys
    out = tmp_path / 'pi0'
    root = pathlib.Path(__file__).resolve().parents[2]
    driver = ('import sys\n'
              'from benchmarks import vla_pi0\n'
              'from support.pi0 import small_sizes\n'
              'with small_sizes():\n'
              '    sys.exit(vla_pi0.main(sys.argv[1:]))\n')
    result = subprocess.run(
        [sys.executable, '-c', driver, '--smoke', '--device', 'cpu', '--kinds', 'pi0',
         '--dtype', 'float32', '--denoise-kernels', 'fused+prefix', '--out', str(out),
         '--commit', 'cafe123'], cwd=root, capture_output=True, text=True, timeout=900,
        env={**os.environ, 'PYTHONPATH': os.pathsep.join(
            [str(root), str(root / 'test'), os.environ.get('PYTHONPATH', '')])})
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    data = json.loads(out.with_suffix('.json').read_text())
    assert data['environment']['lerobot'] == version('lerobot')
    (row,) = data['sections']['rows']
    checks = [c['name'] for c in data['checks'] if c['passed']]
    assert len(checks) == len(data['checks']) == 3, data['checks']
    assert 'but the prefix pass and the denoising steps' in checks[0], checks[0]
    assert f'LeRobot {version("lerobot")}' in out.with_suffix('.md').read_text()
