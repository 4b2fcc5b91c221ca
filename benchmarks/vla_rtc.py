"""Real-time chunking (runtime/policies/lerobot_rtc.py) for Pi0 / Pi0.5 and SmolVLA at their
published sizes (random weights, 3 cameras 224 x 224, 14-dim state and action, chunk 50;
benchmarks/vla_pi0.py builds Pi0 / Pi0.5, lerobot_demo's 'aloha' size SmolVLA with its VLM in
bfloat16, as a published checkpoint loads), against LeRobot's own RTC (predict_action_chunk
with inference_delay and prev_chunk_left_over: its RTCProcessor guidance, eager).

    python -m benchmarks.vla_rtc --device cuda --kinds pi05,smolvla --period 0.02 --commit <sha>

  guided chunk  the computation of one guided chunk, the whole call: LeRobot's (normaliser,
                predict_action_chunk, unnormaliser) vs the engine's (launch and wait for the
                landing); its p99 in control periods is the least delay each can run with;
  episode       a control loop paced at --period (a tick every period, the steps' wall time
                measured; time not spent in a step is slept): the same policy without RTC (a
                chunk computed when the queue runs empty: the robot waits for it) and with RTC
                (delay: the engine's unguided chunk in periods, plus one; threshold delay +
                execution horizon, LeRobot's advice). Per step after the first p50 / p99 /
                max, and the steps that overran the period; the first step (the episode's
                first chunk, computed at once with or without RTC) apart.
Identity checks (exit 1 on failure): the engine's guided chunk equals LeRobot's bit for bit on
the same inputs, leftover and noise; the paced RTC episode's actions equal, bit for bit, the
same episode replayed unpaced from its start capsule, 8 times (the landing waits then: timing
does not change actions).
"""
import argparse
import datetime
import math
import sys
import tempfile
import time

import torch

from .environment import device_slug, environment, resolve_device, results_stem
from .report import checks_and_command, environment_line, log, Report
from .sections import check
from .timing import stats
from .vla_pi0 import build, CAMERAS, DIM, SIDE

CONFIGS = {'smoke': {'iters': 2, 'steps': 120}, 'gpu': {'iters': 10, 'steps': 160}}


def _build(device, kind, tmp):
    """(LeRobot's config, its policy with random weights on device, the statistics, the
    generator of the frames, the engine's policy class) at the published sizes."""
    from flashrt_ros.runtime.policies import Pi05ChunkPolicy, Pi0ChunkPolicy, SmolVLAChunkPolicy
    if kind != 'smolvla':
        return (*build(device, kind, 'bfloat16'),
                Pi05ChunkPolicy if kind == 'pi05' else Pi0ChunkPolicy)
    from flashrt_ros.runtime.policies import lerobot_demo as demo
    policy = demo.smolvla(demo.vlm_folder(f'{tmp}/vlm', 'aloha'), size='aloha').to(device)
    policy.model.vlm_with_expert.vlm.to(torch.bfloat16)
    policy.config.device = str(device)      # where LeRobot's pre-processor puts the batch
    return (policy.config, policy, demo.statistics(size='aloha'),
            torch.Generator().manual_seed(1), SmolVLAChunkPolicy)


def _observations(config, gen, count, vocabulary):
    """count observation vectors (state, 3 images, a 20-token instruction), each step's state
    a little different (no two chunks' prefixes alike)."""
    cams = list(config.image_features)
    tokens = config.tokenizer_max_length
    base = {'observation.state': torch.randn(DIM, generator=gen),
            **{k: torch.rand(3, SIDE, SIDE, generator=gen) for k in cams},
            'observation.language.tokens': torch.randint(0, vocabulary, (1, tokens),
                                                         generator=gen),
            'observation.language.attention_mask': torch.arange(tokens).view(1, -1) < 20}
    frames = [dict(base, **{'observation.state': base['observation.state'] + 1e-3 * t})
              for t in range(count)]
    return frames, [torch.cat([f['observation.state'], *[f[k].reshape(-1) for k in cams],
                               f['observation.language.tokens'].reshape(-1).float(),
                               f['observation.language.attention_mask'].reshape(-1).float()]
                              ).numpy() for f in frames]


def _paced(engine, obs, period):
    """Steps at a tick every period: each step's wall time (us) and the actions."""
    times, actions, tick = [], [], time.perf_counter()
    for o in obs:
        t0 = time.perf_counter()
        actions.append(engine.step(o).clone())
        times.append((time.perf_counter() - t0) * 1e6)
        tick += period
        time.sleep(max(0.0, tick - time.perf_counter()))
    return times, actions


def _episode(times, period):
    '''The paced steps after the episode's first (which computes the first chunk with nothing
    queued, with or without RTC: its time is reported apart), and the steps that overran.'''
    return dict(stats(times[1:]), first=times[0],
                overran=sum(t > period * 1e6 for t in times[1:]))


def run(device, kind, cfg, tmp, checks, period):
    from lerobot.processor.factory import make_default_pre_post_processors

    from flashrt_ros.runtime.engine import PolicyEngine
    from flashrt_ros.runtime.policies import gaussian_noise
    config, policy, stats_, gen, ours = _build(device, kind, tmp)
    pre, post = make_default_pre_post_processors(config, stats_)
    chunk = config.chunk_size
    horizon = 10
    # the delay from a first estimate (the unguided chunk's latency), then measured again
    plain = PolicyEngine(ours(policy, stats=stats_, seed=5), device=device,
                         capsule_dir=f'{tmp}/plain')
    frames, obs = _observations(config, gen, cfg['steps'], plain.policy.vocabulary)
    plain.snapshot('start')
    for _ in range(3):
        plain.restore('start')
        t0 = time.perf_counter()
        plain.step(obs[0])
        first = time.perf_counter() - t0
    delay = math.ceil(first / period) + 1
    threshold = delay + horizon
    engine = PolicyEngine(ours(policy, stats=stats_, seed=5, rtc_delay=delay,
                               rtc_queue_threshold=threshold, rtc_execution_horizon=horizon),
                          device=device, capsule_dir=f'{tmp}/rtc')
    mine = engine.policy
    engine.snapshot('start')
    launch_at = chunk - threshold
    for o in obs[:launch_at]:
        engine.step(o)
    engine.snapshot('launch')       # the step before the launch: its leftover, its rng
    leftover = mine.views['original'][chunk - threshold:].clone()
    counter = int(mine.views['rng'][1])

    def sync():
        if device.type == 'cuda':
            torch.cuda.synchronize(device)

    def lerobot_guided():
        noise = gaussian_noise(torch.tensor([5], device=device),
                               torch.tensor([counter], device=device),
                               chunk * config.max_action_dim).view(1, chunk,
                                                                   config.max_action_dim)
        out = policy.predict_action_chunk(pre(dict(frames[launch_at])), noise=noise,
                                          inference_delay=delay, prev_chunk_left_over=leftover)
        sync()
        return out

    def engine_guided():
        engine.restore('launch')
        engine.step(obs[launch_at])     # the launch
        mine._land()                    # waits for it, puts it into the queue
        sync()
    from lerobot.policies.rtc.configuration_rtc import RTCConfig
    policy.config.rtc_config = RTCConfig(enabled=True, execution_horizon=horizon)
    policy.init_rtc_processor()
    try:
        want = lerobot_guided()[0]
        engine_guided()
        got = mine.views['original'].clone()
        name = f'{kind} bfloat16 (delay {delay}, threshold {threshold})'
        check(checks, f'{name}: the engine\'s guided chunk equals LeRobot\'s RTC bit for bit '
              f'(max |diff| {float((got - want).abs().max()):.3g})', torch.equal(got, want))
        timed = {'lerobot_guided_chunk': [], 'engine_guided_chunk': []}
        for _ in range(cfg['iters']):
            for key, fn in (('lerobot_guided_chunk', lerobot_guided),
                            ('engine_guided_chunk', engine_guided)):
                t0 = time.perf_counter()
                fn()
                timed[key].append((time.perf_counter() - t0) * 1e6)
    finally:
        policy.config.rtc_config = None
        policy.init_rtc_processor()
    row = {'policy': name, 'delay': delay, 'threshold': threshold, 'period_s': period,
           **{k: stats(v) for k, v in timed.items()}}
    row['least_delay'] = {k: math.ceil(row[k]['p99'] / 1e6 / period) for k in timed}
    plain.restore('start')
    row['episode_queue'] = _episode(_paced(plain, obs, period)[0], period)
    engine.restore('start')
    times, actions = _paced(engine, obs, period)
    row['episode_rtc'] = _episode(times, period)
    same = True
    for _ in range(8):
        engine.restore('start')
        same &= all(torch.equal(engine.step(o), a) for o, a in zip(obs, actions))
    check(checks, f'{name}: the paced RTC episode ({len(obs)} steps) replays unpaced bit for '
          'bit, 8 times', same)
    return row


def render(results):
    env, out = results['environment'], []
    out += [f'# Real-time chunking on the engine vs LeRobot\'s: {env["device_name"]} '
            f'({env["mode"]})\n', environment_line(env),
            '- pi0 / pi05: PaliGemma 2B + Gemma 300M expert in bfloat16 (vision float32, '
            'LeRobot\'s); smolvla: SmolVLM2-500M\'s sizes (VLM in bfloat16, the expert in '
            f'float32); random weights, {CAMERAS} cameras {SIDE} x {SIDE}, {DIM}-dim state '
            'and action, chunk 50, 10 flow-matching steps, execution horizon 10; whole call, '
            'host wall in ms; LeRobot eager\n',
            '| policy | guided chunk: LeRobot p50 / p99 | engine p50 / p99 (ratio) | least '
            'delay at the period: LeRobot / engine | paced episode without RTC: steps after '
            'the first p50 / p99 / max, overran | with RTC: the same | the first step (the '
            'first chunk): without / with RTC |',
            '|' + ' --- |' * 7]
    for r in results['sections'].get('rows', []):
        def ms(s, keys=('p50', 'p99')):
            return ' / '.join(f'{s[k] / 1e3:.2f}' for k in keys)
        lr, en = r['lerobot_guided_chunk'], r['engine_guided_chunk']
        q, e = r['episode_queue'], r['episode_rtc']
        out.append(f'| {r["policy"]}, period {r["period_s"] * 1e3:.0f} ms | {ms(lr)} | '
                   f'{ms(en)} ({lr["p50"] / en["p50"]:.2f}x) | '
                   f'{r["least_delay"]["lerobot_guided_chunk"]} / '
                   f'{r["least_delay"]["engine_guided_chunk"]} | '
                   f'{ms(q, ("p50", "p99", "max"))}, {q["overran"]} | '
                   f'{ms(e, ("p50", "p99", "max"))}, {e["overran"]} | '
                   f'{q["first"] / 1e3:.2f} / {e["first"] / 1e3:.2f} |')
    return '\n'.join(out + checks_and_command(results)) + '\n'


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    ap.add_argument('--smoke', action='store_true')
    ap.add_argument('--device', default='cuda')
    ap.add_argument('--kinds', default='pi05', help="comma list of 'pi0', 'pi05', 'smolvla'")
    ap.add_argument('--period', type=float, default=0.02, help='control period, s')
    ap.add_argument('--out', default='')
    ap.add_argument('--commit', default='')
    args = ap.parse_args(argv)
    device = resolve_device(args.device)
    mode = 'smoke' if args.smoke else 'gpu'
    env = environment(device, f'vla-rtc-{mode}', args.commit)
    stem = f'{datetime.date.today().isoformat()}-{device_slug(env)}-vla-rtc'
    report = Report(results_stem(args.out, stem), env, CONFIGS[mode], render_md=render)
    report.results['command'] = 'python -m benchmarks.vla_rtc ' + ' '.join(
        sys.argv[1:] if argv is None else argv)
    report.results['sections'] = {'rows': []}
    for kind in args.kinds.split(','):
        with tempfile.TemporaryDirectory(prefix='frt-rtc-') as tmp:
            report.results['sections']['rows'].append(
                run(device, kind, CONFIGS[mode], tmp, report.results['checks'], args.period))
        report.write()
        if device.type == 'cuda':
            torch.cuda.empty_cache()
    log(render(report.results))
    return 1 if any(not c['passed'] for c in report.results['checks']) else 0


if __name__ == '__main__':
    sys.exit(main())
