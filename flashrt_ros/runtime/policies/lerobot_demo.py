'''A demo SmolVLA checkpoint, written by LeRobot itself, offline: a SmolVLM config folder
(the published architecture at small sizes) with a byte-level stand-in tokenizer holding
SmolVLM2's special tokens, a SmolVLAPolicy on it with seeded random weights, and its pre- and
post-processor with seeded statistics, saved as training saves a checkpoint. For the tests,
the benchmarks and trying the node without a trained checkpoint; its actions mean nothing.
Needs lerobot (requirements/vla.txt).'''
import torch

STATE_DIM, ACT_DIM, TOKENS = 6, 5, 12
CAMERAS = {'observation.images.top': (3, 48, 64), 'observation.images.wrist': (3, 32, 32)}
# 'demo': small enough for every test on a CPU; 'published': SmolVLM2-500M's text and vision
# sizes, SmolVLA's defaults (16 VLM layers, 512 x 512 images, chunks of 50, 10 denoising
# steps), one 480 x 640 camera and a 6-joint arm, for benchmarks
SIZES = {
    'demo': dict(text=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16),
                 vision=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=2, image_size=64, patch_size=16),
                 scale_factor=2, image_seq_len=4, policy=dict(
                     num_vlm_layers=4, resize_imgs_with_padding=(64, 64), chunk_size=8,
                     n_action_steps=5, num_steps=3, max_state_dim=16, max_action_dim=16,
                     tokenizer_max_length=TOKENS), cameras=CAMERAS, dims=(STATE_DIM, ACT_DIM)),
    'published': dict(text=dict(hidden_size=960, intermediate_size=2560, num_hidden_layers=32,
                                num_attention_heads=15, num_key_value_heads=5, head_dim=64),
                      vision=dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                                  num_attention_heads=12, image_size=512, patch_size=16),
                      scale_factor=4, image_seq_len=64, policy=dict(
                          num_vlm_layers=16, resize_imgs_with_padding=(512, 512),
                          chunk_size=50, n_action_steps=50, num_steps=10, max_state_dim=32,
                          max_action_dim=32, tokenizer_max_length=48),
                      cameras={'observation.images.top': (3, 480, 640)}, dims=(6, 6)),
}
# 'aloha': the published sizes with a bimanual robot's inputs, as issue 24 measured LeRobot:
# three 224 x 224 cameras (resized to 512 x 512 by SmolVLA), 14-dim state and action
SIZES['aloha'] = dict(SIZES['published'], dims=(14, 14), cameras={
    f'observation.images.{name}': (3, 224, 224) for name in ('top', 'left_wrist', 'right_wrist')})
# 'cameras': the demo model with three 480 x 640 cameras, as a robot arm's drivers publish
# them (benchmarks/camera_ticks.py: decoding their JPEG frames beside the control thread)
SIZES['cameras'] = dict(SIZES['demo'], cameras={
    f'observation.images.{name}': (3, 480, 640) for name in ('top', 'left_wrist', 'right_wrist')})
# ACT: 'demo' for the tests; 'published': ACTConfig's defaults (ResNet-18, dim_model 512,
# chunks of 100), one 480 x 480 camera and 14 dims, for benchmarks
ACT_SIZES = {
    'demo': dict(cameras=CAMERAS, dims=(STATE_DIM, ACT_DIM), config=dict(
        chunk_size=8, n_action_steps=5, dim_model=32, n_heads=2, dim_feedforward=64,
        n_encoder_layers=1, n_decoder_layers=1, n_vae_encoder_layers=1, latent_dim=8)),
    'published': dict(cameras={'observation.images.top': (3, 480, 480)}, dims=(14, 14),
                      config=dict(n_action_steps=100)),
}
# Diffusion Policy: 'demo' for the tests (two cameras of one shape, DDPM over 10 steps);
# 'published': DiffusionConfig's defaults (its PushT-sized U-Net, DDPM over 100 steps), one
# 96 x 96 camera cropped to 84 x 84, 2 dims, for benchmarks
DIFFUSION_SIZES = {
    'demo': dict(cameras={f'observation.images.{k}': (3, 48, 64) for k in ('top', 'wrist')},
                 dims=(STATE_DIM, ACT_DIM), config=dict(
                     n_obs_steps=2, horizon=8, n_action_steps=4, down_dims=(32, 64),
                     kernel_size=3, diffusion_step_embed_dim=32, spatial_softmax_num_keypoints=8,
                     crop_shape=(40, 56), num_train_timesteps=10)),
    'published': dict(cameras={'observation.images.top': (3, 96, 96)}, dims=(2, 2),
                      config=dict(crop_shape=(84, 84))),
}
SPECIALS = ['<|endoftext|>', '<fake_token_around_image>', '<global-img>', '<image>',
            '<end_of_utterance>']


def byte_tokenizer(specials, **tokens):
    '''A byte-level stand-in tokenizer (transformers' PreTrainedTokenizerFast): the special
    tokens first, then one token per byte, no merges; tokens: its bos_token, pad_token, ...'''
    from tokenizers import decoders, models, pre_tokenizers, Tokenizer
    from transformers import PreTrainedTokenizerFast
    vocab = {s: i for i, s in enumerate(specials)}
    for ch in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, **tokens)


def vlm_folder(path, size='demo'):
    '''Writes a SmolVLM config + processor folder (what SmolVLAConfig.vlm_model_name names).'''
    from transformers import SmolVLMConfig
    from transformers.models.smolvlm import (SmolVLMImageProcessor, SmolVLMProcessor,
                                             SmolVLMVideoProcessor)
    fast = byte_tokenizer(
        SPECIALS, bos_token=SPECIALS[0], eos_token=SPECIALS[4],
        pad_token=SPECIALS[0], additional_special_tokens=SPECIALS[1:],
        extra_special_tokens={'fake_image_token': SPECIALS[1], 'global_image_token': SPECIALS[2],
                              'image_token': SPECIALS[3], 'end_of_utterance_token': SPECIALS[4]})
    vocab = fast.get_vocab()
    z = SIZES[size]
    SmolVLMConfig(
        text_config=dict(model_type='llama', vocab_size=len(vocab), max_position_embeddings=8192,
                         **z['text']),
        vision_config=z['vision'], scale_factor=z['scale_factor'],
        image_token_id=vocab['<image>'], vocab_size=len(vocab),
    ).save_pretrained(path)
    edge = {'longest_edge': z['vision']['image_size']}
    SmolVLMProcessor(image_processor=SmolVLMImageProcessor(
        size=edge, max_image_size=edge, do_image_splitting=False),
        video_processor=SmolVLMVideoProcessor(), tokenizer=fast,
        image_seq_len=z['image_seq_len']).save_pretrained(path)
    return str(path)


def smolvla(vlm_path, seed=0, size='demo', **options):
    '''A lerobot SmolVLAPolicy on the folder, weights from torch.manual_seed(seed); options
    override the size's SmolVLAConfig fields (num_steps=4, ...).'''
    from lerobot.configs.types import FeatureType, PolicyFeature
    from lerobot.policies.smolvla.configuration_smolvla import SmolVLAConfig
    from lerobot.policies.smolvla.modeling_smolvla import SmolVLAPolicy
    z = SIZES[size]
    state, act = z['dims']
    features = {'observation.state': PolicyFeature(FeatureType.STATE, (state,)),
                **{k: PolicyFeature(FeatureType.VISUAL, s) for k, s in z['cameras'].items()}}
    config = SmolVLAConfig(
        vlm_model_name=str(vlm_path), load_vlm_weights=False, pad_language_to='max_length',
        input_features=features, device='cpu',
        output_features={'action': PolicyFeature(FeatureType.ACTION, (act,))},
        **{**z['policy'], **options})
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return SmolVLAPolicy(config).eval()


def statistics(seed=0, size='demo', dims=None):
    '''Dataset statistics (mean/std) for the state and the action, as a LeRobot dataset has
    (dims: (state, action), default the size's).'''
    gen = torch.Generator().manual_seed(seed)
    return {key: {'mean': torch.randn(n, generator=gen),
                  'std': torch.rand(n, generator=gen) + 0.5}
            for key, n in zip(('observation.state', 'action'), dims or SIZES[size]['dims'])}


def checkpoint(vlm_path, folder, seed=0, size='demo', **options):
    '''A LeRobot checkpoint folder as training writes it: the policy's config.json and
    model.safetensors, and its pre/post-processor pipelines with their statistics; options
    as smolvla()'s.'''
    from lerobot.policies.smolvla.processor_smolvla import make_smolvla_pre_post_processors
    policy = smolvla(vlm_path, seed, size, **options)
    pre, post = make_smolvla_pre_post_processors(policy.config, statistics(seed, size))
    for part in (policy, pre, post):
        part.save_pretrained(folder)
    return str(folder)


def _cameras_and_state(config_class, policy_class, z, seed, options):
    '''A LeRobot policy that takes cameras and state (ACT, Diffusion Policy) at sizes z:
    random weights from torch.manual_seed(seed), its ResNet backbone without pretrained
    weights, options over its config's fields.'''
    from lerobot.configs.types import FeatureType, PolicyFeature
    state, action = z['dims']
    config = config_class(
        input_features={'observation.state': PolicyFeature(FeatureType.STATE, (state,)),
                        **{k: PolicyFeature(FeatureType.VISUAL, s)
                           for k, s in z['cameras'].items()}},
        output_features={'action': PolicyFeature(FeatureType.ACTION, (action,))},
        pretrained_backbone_weights=None, device='cpu', **{**z['config'], **options})
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return policy_class(config).eval()


def _saved(folder, policy, make_processors, stats, cameras, gen):
    '''The checkpoint folder training writes: the policy, its pre- and post-processor with
    stats and each camera's per-channel mean / std (as a LeRobot dataset has them).'''
    stats = {**stats, **{k: {'mean': torch.rand(3, 1, 1, generator=gen),
                             'std': torch.rand(3, 1, 1, generator=gen) + 0.1} for k in cameras}}
    pre, post = make_processors(policy.config, stats)
    for part in (policy, pre, post):
        part.save_pretrained(folder)
    return str(folder)


def act(seed=0, size='demo', **options):
    '''A lerobot ACTPolicy of ACT_SIZES[size], weights from torch.manual_seed(seed); options
    override ACTConfig fields (temporal_ensemble_coeff=0.01, n_action_steps=1, ...).'''
    from lerobot.policies.act.configuration_act import ACTConfig
    from lerobot.policies.act.modeling_act import ACTPolicy
    return _cameras_and_state(ACTConfig, ACTPolicy, ACT_SIZES[size], seed, options)


def act_checkpoint(folder, seed=0, size='demo', **options):
    '''An ACT checkpoint folder as training writes it, with seeded statistics.'''
    from lerobot.policies.act.processor_act import make_act_pre_post_processors
    return _saved(folder, act(seed, size, **options), make_act_pre_post_processors,
                  statistics(seed, dims=ACT_SIZES[size]['dims']), ACT_SIZES[size]['cameras'],
                  torch.Generator().manual_seed(seed + 1))


def diffusion(seed=0, size='demo', **options):
    '''A lerobot DiffusionPolicy of DIFFUSION_SIZES[size] (its ResNet-18 encoder with group
    norm), weights from torch.manual_seed(seed); options override DiffusionConfig fields
    (noise_scheduler_type='DDIM', ...).'''
    from lerobot.policies.diffusion.configuration_diffusion import DiffusionConfig
    from lerobot.policies.diffusion.modeling_diffusion import DiffusionPolicy
    return _cameras_and_state(DiffusionConfig, DiffusionPolicy, DIFFUSION_SIZES[size], seed,
                              options)


def diffusion_checkpoint(folder, seed=0, size='demo', **options):
    '''A Diffusion Policy checkpoint folder as training writes it, with seeded statistics in
    its config's modes (state and action min / max, the images' mean / std per channel).'''
    from lerobot.policies.diffusion.processor_diffusion import make_diffusion_pre_post_processors
    z, gen = DIFFUSION_SIZES[size], torch.Generator().manual_seed(seed + 1)
    stats = {key: {'min': low, 'max': low + torch.rand(n, generator=gen) + 0.5}
             for key, n in zip(('observation.state', 'action'), z['dims'])
             for low in [torch.randn(n, generator=gen)]}
    return _saved(folder, diffusion(seed, size, **options), make_diffusion_pre_post_processors,
                  stats, z['cameras'], gen)
