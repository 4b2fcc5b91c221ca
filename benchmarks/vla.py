"""LeRobot chunk policies (SmolVLA, ACT, Diffusion Policy) on the engine against LeRobot's own
select_action, and what a capsule saves.

    python -m benchmarks.vla --device cpu --out benchmarks/results/<date>-<device>-vla
    python -m benchmarks.vla --smoke --out /tmp/vla_smoke          # the test

On the demo checkpoint LeRobot writes offline (flashrt_ros/runtime/policies/lerobot_demo.py;
random weights, its small sizes, or --size published: SmolVLM2-500M's text and vision sizes
with SmolVLA's 16 VLM layers), in one interleaved loop, every figure the whole call's host
wall time (the device synchronised):
  chunk      a step that computes a chunk (prefix pass + num_steps denoising steps), engine
             vs LeRobot's select_action with an empty queue (same weights, inputs and noise);
  pop        a step that takes the next action of the chunk, engine vs LeRobot;
  restore    a mid-chunk capsule restored, then the step after it: the next action without
             recomputing anything, against `chunk` (what a reset or a what-if costs without
             the capsule: the chunk computed again);
  snapshot   taking that capsule (its bytes: the chunk, the prefix KV cache, the rng);
  kept       SmolVLA: an episode restarted (its start capsule) with the 'kv' buffers of a
             capsule taken after its first chunk, then that first step again on the same
             observation: the prefix pass skipped (lerobot_smolvla.py), against `chunk`.
Identity checks (exit 1 on failure): the engine's actions equal LeRobot's pipeline bit for
bit; after the restore, the same actions as the first time.
"""
import argparse
import datetime
import sys
import tempfile

import torch

from .environment import device_slug, environment, resolve_device, results_stem
from .report import checks_and_command, environment_line, log, Report
from .sections import check, ratio
from .timing import interleaved, stats, wall

# --denoise-kernels values: (denoise_kernels, prefix_kernels)
KERNELS = {'lerobot': ('lerobot', 'lerobot'), 'compiled': ('compiled', 'lerobot'),
           'compiled+prefix': ('compiled', 'compiled'), 'fused': ('fused', 'lerobot'),
           'fused+prefix': ('fused', 'compiled')}     # fused: the expert's step of our own
CONFIGS = {'smoke': {'iters': 3, 'warmup': 1}, 'cpu': {'iters': 30, 'warmup': 3},
           'gpu': {'iters': 50, 'warmup': 5}}


def _frames(count, state_dim, cameras, task):
    gen = torch.Generator().manual_seed(0)
    return [{'observation.state': torch.randn(state_dim, generator=gen),
             **{k: torch.rand(s, generator=gen) for k, s in cameras.items()},
             **({'task': task} if task else {})} for _ in range(count)]


def _models(kind, size, device, tmp, vlm_dtype, kernels='lerobot', expert='float32'):
    """LeRobot's policy, its pre- and post-processor (the device LeRobot runs on), the
    engine's policy, from one demo checkpoint folder, and LeRobot's own policy where the
    first is cast (else None). vlm_dtype: SmolVLA's VLM cast to it in all (what LeRobot's
    load_vlm_weights=True does with a published checkpoint: bfloat16); kernels, expert: the
    engine's SmolVLA denoise_kernels and expert_dtype (LeRobot's cast the same way)."""
    from lerobot.policies.factory import make_pre_post_processors
    from lerobot.processor import NormalizerProcessorStep

    from flashrt_ros.runtime.policies import (ACTChunkPolicy, DiffusionChunkPolicy,
                                              SmolVLAChunkPolicy)
    from flashrt_ros.runtime.policies import lerobot_demo as demo
    if kind == 'diffusion':
        from lerobot.policies.diffusion.modeling_diffusion import DiffusionPolicy as LeRobot
        folder = demo.diffusion_checkpoint(f'{tmp}/checkpoint', size=size)
        ours = DiffusionChunkPolicy
    elif kind == 'smolvla':
        from lerobot.policies.smolvla.modeling_smolvla import SmolVLAPolicy as LeRobot
        folder = demo.checkpoint(demo.vlm_folder(f'{tmp}/vlm', size), f'{tmp}/checkpoint',
                                 size=size)
        ours = SmolVLAChunkPolicy
    else:
        from lerobot.policies.act.modeling_act import ACTPolicy as LeRobot
        folder = demo.act_checkpoint(f'{tmp}/checkpoint', size=size)
        ours = ACTChunkPolicy
    reference, mine, own = (LeRobot.from_pretrained(folder).to(device).eval()
                            if i < 2 or expert != 'float32' else None for i in range(3))
    for model in (m for m in (reference, mine, own) if m) if kind == 'smolvla' else ():
        model.model.vlm_with_expert.vlm.to(vlm_dtype)
    if expert != 'float32':
        from flashrt_ros.runtime.policies.lerobot_smolvla import expert_in_bfloat16
        expert_in_bfloat16(reference)
    pre, post = make_pre_post_processors(reference.config, folder,
                                         preprocessor_overrides={'device_processor': {
                                             'device': str(device)}})
    stats = [s.stats for s in pre.steps if isinstance(s, NormalizerProcessorStep)][0]
    denoise, prefix = KERNELS[kernels]
    options = {'denoise_kernels': denoise, 'prefix_kernels': prefix,
               'expert_dtype': expert} if kind == 'smolvla' else {}
    return reference, pre, post, ours(mine, stats=stats, seed=5, **options).to(device), own


def run(device, kind, size, cfg, tmp, checks, vlm_dtype, kernels='lerobot', expert='float32'):
    from flashrt_ros.runtime.engine import PolicyEngine
    from flashrt_ros.runtime.policies import gaussian_noise
    reference, pre, post, policy, own = _models(kind, size, device, tmp, vlm_dtype, kernels,
                                                expert)
    engine = PolicyEngine(policy, device=device, capsule_dir=f'{tmp}/capsules')
    steps, cfgl, name = policy.steps, reference.config, f'{kind} {size}'
    if kind == 'smolvla':
        name += f', {kernels} kernels, {expert} expert'
    frames = _frames(steps, policy.state_dim, policy.cameras,
                     'pick up the red cube' if policy.tokens else None)
    batches = [pre(dict(f)) for f in frames]
    language = ('observation.language.tokens', 'observation.language.attention_mask')
    obs = [torch.cat([f['observation.state'], *[f[k].reshape(-1) for k in policy.cameras],
                      *[b[k].reshape(-1).cpu().float() for k in language if policy.tokens]])
           for f, b in zip(frames, batches)]
    # the noise the engine draws for its first chunk (seed 5, counter 0), on its device
    noise = {} if kind != 'smolvla' else {'noise': gaussian_noise(
        torch.tensor([5], device=device), torch.tensor([0], device=device),
        cfgl.chunk_size * cfgl.max_action_dim).view(1, cfgl.chunk_size, cfgl.max_action_dim)}

    def seeded():       # Diffusion Policy: LeRobot draws from the seed the engine's chunk takes
        if kind == 'diffusion':
            from flashrt_ros.runtime.policies.lerobot_diffusion import chunk_seed
            policy.device_generator()[0].manual_seed(chunk_seed(5, 0))
    # identity: a whole chunk, engine against LeRobot's pipeline
    seeded()
    want = [post(reference.select_action(dict(batch), **(noise if t == 0 else {})))[0].cpu()
            for t, batch in enumerate(batches)]
    got = [engine.step(o.numpy()).cpu() for o in obs]
    worst = max(float((a.double() - b.double()).abs().max()) for a, b in zip(got, want))
    if kernels == 'lerobot':
        cast = '' if own is None else ' (its expert cast the same way)'
        check(checks, f'{name}: the engine equals LeRobot\'s pipeline{cast} bit for bit '
              f'({steps} steps; max |diff| {worst:.3g})',
              all(torch.equal(a, b) for a, b in zip(got, want)))
    elif kernels.endswith('+prefix'):   # the bfloat16 VLM's own kernels: its rounding
        scale = max(float(b.abs().max()) for b in want)
        check(checks, f'{name}: the engine is within 1 % of the actions\' scale of LeRobot\'s '
              f'pipeline{" (its expert cast the same way)" if own is not None else ""} '
              f'({steps} steps; max |diff| {worst:.3g}, actions up to {scale:.3g})',
              worst <= 0.01 * scale)
    elif expert == 'float32':   # LeRobot's within rounding (test_lerobot_compiled.py's bound)
        scale = max(float(b.abs().max()) for b in want)
        check(checks, f'{name}: the engine is within 1e-4 of LeRobot\'s pipeline ({steps} '
              f'steps; max |diff| {worst:.3g}, actions up to {scale:.3g})', worst <= 1e-4)
    if own is not None:     # the cast's distance to LeRobot's own (a float32 expert)
        seeded()
        theirs = [post(own.select_action(dict(b), **(noise if t == 0 else {})))[0].cpu()
                  for t, b in enumerate(batches)]
        off = max(float((a.double() - b.double()).abs().max()) for a, b in zip(got, theirs))
        scale = max(float(b.abs().max()) for b in theirs)
        check(checks, f'{name}: the engine is within 1 % of the actions\' scale of LeRobot\'s '
              f'own pipeline, float32 expert ({steps} steps; max |diff| {off:.3g}, actions up '
              f'to {scale:.3g})', off <= 0.01 * scale)
        del own
    engine.snapshot('mid')      # after a whole chunk: the next step computes one
    engine.restore('mid')
    engine.step(obs[0].numpy())
    engine.snapshot('mid', overwrite=True)     # one action used: the next step pops
    again = [engine.step(o.numpy()) for o in obs[1:]]
    for _ in range(8):
        engine.restore('mid')
        same = torch.equal(torch.stack([engine.step(o.numpy()) for o in obs[1:]]),
                           torch.stack(again))
        if not same:
            break
    check(checks, f'{name}: after a restore, the same actions (8 times)', same)

    def sync():
        if device.type == 'cuda':
            torch.cuda.synchronize(device)

    def lerobot_chunk():
        reference.reset()
        seeded()
        post(reference.select_action(dict(batches[0]), **noise))
        sync()

    def lerobot_pop():
        post(reference.select_action(dict(batches[1])))
        sync()

    def engine_chunk():
        engine.restore('start')
        engine.step(obs[0].numpy())

    def engine_pop():
        engine.restore('mid')
        engine.step(obs[1].numpy())

    resident = obs[0].to(device).view(1, -1)

    def engine_chunk_resident():    # the node's cameras path: the observation on the device
        engine.restore('start')
        engine.step_all(resident)

    def engine_graph():         # the chunk's computation alone: the floor of engine_chunk
        policy._chunk_graph.replay()
        sync()

    engine.reset_episode()
    engine.snapshot('start')
    walled = {'lerobot_chunk': lerobot_chunk, 'engine_chunk': engine_chunk,
              'engine_chunk_resident': engine_chunk_resident,
              'engine_chunk_graph': engine_graph,
              'engine_restore_and_pop': engine_pop,
              'engine_snapshot': lambda: engine.snapshot('timed', overwrite=True)}
    if kind == 'smolvla':       # the episode restarted with its first prefix kept
        first = engine.step(obs[0].numpy()).clone()
        engine.snapshot('first')

        def engine_kept_prefix():
            engine.restore('start')
            engine.restore('first', kinds=['kv'])
            return engine.step(obs[0].numpy())
        reused = policy.prefix_reused
        same = all(torch.equal(engine_kept_prefix(), first) for _ in range(8))
        check(checks, f'{name}: restarted with the first chunk\'s prefix kept, the same first '
              'action without the prefix pass (8 times)',
              same and policy.prefix_reused == reused + 8)
        walled['engine_chunk_kept_prefix'] = engine_kept_prefix
    lerobot_chunk()
    walls, _ = interleaved(None, {}, {}, cfg['iters'], cfg['warmup'], walled=walled,
                           before=None)
    # LeRobot's pop needs a filled queue: timed after a chunk, in its own loop
    pops = []
    for _ in range(cfg['iters']):
        lerobot_chunk()
        pops.append(wall(lerobot_pop)[1])
    walls['lerobot_pop'] = stats(pops)
    return {'size': name, **walls, 'max_abs_diff_vs_lerobot': worst,
            'capsule_bytes': int(engine.arena.live_nbytes(0)),
            'params': sum(p.numel() for p in reference.parameters()),
            'ratios': {'engine_chunk_vs_lerobot': ratio(walls['engine_chunk']['p50'],
                                                        walls['lerobot_chunk']['p50']),
                       'chunk_vs_restore_and_pop': ratio(walls['engine_chunk']['p50'],
                                                         walls['engine_restore_and_pop']['p50']),
                       **({'chunk_vs_kept_prefix': ratio(
                           walls['engine_chunk']['p50'],
                           walls['engine_chunk_kept_prefix']['p50'])} if kind == 'smolvla'
                          else {})}}


def render(results):
    env, out = results['environment'], []
    out += [f'# LeRobot policies on the engine vs LeRobot: {env["device_name"]} '
            f'({env["mode"]})\n', environment_line(env),
            '- whole call, host wall p50 in us (device synchronised); LeRobot eager; the '
            'engine\'s chunk one CUDA graph on CUDA, eager on the CPU; SmolVLA\'s VLM in '
            f'{env["vlm_dtype"]}, the rest float32\n',
            '- engine chunk: the observation from the host (numpy); on the device: as the '
            'node\'s cameras give it (and as LeRobot\'s pre-processor gives LeRobot its batch)\n',
            '| model | params | LeRobot chunk | engine chunk (ratio) | on the device | its graph '
            'alone | LeRobot pop | restore + next action | chunk / (restore + next) | snapshot | '
            'capsule bytes | first chunk, prefix kept (cold / kept) |', '|' + ' --- |' * 12]
    for r in results['sections'].get('rows', []):
        q = r['ratios']
        out.append(f'| {r["size"]} | {r["params"] / 1e6:.1f} M | '
                   f'{r["lerobot_chunk"]["p50"]:.0f} | {r["engine_chunk"]["p50"]:.0f} '
                   f'({q["engine_chunk_vs_lerobot"]:.2f}x) | '
                   f'{r["engine_chunk_resident"]["p50"]:.0f} | '
                   f'{r["engine_chunk_graph"]["p50"]:.0f} | {r["lerobot_pop"]["p50"]:.0f} | '
                   f'{r["engine_restore_and_pop"]["p50"]:.0f} | '
                   f'{q["chunk_vs_restore_and_pop"]:.0f}x | {r["engine_snapshot"]["p50"]:.0f} '
                   f'| {r["capsule_bytes"]:,} | ' + (
                       f'{r["engine_chunk_kept_prefix"]["p50"]:.0f} '
                       f'({q["chunk_vs_kept_prefix"]:.2f}x) |' if 'chunk_vs_kept_prefix' in q
                       else '- |'))
    return '\n'.join(out + checks_and_command(results)) + '\n'


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    ap.add_argument('--smoke', action='store_true')
    ap.add_argument('--device', default='cpu')
    ap.add_argument('--sizes', default='demo',
                    help="comma list of 'demo', 'published', 'aloha' (SmolVLA only)")
    ap.add_argument('--policies', default='smolvla',
                    help="comma list of 'smolvla', 'act', 'diffusion'")
    ap.add_argument('--vlm-dtype', default='float32', choices=('float32', 'bfloat16'))
    ap.add_argument('--denoise-kernels', default='lerobot',
                    help="SmolVLA: comma list of 'lerobot', 'compiled' (the denoising steps), "
                    "'compiled+prefix' (and the prefix pass), 'fused', 'fused+prefix' (the "
                    "expert's steps of our own) (a row each)")
    ap.add_argument('--expert-dtype', default='float32',
                    help="SmolVLA: comma list of 'float32', 'bfloat16' (a row each)")
    ap.add_argument('--out', default='')
    ap.add_argument('--commit', default='')
    ap.add_argument('--iters', type=int, default=0, help='timed iterations (0: the mode\'s)')
    args = ap.parse_args(argv)
    device = resolve_device(args.device)
    mode = 'smoke' if args.smoke else ('gpu' if device.type == 'cuda' else 'cpu')
    cfg = dict(CONFIGS[mode], **({'iters': args.iters} if args.iters else {}))
    env = dict(environment(device, f'vla-{mode}', args.commit), vlm_dtype=args.vlm_dtype)
    stem = f'{datetime.date.today().isoformat()}-{device_slug(env)}-vla'
    report = Report(results_stem(args.out, stem), env, cfg, render_md=render)
    report.results['command'] = 'python -m benchmarks.vla ' + ' '.join(
        sys.argv[1:] if argv is None else argv)
    report.results['sections'] = {'rows': []}
    for kind in args.policies.split(','):
        for size in args.sizes.split(','):
            if kind != 'smolvla' and size == 'aloha':
                continue
            variants = [(k, e) for k in args.denoise_kernels.split(',')
                        for e in args.expert_dtype.split(',')]
            for kernels, expert in variants if kind == 'smolvla' else [('lerobot', 'float32')]:
                with tempfile.TemporaryDirectory(prefix='frt-vla-') as tmp:
                    report.results['sections']['rows'].append(
                        run(device, kind, size, cfg, tmp, report.results['checks'],
                            getattr(torch, args.vlm_dtype), kernels, expert))
                report.write()
                log(f'  {kind} {size} {kernels} {expert} done')
    log(render(report.results))
    return 1 if any(not c['passed'] for c in report.results['checks']) else 0


if __name__ == '__main__':
    sys.exit(main())
