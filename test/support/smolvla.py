"""A tiny SmolVLA built offline with LeRobot itself: a SmolVLM config folder (small sizes, the
published architecture) with a byte-level stand-in tokenizer holding SmolVLM2's special
tokens, and a SmolVLAPolicy on it with seeded random weights. Needs lerobot (requirements/
vla.txt); the callers skip without it."""
import numpy as np
import torch

STATE_DIM, ACT_DIM, TOKENS = 6, 5, 12
CAMERAS = {'observation.images.top': (3, 48, 64), 'observation.images.wrist': (3, 32, 32)}
SPECIALS = ['<|endoftext|>', '<fake_token_around_image>', '<global-img>', '<image>',
            '<end_of_utterance>']


def vlm_folder(path):
    """Writes a SmolVLM config + processor folder (what SmolVLAConfig.vlm_model_name names)."""
    from tokenizers import decoders, models, pre_tokenizers, Tokenizer
    from transformers import PreTrainedTokenizerFast, SmolVLMConfig
    from transformers.models.smolvlm import (SmolVLMImageProcessor, SmolVLMProcessor,
                                             SmolVLMVideoProcessor)
    vocab = {s: i for i, s in enumerate(SPECIALS)}
    for ch in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=SPECIALS[0], eos_token=SPECIALS[4],
        pad_token=SPECIALS[0], additional_special_tokens=SPECIALS[1:],
        extra_special_tokens={'fake_image_token': SPECIALS[1], 'global_image_token': SPECIALS[2],
                              'image_token': SPECIALS[3], 'end_of_utterance_token': SPECIALS[4]})
    SmolVLMConfig(
        text_config=dict(model_type='llama', hidden_size=64, intermediate_size=128,
                         num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=16, vocab_size=len(vocab), max_position_embeddings=512),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=2, image_size=64, patch_size=16),
        scale_factor=2, image_token_id=vocab['<image>'], vocab_size=len(vocab),
    ).save_pretrained(path)
    SmolVLMProcessor(image_processor=SmolVLMImageProcessor(
        size={'longest_edge': 64}, max_image_size={'longest_edge': 64},
        do_image_splitting=False), video_processor=SmolVLMVideoProcessor(), tokenizer=fast,
        image_seq_len=4).save_pretrained(path)
    return str(path)


def smolvla(vlm_path, seed=0, chunk_size=8, n_action_steps=5, num_steps=3):
    """A lerobot SmolVLAPolicy on the folder, weights from torch.manual_seed(seed)."""
    from lerobot.configs.types import FeatureType, PolicyFeature
    from lerobot.policies.smolvla.configuration_smolvla import SmolVLAConfig
    from lerobot.policies.smolvla.modeling_smolvla import SmolVLAPolicy
    features = {'observation.state': PolicyFeature(FeatureType.STATE, (STATE_DIM,)),
                **{k: PolicyFeature(FeatureType.VISUAL, s) for k, s in CAMERAS.items()}}
    config = SmolVLAConfig(
        vlm_model_name=str(vlm_path), load_vlm_weights=False, chunk_size=chunk_size,
        n_action_steps=n_action_steps, num_vlm_layers=4, num_steps=num_steps,
        resize_imgs_with_padding=(64, 64), max_state_dim=16, max_action_dim=16,
        tokenizer_max_length=TOKENS, pad_language_to='max_length', input_features=features,
        output_features={'action': PolicyFeature(FeatureType.ACTION, (ACT_DIM,))},
        device='cpu')
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return SmolVLAPolicy(config).eval()


def statistics(seed=0):
    """Dataset statistics (mean/std) for the state and the action, as a LeRobot dataset has."""
    gen = torch.Generator().manual_seed(seed)
    return {key: {'mean': torch.randn(n, generator=gen),
                  'std': torch.rand(n, generator=gen) + 0.5}
            for key, n in (('observation.state', STATE_DIM), ('action', ACT_DIM))}


def checkpoint(vlm_path, folder, seed=0):
    """A LeRobot checkpoint folder as training writes it: the policy's config.json and
    model.safetensors, and its pre/post-processor pipelines with their statistics."""
    from lerobot.policies.smolvla.processor_smolvla import make_smolvla_pre_post_processors
    policy = smolvla(vlm_path, seed)
    pre, post = make_smolvla_pre_post_processors(policy.config, statistics(seed))
    for part in (policy, pre, post):
        part.save_pretrained(folder)
    return str(folder)


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


def pipeline(folder):
    """LeRobot's pre- and post-processor of the checkpoint, as its own scripts load them."""
    from lerobot.policies.factory import make_pre_post_processors
    from lerobot.policies.smolvla.modeling_smolvla import SmolVLAPolicy
    return make_pre_post_processors(SmolVLAPolicy.from_pretrained(folder).config, folder)


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
