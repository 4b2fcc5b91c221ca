"""The demo SmolVLA checkpoint (flashrt_ros/runtime/policies/lerobot_demo.py) and what the
tests feed it: raw frames, LeRobot's own pre-processor, the engine's observation vectors.
Needs lerobot (requirements/vla.txt); the callers skip without it."""
import numpy as np
import torch

from flashrt_ros.runtime.policies.lerobot_demo import (ACT_DIM, CAMERAS, checkpoint,  # noqa
                                                       smolvla, STATE_DIM, statistics, TOKENS,
                                                       vlm_folder)

TASKS = ['pick up the red cube', 'open the drawer']


def frames(count, seed=0):
    """Raw observations (state, images in [0, 1], the task) as a robot gives them; the task
    changes every 7 frames."""
    rng = np.random.default_rng(seed)
    return [{'observation.state': torch.from_numpy(rng.standard_normal(STATE_DIM) * 2 + 1
                                                   ).float(),
             **{k: torch.from_numpy(rng.random(s, dtype=np.float32)) for k, s in
                CAMERAS.items()},
             'task': TASKS[t // 7 % 2]} for t in range(count)]


def pipeline(folder, device=None):
    """LeRobot's pre- and post-processor of the checkpoint, as its own scripts load them
    (device: the run's, over the one the checkpoint names, as lerobot-eval overrides it)."""
    from lerobot.configs.policies import PreTrainedConfig
    from lerobot.policies.factory import make_pre_post_processors
    on = {'device_processor': {'device': device}} if device else {}
    return make_pre_post_processors(PreTrainedConfig.from_pretrained(folder), folder,
                                    preprocessor_overrides=on, postprocessor_overrides=on)


def vectors(folder, batch):
    """flashrt_ros observation vectors of frames: the raw state, the images, and the task's
    token ids and attention mask as the checkpoint's own pre-processor makes them."""
    pre, _ = pipeline(folder)
    out = []
    for frame in batch:
        done = pre(dict(frame))
        out.append(np.concatenate(
            [frame['observation.state'].numpy(), *[frame[k].numpy().ravel() for k in CAMERAS],
             done['observation.language.tokens'].numpy().ravel().astype(np.float32),
             done['observation.language.attention_mask'].numpy().ravel().astype(np.float32)]))
    return out


OBS_DIM = STATE_DIM + sum(c * h * w for c, h, w in CAMERAS.values()) + 2 * TOKENS
