"""A small LeRobot Pi0 or Pi0.5 (LeRobot >= 0.6) for tests: LeRobot's own PI0Policy / PI05Policy
modules, built with seeded random weights at reduced depth and width. LeRobot offers only its
two Gemma variants (2B and 300M, about 4 B parameters together: 16 GB and minutes to build on a
CPU) and hard-codes the PaliGemma it wraps, so the sizes are changed where LeRobot reads them:
its get_gemma_config, and the SigLIP config transformers hands it. The projector's 2048 outputs
and the 257,152-token vocabulary stay as LeRobot sets them."""
import contextlib

import torch

STATE_DIM = ACT_DIM = 6
CAMERA = 'observation.images.top'
IMAGE = (3, 224, 224)       # PaliGemma's resolution: no resize inside the model
TOKENS = 12
CHUNK, STEPS = 8, 3         # chunk_size, n_action_steps


@contextlib.contextmanager
def _small_sizes():
    from lerobot.policies.pi0 import modeling_pi0
    from lerobot.policies.pi05 import modeling_pi05
    from transformers import CONFIG_MAPPING
    modules = (modeling_pi0, modeling_pi05)
    real_gemma = [m.get_gemma_config for m in modules]
    real_paligemma = CONFIG_MAPPING['paligemma']

    def gemma(variant):     # the VLM stays 2,048 wide: the projector's width
        return modeling_pi0.GemmaConfig(width=2048 if variant == 'gemma_2b' else 64, depth=2,
                                        mlp_dim=64, num_heads=2, num_kv_heads=1, head_dim=32)

    def paligemma(**kwargs):
        config = real_paligemma(**kwargs)
        vision = config.vision_config
        vision.num_hidden_layers, vision.hidden_size, vision.num_attention_heads = 1, 64, 2
        return config
    for m in modules:
        m.get_gemma_config = gemma
    CONFIG_MAPPING.register('paligemma', paligemma, exist_ok=True)
    try:
        yield
    finally:
        for m, real in zip(modules, real_gemma):
            m.get_gemma_config = real
        CONFIG_MAPPING.register('paligemma', real_paligemma, exist_ok=True)


def pi0(seed=0, kind='pi0', **options):
    """(PI0Policy, or PI05Policy for kind 'pi05', in eval mode on the CPU, its statistics:
    mean / std for Pi0, quantiles for Pi0.5 as their configs ask): random weights from
    torch.manual_seed(seed) (the global generator is left as it was)."""
    from lerobot.configs.types import FeatureType, PolicyFeature
    if kind == 'pi05':
        from lerobot.policies.pi05.configuration_pi05 import PI05Config as Config
        from lerobot.policies.pi05.modeling_pi05 import PI05Policy as Policy
    else:
        from lerobot.policies.pi0.configuration_pi0 import PI0Config as Config
        from lerobot.policies.pi0.modeling_pi0 import PI0Policy as Policy
    config = Config(
        input_features={'observation.state': PolicyFeature(FeatureType.STATE, (STATE_DIM,)),
                        CAMERA: PolicyFeature(FeatureType.VISUAL, IMAGE)},
        output_features={'action': PolicyFeature(FeatureType.ACTION, (ACT_DIM,))},
        chunk_size=CHUNK, n_action_steps=STEPS, tokenizer_max_length=TOKENS, device='cpu',
        **options)
    with torch.random.fork_rng(), _small_sizes():
        torch.manual_seed(seed)
        policy = Policy(config).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    stats = {}
    for key, dim in (('observation.state', STATE_DIM), ('action', ACT_DIM)):
        low, span = torch.randn(dim, generator=gen), torch.rand(dim, generator=gen) + 0.5
        stats[key] = {'q01': low, 'q99': low + span} if kind == 'pi05' else \
            {'mean': low, 'std': span}
    return policy, stats


def frames(count, vocabulary, seed=0):
    """Raw observations as LeRobot's pipeline takes them after its tokenizer: the state, the
    image in [0, 1], token ids and their mask (the last few padding); each a batch of one."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        ids = torch.randint(0, vocabulary, (1, TOKENS), generator=gen)
        mask = torch.ones(1, TOKENS, dtype=torch.bool)
        mask[:, -3:] = False
        out.append({'observation.state': torch.randn(STATE_DIM, generator=gen) * 2,
                    CAMERA: torch.rand(IMAGE, generator=gen),
                    'observation.language.tokens': ids,
                    'observation.language.attention_mask': mask})
    return out


def vector(frame):
    """The engine's observation vector of a frame (float32: ids below 2**24 are exact)."""
    return torch.cat([frame['observation.state'], frame[CAMERA].reshape(-1),
                      frame['observation.language.tokens'].reshape(-1).float(),
                      frame['observation.language.attention_mask'].reshape(-1).float()]).numpy()
