"""denoise_kernels and prefix_kernels 'compiled' (runtime/policies/lerobot_prefix.py):
SmolVLA's denoising steps, and its prefix pass, compiled by torch.compile; denoise_kernels
'fused' (smolvla_expert.py): the expert's steps of our own, compiled alike. The actions are
LeRobot's within float rounding (not bit for bit: other kernels); with the denoising steps
alone compiled the kept prefix is LeRobot's bit for bit; either is exact every time: a capsule
mid-chunk replays the same actions 8 times, and a fresh process that compiles again gives the
same bits. The tiny SmolVLA of support/smolvla.py."""
import pytest
import torch

pytest.importorskip('lerobot.policies.smolvla.modeling_smolvla',
                    reason='needs lerobot 0.4.4 and transformers (requirements/vla.txt)')

from flashrt_ros.runtime.engine import PolicyEngine  # noqa: E402
from flashrt_ros.runtime.errors import IncompatibleCapsule, InvalidConfig  # noqa: E402
from flashrt_ros.runtime.policies import lerobot_smolvla  # noqa: E402
from flashrt_ros.runtime.policies.lerobot_smolvla import SmolVLAChunkPolicy  # noqa: E402
from support.prefix import (check_replays_here_and_in_a_fresh_process,  # noqa: E402
                            check_restarts_reuse_the_prefix)
from support.smolvla import checkpoint, frames, vectors, vlm_folder  # noqa: E402

STEPS, SEED = 5, 7      # the demo checkpoint's n_action_steps; the engine's noise seed
DEVICES = ['cpu', pytest.param('cuda', marks=pytest.mark.cuda)]
# LeRobot's actions are O(1) here; on the H200 the published sizes were 4.8e-7 off
# (README). The bound is for these random weights, not a trained checkpoint.
BOUND = 1e-4


@pytest.fixture(scope='module')
def folder(tmp_path_factory):
    return checkpoint(vlm_folder(tmp_path_factory.mktemp('smolvlm')),
                      tmp_path_factory.mktemp('checkpoint'))


def _engine(folder, tmp_path, device, kernels, prefix='lerobot', expert='float32'):
    policy = SmolVLAChunkPolicy.from_pretrained(folder, seed=SEED, denoise_kernels=kernels,
                                                prefix_kernels=prefix, expert_dtype=expert)
    return PolicyEngine(policy, device=device, capsule_dir=str(tmp_path / 'capsules'))


@pytest.mark.parametrize('kernels', ['compiled', 'fused'])
@pytest.mark.parametrize('device', DEVICES)
def test_compiled_denoising_is_lerobots_within_rounding_and_exact_every_time(
        folder, tmp_path, device, kernels):
    observations = vectors(folder, frames(2 * STEPS + 3, seed=4))
    lerobot = _engine(folder, tmp_path, device, 'lerobot')
    compiled = _engine(folder, tmp_path, device, kernels)
    assert compiled.policy.config()['denoise_kernels'] == kernels
    want = torch.stack([lerobot.step(o) for o in observations]).cpu()
    got = torch.stack([compiled.step(o) for o in observations]).cpu()
    worst = float((got.double() - want.double()).abs().max())
    assert worst <= BOUND, worst
    assert not torch.equal(got, want) or device == 'cpu', 'no other kernels ran'
    for name in ('prefix_k', 'prefix_v', 'prefix_pad'):     # the prefix pass: LeRobot's
        assert torch.equal(compiled.policy.views[name], lerobot.policy.views[name]), name
    # a capsule mid-chunk: the same actions across the next chunk, 8 times, and in a fresh
    # process that compiles again
    check_replays_here_and_in_a_fresh_process(
        compiled, observations[:STEPS + 2], observations[STEPS + 2:],
        'from test_lerobot_compiled import _engine\n'
        f'e = _engine({folder!r}, pathlib.Path({str(tmp_path)!r}), {device!r}, {kernels!r})',
        tmp_path)


@pytest.mark.parametrize('expert', ['float32', 'bfloat16'])
def test_the_fused_steps_run_eagerly_are_lerobots_bit_for_bit(folder, tmp_path, monkeypatch,
                                                              expert):
    """The fused steps (smolvla_expert.py) are LeRobot's arithmetic rearranged, not another
    one: run eagerly on the CPU (their compile left out), the actions over three chunks are
    LeRobot's bit for bit, with the expert in either dtype; so what the compiled ones differ
    by is the compiler's rounding."""
    monkeypatch.setattr(lerobot_smolvla, 'compiled', lambda fn: fn)
    observations = vectors(folder, frames(2 * STEPS + 3, seed=8))
    lerobot = _engine(folder, tmp_path, 'cpu', 'lerobot', expert=expert)
    fused = _engine(folder, tmp_path, 'cpu', 'fused', expert=expert)
    assert fused.policy.config()['expert_dtype'] == expert
    for o in observations:
        want, got = lerobot.step(o), fused.step(o)
        assert torch.equal(got, want), float((got - want).abs().max())


@pytest.mark.parametrize('device', DEVICES)
def test_a_compiled_prefix_pass_is_lerobots_within_rounding_and_exact_every_time(
        folder, tmp_path, device):
    observations = vectors(folder, frames(2 * STEPS + 3, seed=5))
    lerobot = _engine(folder, tmp_path, device, 'lerobot')
    policy = SmolVLAChunkPolicy.from_pretrained(folder, seed=SEED, denoise_kernels='compiled',
                                                prefix_kernels='compiled')
    batches, vision = [], policy._compiled_images   # the demo's two cameras: in one call (at
    policy._compiled_images = lambda images: batches.append(len(images)) or vision(images)
    compiled = PolicyEngine(policy, device=device,  # the capture on CUDA, every chunk on the CPU)
                            capsule_dir=str(tmp_path / 'capsules'))
    assert compiled.policy.config()['prefix_kernels'] == 'compiled'
    assert 'prefix_kernels' not in lerobot.policy.config()  # the default's digest: as before
    compiled.snapshot('start')
    want = torch.stack([lerobot.step(o) for o in observations]).cpu()
    got = torch.stack([compiled.step(o) for o in observations]).cpu()
    worst = float((got.double() - want.double()).abs().max())
    assert worst <= BOUND, worst
    assert batches and set(batches) == {2}, batches
    # the prefix pass's own kernels, within rounding: on CUDA the vision tower's float32
    # patch convolution runs in TF32 (cuDNN's default, torch.backends.cudnn.allow_tf32, for
    # LeRobot's pass too), 10-bit mantissa, unit roundoff 4.9e-4, and the two passes run it
    # differently (here compiled, the cameras in one batch). On the H100 the keys were 2.3e-4
    # of their scale apart, and within 1e-4 with cuDNN's TF32 off.
    relative = BOUND if device == 'cpu' else 1e-3
    for name in ('prefix_k', 'prefix_v'):
        kept, theirs = (e.policy.views[name].double() for e in (compiled, lerobot))
        assert float((kept - theirs).abs().max()) <= relative * float(theirs.abs().max()), name
    assert not torch.equal(compiled.policy.views['prefix_k'], lerobot.policy.views[
        'prefix_k']) or device == 'cpu', 'no other kernels ran in the prefix pass'
    # the kept prefix is reused exactly: a restart skips the prefix pass, same first action
    check_restarts_reuse_the_prefix(compiled, observations[0], got[0])
    check_replays_here_and_in_a_fresh_process(
        compiled, observations[:STEPS + 2], observations[STEPS + 2:],
        'from test_lerobot_compiled import _engine\n'
        f'e = _engine({folder!r}, pathlib.Path({str(tmp_path)!r}), {device!r}, "compiled", '
        '"compiled")', tmp_path)


def test_a_recompile_on_the_cpu_is_an_error_not_other_kernels(folder, tmp_path):
    """On the CPU the compiled chunk runs eagerly at every chunk: after its first run, what
    would make dynamo compile again (here the VLM cast to bfloat16 behind the engine's back:
    its guards check the weights' dtype) raises instead of running other kernels (or, past
    dynamo's limit, LeRobot's), and the state has not moved."""
    import torch._dynamo
    engine = _engine(folder, tmp_path, 'cpu', 'compiled', prefix='compiled')
    observations = vectors(folder, frames(STEPS + 1, seed=6))
    for obs in observations[:STEPS]:
        engine.step(obs)                    # one chunk, popped to the end
    before = {n: v.clone() for n, v in engine.policy.views.items()}
    engine.policy.lerobot.model.vlm_with_expert.vlm.to(torch.bfloat16)
    with pytest.raises(torch._dynamo.exc.RecompileError):
        engine.step(observations[STEPS])    # the next chunk
    assert all(torch.equal(v, before[n]) for n, v in engine.policy.views.items())


@pytest.mark.parametrize('prefix', ['lerobot', 'compiled'])
def test_a_capsule_of_other_kernels_is_refused(folder, tmp_path, prefix):
    """The actions of a capsule's queue (and its kept prefix) came from one set of kernels: a
    node on another refuses the file rather than mix them."""
    compiled = _engine(folder, tmp_path, 'cpu', 'compiled', prefix)
    lerobot = _engine(folder, tmp_path, 'cpu', 'compiled' if prefix == 'compiled' else 'lerobot')
    lerobot.step(vectors(folder, frames(1))[0])
    lerobot.snapshot('one')
    path = str(tmp_path / 'capsules' / 'one.capsule')
    lerobot.save('one', path)
    with pytest.raises(IncompatibleCapsule):
        compiled.load(path, 'one')
    assert 'one' not in compiled.store


def test_unknown_kernels_and_real_time_chunking_are_refused_before_anything_changes(folder):
    from lerobot.policies.smolvla.modeling_smolvla import SmolVLAPolicy
    model = SmolVLAPolicy.from_pretrained(folder)
    step = model.model.denoise_step
    with pytest.raises(InvalidConfig, match="denoise_kernels 'triton'"):
        SmolVLAChunkPolicy(model, stats={}, denoise_kernels='triton')
    with pytest.raises(InvalidConfig, match="prefix_kernels 'fast'"):
        SmolVLAChunkPolicy(model, stats={}, prefix_kernels='fast')
    for option, kernels in (('denoise_kernels', 'compiled'), ('denoise_kernels', 'fused'),
                            ('prefix_kernels', 'compiled')):
        with pytest.raises(InvalidConfig, match=f'{option} {kernels} with real-time chunking'):
            SmolVLAChunkPolicy(model, stats={}, rtc_delay=2, rtc_queue_threshold=3,
                               **{option: kernels})
    assert model.model.denoise_step == step     # not compiled
    assert 'embed_image' not in vars(model.model.vlm_with_expert)     # nor its prefix pass


def test_a_prefix_pass_that_skips_a_camera_is_an_error(folder):
    """The cameras embedded in one batch are handed to LeRobot's embed_prefix in its order: an
    embed_prefix that embeds another image, or fewer of them, raises instead of running on
    features of the wrong camera, and leaves no features behind for the next pass."""
    policy = SmolVLAChunkPolicy.from_pretrained(folder, seed=SEED, prefix_kernels='compiled')
    vlm = policy._vlm()
    images = [torch.rand(1, 3, 64, 64), torch.rand(1, 3, 64, 64)]
    model = policy.lerobot.model
    for embedded in (images[:1], images[::-1]):
        model.embed_prefix = lambda images, embedded=embedded: [
            vlm.embed_image(image) for image in embedded]
        with pytest.raises(RuntimeError, match='embed_prefix embedded'):
            with policy._fixed_positions():
                policy._embed_prefix(images)
        assert policy._camera_features == ()
    del model.embed_prefix
