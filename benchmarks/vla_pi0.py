"""LeRobot's Pi0 and Pi0.5 (LeRobot >= 0.6) on the engine against LeRobot's own
predict_action_chunk, at their published sizes (PaliGemma 2B + the 300M Gemma action expert,
random weights; their default instruction lengths, 48 and 200 tokens).

    python -m benchmarks.vla_pi0 --device cuda --kinds pi0,pi05 --dtype bfloat16 --commit <sha>

In one interleaved loop, every figure the whole call's host wall time (device synchronised):
  chunk     a step that computes a chunk, engine (restore the episode start, then the step: one
            captured graph) vs LeRobot (its normaliser, predict_action_chunk eager with the same
            noise, its unnormaliser);
  restore   a mid-chunk capsule restored, then the next action;
  snapshot  taking that capsule (its bytes: the chunk, the last prefix's KV cache, the rng);
  kept      an episode restarted (its start capsule) with the 'kv' buffers of a capsule taken
            after its first chunk, then that first step again on the same observation: the
            denoising steps alone (lerobot_prefix.py), against `chunk`.
Identity checks (exit 1 on failure): the engine's first chunk equals LeRobot's bit for bit;
after the restore, the same actions, 8 times; with the prefix kept, the same first action
without the prefix pass, 8 times. --vision bfloat16 (vision_dtype, lerobot_pi0.py): LeRobot's
model then runs the same cast, and the engine equals that bit for bit; the distance of its
first chunk to LeRobot's own (float32 vision, the same inputs and noise) is measured and
reported (max |diff|, and over each action dimension's std across the chunk).
"""
import argparse
import datetime
import itertools
import sys
import tempfile

import torch

from .environment import device_slug, environment, resolve_device, results_stem
from .report import checks_and_command, environment_line, log, Report
from .sections import check, ratio
from .timing import interleaved
from .vla import KERNELS

CONFIGS = {'smoke': {'iters': 2, 'warmup': 1}, 'gpu': {'iters': 10, 'warmup': 2}}
DIM, CAMERAS, SIDE = 14, 3, 224


def build(device, kind, dtype):
    """(LeRobot's config, its policy with random weights made on device, the statistics, the
    generator they came from: the frames' next) at the published sizes, this benchmark's
    inputs."""
    from lerobot.configs.types import FeatureType, PolicyFeature
    from lerobot.policies.factory import get_policy_class, make_policy_config
    cams = [f'observation.images.cam{i}' for i in range(CAMERAS)]
    config = make_policy_config(
        kind,
        input_features={'observation.state': PolicyFeature(FeatureType.STATE, (DIM,)),
                        **{k: PolicyFeature(FeatureType.VISUAL, (3, SIDE, SIDE)) for k in cams}},
        output_features={'action': PolicyFeature(FeatureType.ACTION, (DIM,))},
        dtype=dtype, device=str(device))
    torch.manual_seed(0)
    with torch.device(device):      # random weights made where they run
        policy = get_policy_class(kind)(config).eval()
    # LeRobot zeroes Pi0.5's AdaRMS condition weights (the time step changes nothing until
    # trained): drawn here as a transformer's weights are (N(0, 0.02)), so that each step's
    # conditioning counts in the distance measured to LeRobot's own actions
    for name, weight in policy.named_parameters():
        if name.endswith('norm.dense.weight'):
            torch.nn.init.normal_(weight, std=0.02)
    gen = torch.Generator().manual_seed(1)
    stats = {}
    for key in ('observation.state', 'action'):
        low, span = torch.randn(DIM, generator=gen), torch.rand(DIM, generator=gen) + 0.5
        stats[key] = {'mean': low, 'std': span, 'q01': low, 'q99': low + span}
    return config, policy, stats, gen


def run(device, kind, dtype, cfg, tmp, checks, vision='float32', kernels='lerobot'):
    from lerobot.processor.factory import make_default_pre_post_processors

    from flashrt_ros.runtime.engine import PolicyEngine
    from flashrt_ros.runtime.policies import gaussian_noise, Pi05ChunkPolicy, Pi0ChunkPolicy
    cams = [f'observation.images.cam{i}' for i in range(CAMERAS)]
    config, policy, stats, gen = build(device, kind, dtype)
    pre, post = make_default_pre_post_processors(config, stats)
    steps, tokens = config.n_action_steps, config.tokenizer_max_length
    vocabulary = policy.model.paligemma_with_expert.paligemma.get_input_embeddings() \
        .num_embeddings
    frames = []
    for _ in range(2):
        ids = torch.randint(0, vocabulary, (1, tokens), generator=gen)
        mask = torch.arange(tokens).view(1, -1) < 20          # a 20-token instruction
        frames.append({'observation.state': torch.randn(DIM, generator=gen),
                       **{k: torch.rand(3, SIDE, SIDE, generator=gen) for k in cams},
                       'observation.language.tokens': ids,
                       'observation.language.attention_mask': mask})
    obs = [torch.cat([f['observation.state'], *[f[k].reshape(-1) for k in cams],
                      f['observation.language.tokens'].reshape(-1).float(),
                      f['observation.language.attention_mask'].reshape(-1).float()]).numpy()
           for f in frames]
    noise = gaussian_noise(torch.tensor([5], device=device), torch.tensor([0], device=device),
                           config.chunk_size * config.max_action_dim).view(
        1, config.chunk_size, config.max_action_dim)

    def sync():
        if device.type == 'cuda':
            torch.cuda.synchronize(device)

    def lerobot_chunk():
        out = post(policy.predict_action_chunk(pre(dict(frames[0])), noise=noise)[:, :steps])
        sync()
        return out

    own = lerobot_chunk()[0]        # LeRobot's model as it builds it (float32 vision)
    ours = Pi05ChunkPolicy if kind == 'pi05' else Pi0ChunkPolicy
    # with vision bfloat16 the engine casts LeRobot's vision tower, with kernels compiled it
    # compiles its denoise_step: LeRobot's own from here on runs the same (the baseline as fast
    # as it can be, and the bit-for-bit reference)
    denoise, prefix = KERNELS[kernels]
    engine = PolicyEngine(ours(policy, stats=stats, seed=5, vision_dtype=vision,
                               denoise_kernels=denoise, prefix_kernels=prefix),
                          device=device, capsule_dir=f'{tmp}/capsules')
    mine = engine.policy
    engine.snapshot('start')
    want = lerobot_chunk()[0]
    got = torch.stack([engine.step(obs[0]).cpu() for _ in range(steps)])
    name = f'{kind} {dtype} ({tokens} tokens)' + (f', vision {vision}' if vision != 'float32'
                                                  else '') + \
        (f', {kernels} denoise kernels' if kernels != 'lerobot' else '')
    changed = vision != 'float32' or kernels != 'lerobot'
    same_cast = ' with the same cast and kernels' if changed else ''
    worst = float((got - want).abs().max())
    if prefix == 'lerobot' and denoise != 'fused':
        check(checks, f'{name}: the engine\'s first chunk equals LeRobot\'s{same_cast} bit for '
              f'bit ({steps} actions; max |diff| {worst:.3g})', torch.equal(got, want))
    else:   # the prefix pass compiled at the engine's call site, or the expert's step our
        # own (fused): LeRobot's runs its own
        scale = float(want.abs().max())
        parts = (('the prefix pass', prefix == 'compiled'),
                 ('the denoising steps', denoise == 'fused'))
        not_theirs = ' and '.join(part for part, differs in parts if differs)
        check(checks, f'{name}: the engine\'s first chunk is within 1 % of the actions\' scale '
              f'of LeRobot\'s{same_cast} but {not_theirs} ({steps} actions; max |diff| '
              f'{worst:.3g}, actions up to {scale:.3g})', worst <= 0.01 * scale)
    bound = None
    if changed:     # the distance to LeRobot's own actions, measured
        bound = {'max_abs': float((got - own).abs().max()),
                 'max_abs_over_action_std': float(((got - own).abs() / own.std(0)).max())}
        log(f'  {name}: vs LeRobot\'s own (float32 vision) max |diff| {bound["max_abs"]:.3g}, '
            f'{bound["max_abs_over_action_std"]:.3g} of the actions\' std')
    engine.restore('start')
    engine.step(obs[0])
    engine.snapshot('mid')
    after = [engine.step(obs[1]).clone() for _ in range(3)]
    same = True
    for _ in range(8):
        engine.restore('mid')
        same &= all(torch.equal(engine.step(obs[1]), a) for a in after)
    check(checks, f'{name}: after a restore, the same actions (8 times)', same)

    engine.restore('start')
    first = engine.step(obs[0]).clone()
    engine.snapshot('first')

    def engine_kept_prefix():
        engine.restore('start')
        engine.restore('first', kinds=['kv'])
        return engine.step(obs[0])
    reused = mine.prefix_reused
    same = all(torch.equal(engine_kept_prefix(), first) for _ in range(8))
    check(checks, f'{name}: restarted with the first chunk\'s prefix kept, the same first '
          'action without the prefix pass (8 times)', same and mine.prefix_reused == reused + 8)

    def engine_chunk():
        engine.restore('start')
        engine.step(obs[0])

    def engine_graph():
        mine._chunk_graph.replay()
        sync()

    def engine_pop():
        engine.restore('mid')
        engine.step(obs[1])

    walls, _ = interleaved(None, {}, {}, cfg['iters'], cfg['warmup'], walled={
        'lerobot_chunk': lerobot_chunk, 'engine_chunk': engine_chunk,
        'engine_chunk_graph': engine_graph, 'engine_restore_and_pop': engine_pop,
        'engine_snapshot': lambda: engine.snapshot('timed', overwrite=True),
        'engine_chunk_kept_prefix': engine_kept_prefix})
    return {'policy': name, **walls, 'capsule_bytes': int(engine.arena.live_nbytes(0)),
            'vision_bound': bound,
            'params': sum(p.numel() for p in policy.parameters()),
            'ratios': {'engine_chunk_vs_lerobot': ratio(walls['engine_chunk']['p50'],
                                                        walls['lerobot_chunk']['p50']),
                       'chunk_vs_kept_prefix': ratio(walls['engine_chunk']['p50'],
                                                     walls['engine_chunk_kept_prefix']['p50'])}}


def render(results):
    env, out = results['environment'], []
    out += [f'# LeRobot Pi0 / Pi0.5 on the engine vs LeRobot: {env["device_name"]} '
            f'({env["mode"]})\n', environment_line(env),
            f'- PaliGemma 2B + Gemma 300M expert, random weights, {CAMERAS} cameras {SIDE} x '
            f'{SIDE}, {DIM}-dim state and action, chunk 50, 10 flow-matching steps, batch 1; '
            'whole call, host wall p50 / p99 in ms (device synchronised); LeRobot eager\n',
            '| policy | params | LeRobot chunk | engine chunk (ratio) | its graph alone | '
            'restore + next action | snapshot | capsule bytes | first chunk, prefix kept '
            '(chunk / kept) | vs LeRobot\'s own: max abs diff (of the std) |',
            '|' + ' --- |' * 10]
    for r in results['sections'].get('rows', []):
        def ms(key):
            return f'{r[key]["p50"] / 1e3:.1f} / {r[key]["p99"] / 1e3:.1f}'
        out.append(f'| {r["policy"]} | {r["params"] / 1e9:.2f} B | {ms("lerobot_chunk")} | '
                   f'{ms("engine_chunk")} ({r["ratios"]["engine_chunk_vs_lerobot"]:.2f}x) | '
                   f'{ms("engine_chunk_graph")} | {ms("engine_restore_and_pop")} | '
                   f'{ms("engine_snapshot")} | {r["capsule_bytes"]:,} | '
                   f'{ms("engine_chunk_kept_prefix")} '
                   f'({r["ratios"]["chunk_vs_kept_prefix"]:.2f}x) | ' + (
                       f'{b["max_abs"]:.3g} ({b["max_abs_over_action_std"]:.3g}) |'
                       if (b := r.get('vision_bound')) else '0 (bit for bit) |'))
    return '\n'.join(out + checks_and_command(results)) + '\n'


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    ap.add_argument('--smoke', action='store_true')
    ap.add_argument('--device', default='cuda')
    ap.add_argument('--kinds', default='pi0', help="comma list of 'pi0', 'pi05'")
    ap.add_argument('--dtype', default='bfloat16', help="comma list of 'bfloat16', 'float32'")
    ap.add_argument('--vision', default='float32',
                    help="comma list of vision_dtype values: 'float32' (LeRobot's), 'bfloat16'")
    ap.add_argument('--denoise-kernels', default='lerobot',
                    help="comma list of 'lerobot', 'compiled', 'fused' (denoise_kernels), "
                    "'compiled+prefix', 'fused+prefix' (and prefix_kernels)")
    ap.add_argument('--out', default='')
    ap.add_argument('--commit', default='')
    args = ap.parse_args(argv)
    device = resolve_device(args.device)
    mode = 'smoke' if args.smoke else 'gpu'
    env = environment(device, f'vla-pi0-{mode}', args.commit)
    stem = f'{datetime.date.today().isoformat()}-{device_slug(env)}-vla-pi0'
    report = Report(results_stem(args.out, stem), env, CONFIGS[mode], render_md=render)
    report.results['command'] = 'python -m benchmarks.vla_pi0 ' + ' '.join(
        sys.argv[1:] if argv is None else argv)
    report.results['sections'] = {'rows': []}
    for kind in args.kinds.split(','):
        for dtype in args.dtype.split(','):
            for vision, kernels in itertools.product(args.vision.split(','),
                                                     args.denoise_kernels.split(',')):
                if vision == 'bfloat16' and dtype != 'bfloat16':
                    continue        # refused: the vision tower in bfloat16 needs such a model
                with tempfile.TemporaryDirectory(prefix='frt-pi0-') as tmp:
                    report.results['sections']['rows'].append(
                        run(device, kind, dtype, CONFIGS[mode], tmp, report.results['checks'],
                            vision, kernels))
                report.write()
                if device.type == 'cuda':
                    torch.cuda.empty_cache()
                log(f'  {kind} {dtype} vision {vision} kernels {kernels} done')
    log(render(report.results))
    return 1 if any(not c['passed'] for c in report.results['checks']) else 0


if __name__ == '__main__':
    sys.exit(main())
