"""Probe: SmolVLA's chunk graph with parts of LeRobot's model compiled by torch.compile
(inductor's fused kernels) or its action expert cast to bfloat16, against the same graph on
LeRobot's own kernels: replay time, distance of the chunk, and whether replays stay
bit-identical.

    python -m benchmarks.vla_compile --device cuda [--size published]
"""
import argparse
import tempfile
import time

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


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument('--device', default='cuda')
    ap.add_argument('--size', default='published')
    ap.add_argument('--variants', default='denoise;denoise,forward;denoise,forward,image')
    ap.add_argument('--mode', default=None)
    args = ap.parse_args()
    dev = torch.device(args.device)
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
