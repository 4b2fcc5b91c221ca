"""LeRobot's own real-time chunking loop, run step by step with a fixed delay: what the engine's
real-time chunking (runtime/policies/lerobot_rtc.py) must equal bit for bit."""
import contextlib

import torch

from flashrt_ros.runtime.policies import gaussian_noise


def rtc_config(horizon, schedule='exp', weight=10.0):
    """LeRobot's RTCConfig, enabled."""
    from lerobot.configs.types import RTCAttentionSchedule
    from lerobot.policies.rtc.configuration_rtc import RTCConfig
    return RTCConfig(enabled=True, execution_horizon=horizon, max_guidance_weight=weight,
                     prefix_attention_schedule=RTCAttentionSchedule(schedule.upper()))


def lerobots_rtc_actions(reference, pre, post, frames, config, delay, threshold, seed,
                         noise_shape, device='cpu', guided=True):
    """The actions LeRobot's examples/rtc/eval_with_real_robot.py loop gives, with its two
    threads run in lock step: the chunk requested once threshold actions are left (with what is
    left of the last one), merged into its ActionQueue `delay` actions later (the first at
    once), the noise the engine draws for the k-th chunk (seed, k). guided=False: the same
    loop with no leftover passed (no guidance), to show that the guidance changes actions."""
    from lerobot.policies.rtc.action_queue import ActionQueue
    with _enabled(reference, config):
        reference.reset()
        queue, pending, chunks, out = ActionQueue(config), None, 0, []
        for t, frame in enumerate(frames):
            if pending is not None and t == pending[0]:
                queue.merge(*pending[1:])
                pending = None
            if pending is None and queue.qsize() <= threshold:
                first, index = queue.qsize() == 0, queue.get_action_index()
                left_over = None if first or not guided else queue.get_left_over()
                noise = gaussian_noise(torch.tensor([seed], device=device),
                                       torch.tensor([chunks], device=device),
                                       noise_shape[1] * noise_shape[2]).view(noise_shape)
                chunks += 1
                batch = {k: v.to(device) if torch.is_tensor(v) else v
                         for k, v in pre(dict(frame)).items()}
                actions = reference.predict_action_chunk(
                    batch, noise=noise, inference_delay=delay, prev_chunk_left_over=left_over)
                merge = (actions.squeeze(0).clone(), post(actions).squeeze(0))
                if first:           # nothing to play meanwhile: at once, nothing dropped
                    queue.merge(*merge, 0, index)
                else:
                    pending = (t + delay, *merge, delay, index)
                    if delay == 0:
                        queue.merge(*pending[1:])
                        pending = None
            out.append(queue.get().cpu())
        return out


@contextlib.contextmanager
def _enabled(reference, config):
    """reference with RTC config enabled inside; as it was after (a test's engine may share
    it)."""
    own = reference.config.rtc_config
    reference.config.rtc_config = config
    reference.init_rtc_processor()
    try:
        yield
    finally:
        reference.config.rtc_config = own
        reference.init_rtc_processor()
