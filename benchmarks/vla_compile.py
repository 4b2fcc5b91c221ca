"""Probe: SmolVLA's chunk graph with parts of LeRobot's model compiled by torch.compile
(inductor's fused kernels) or its action expert cast to bfloat16, against the same graph on
LeRobot's own kernels: replay time, distance of the chunk, and whether replays stay
bit-identical. --policy pi05: Pi0.5's denoising steps (benchmarks/vla_pi0.py's model, vision
in bfloat16, LeRobot's prefix kernels) compiled as shipped against variants: inductor's
freezing (the weights constants: the matmuls sharing an input fused into one, with
concatenated weights) and the whole loop of steps as one compiled function (its timesteps
constants: with freezing, the time MLP and every AdaRMS modulation folded at compile time).

    python -m benchmarks.vla_compile --device cuda [--size published]
    python -m benchmarks.vla_compile --device cuda --policy pi05 \
        --variants 'denoise;denoise,freezing;loop,freezing'
"""
import argparse
import tempfile
import time
import types

import torch

from benchmarks import vla
from benchmarks.vla_profile import _replay_ms


def _compile(lerobot, parts, mode):
    """Parts of a LeRobot SmolVLAPolicy's model compiled (as the node compiles them,
    lerobot_prefix.compiled; --mode: torch.compile's other mode), or 'expert': the action
    expert cast to bfloat16 (lerobot_smolvla.expert_in_bfloat16)."""
    from flashrt_ros.runtime.policies.lerobot_prefix import compiled as shipped
    from flashrt_ros.runtime.policies.lerobot_smolvla import expert_in_bfloat16
    model = lerobot.model
    vwe = model.vlm_with_expert
    compiled = (lambda fn: torch.compile(fn, mode=mode, dynamic=False)) if mode else shipped
    if 'expert' in parts:
        expert_in_bfloat16(lerobot)
    if 'denoise' in parts:
        model.denoise_step = compiled(model.denoise_step)
    if 'forward' in parts:
        vwe.forward = compiled(vwe.forward)
    if 'image' in parts:
        vwe.embed_image = compiled(vwe.embed_image)


def _pi05_loop(policy, compile_options):
    """Pi0ChunkPolicy._denoise with LeRobot's euler_integrate over denoise_step compiled as one
    function of the kept prefix and the noise (the timesteps inside it: constants)."""
    from lerobot.policies.common.flow_matching import euler_integrate
    from transformers import DynamicCache
    model, steps = policy.lerobot.model, policy.lerobot.config.num_inference_steps

    def loop(pad, keys, values, noise):
        kv = DynamicCache()
        for i in range(keys.shape[0]):
            kv.update(keys[i], values[i], i)
        return euler_integrate(lambda x, t: model.denoise_step(
            prefix_pad_masks=pad, past_key_values=kv, x_t=x, timestep=t), noise, steps)
    loop = torch.compile(loop, dynamic=False, options=compile_options)

    def denoise(self, batch):
        c = self._cache
        return self._chunk_outputs(loop(c['prefix_pad'], c['prefix_k'], c['prefix_v'],
                                        self.noise(self._chunk_rng)))
    policy._denoise = types.MethodType(denoise, policy)


def pi05(dev, variants):
    """Pi0.5's denoising-steps graph, per variant: replay time, 8 replays, distance to the
    first variant's chunk."""
    import torch._dynamo

    from benchmarks import vla_pi0
    from flashrt_ros.runtime.policies import Pi05ChunkPolicy
    _, lerobot, stats, _ = vla_pi0.build(dev, 'pi05', 'bfloat16')
    policy = Pi05ChunkPolicy(lerobot, stats=stats, vision_dtype='bfloat16')
    policy.state_specs()
    policy.capture(True)
    policy._chunk_obs.uniform_()
    policy._chunk_obs[-2 * policy.tokens:] = 1       # valid token ids and mask
    policy._chunk_graph.replay()                     # the kept prefix the steps read
    torch.cuda.synchronize()
    prefix = {k: v.clone() for k, v in policy._cache.items()}
    step, first = lerobot.model.denoise_step, None
    print(f'lerobot kernels: denoising graph {_replay_ms(policy._denoise_graph, 20):.2f} ms',
          flush=True)
    for variant in variants:
        parts = variant.split(',')
        options = {'deterministic': True, 'freezing': 'freezing' in parts}
        torch._dynamo.reset()
        lerobot.model.denoise_step = step
        policy.__dict__.pop('_denoise', None)
        if 'loop' in parts:
            _pi05_loop(policy, options)
        else:
            lerobot.model.denoise_step = torch.compile(step, dynamic=False, options=options)
        t0 = time.perf_counter()
        policy.capture(True)
        built = time.perf_counter() - t0
        for k, v in prefix.items():
            policy._cache[k].copy_(v)
        ms = _replay_ms(policy._denoise_graph, 20)
        outs = []
        for _ in range(8):
            policy._denoise_graph.replay()
            outs.append(policy._denoise_out['queue'].clone())
        same = all(torch.equal(o, outs[0]) for o in outs)
        first = outs[0] if first is None else first
        diff = (outs[0].float() - first.float()).abs().max().item()
        print(f'{variant}: built+captured in {built:.1f} s, denoising graph {ms:.2f} ms, 8 '
              f'replays identical {same}, max abs diff vs the first variant {diff:.3g} (of '
              f'{first.abs().max().item():.3g})', flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument('--device', default='cuda')
    ap.add_argument('--policy', default='smolvla', help='smolvla or pi05')
    ap.add_argument('--size', default='published')
    ap.add_argument('--variants', default=None, help="';'-separated; each ','-joined parts")
    ap.add_argument('--mode', default=None)
    args = ap.parse_args()
    dev = torch.device(args.device)
    if args.policy == 'pi05':
        return pi05(dev, (args.variants or 'denoise;denoise,freezing;loop,freezing').split(';'))
    args.variants = args.variants or 'denoise;denoise,forward;denoise,forward,image'
    with tempfile.TemporaryDirectory() as tmp:
        _, _, _, policy, _ = vla._models('smolvla', args.size, dev, tmp, torch.bfloat16)
        policy.capture(True)
        torch.manual_seed(0)
        obs = torch.rand_like(policy._chunk_obs)
        policy._chunk_obs.copy_(obs)
        cuda = dev.type == 'cuda'
        ms = _replay_ms(policy._chunk_graph, 20) if cuda else float('nan')
        policy._chunk_graph.replay()
        base = {k: v.clone() for k, v in policy._chunk_out.items()}
        print(f'lerobot kernels: chunk graph replay {ms:.2f} ms', flush=True)
        for variant in args.variants.split(';'):
            parts = variant.split(',')
            _compile(policy.lerobot, parts, args.mode)
            t0 = time.perf_counter()
            policy.capture(True)
            built = time.perf_counter() - t0
            policy._chunk_obs.copy_(obs)
            ms = _replay_ms(policy._chunk_graph, 20) if cuda else float('nan')
            outs = []
            for _ in range(8):
                policy._chunk_graph.replay()
                outs.append({k: v.clone() for k, v in policy._chunk_out.items()})
            same = all(torch.equal(o[k], outs[0][k]) for o in outs for k in o)
            diffs = {k: (outs[0][k].float() - base[k].float()).abs().max().item()
                     for k in base if base[k].is_floating_point()}
            scale = {k: base[k].float().abs().max().item() for k in diffs}
            print(f'compiled {variant}: built+captured in {built:.1f} s, replay {ms:.2f} ms, '
                  f'8 replays identical {same}, max abs diff vs lerobot kernels '
                  + ', '.join(f'{k} {d:.3g} (of {scale[k]:.3g})' for k, d in diffs.items()),
                  flush=True)


if __name__ == '__main__':
    main()
