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
def small_sizes():
    """Inside: LeRobot builds its Pi0 / Pi0.5 at this module's sizes (from_pretrained of a
    checkpoint() folder too)."""
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
        **{**dict(chunk_size=CHUNK, n_action_steps=STEPS, tokenizer_max_length=TOKENS,
                  device='cpu'), **options})
    with torch.random.fork_rng(), small_sizes():
        torch.manual_seed(seed)
        policy = Policy(config).eval()
        # LeRobot zeroes the AdaRMS norms' condition weights (the time step changes nothing
        # until trained) and Pi0's expert norms' weights (each scales by 1): random ones
        # here, so that each step's conditioning and each norm's scale counts
        for name, weight in policy.named_parameters():
            if name.endswith('norm.dense.weight') or (
                    'gemma_expert' in name and name.endswith('norm.weight')):
                weight.data.normal_(0.0, 0.05)
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


# the prompt Pi0.5's pre-processor writes ('Task: ..., State: 12 200 ...;\nAction: ') in
# byte-level tokens
PROMPT_TOKENS = 96
PALIGEMMA = 'google/paligemma-3b-pt-224'     # the tokenizer LeRobot's processors name


def checkpoint(folder, kind='pi05', seed=0):
    """A checkpoint folder as training writes it: config.json and model.safetensors of
    pi0(seed, kind), and its pre- and post-processor from LeRobot's own factory with the
    statistics. PaliGemma's tokenizer is a gated hub repository: a byte-level stand-in, saved
    in the folder, takes its place (the processor names that folder). Load it (the policy)
    inside small_sizes()."""
    import types

    from lerobot.policies.factory import make_pre_post_processors
    from lerobot.processor import tokenizer_processor, TokenizerProcessorStep
    from transformers import AutoTokenizer

    from flashrt_ros.runtime.policies.lerobot_demo import byte_tokenizer
    policy, stats = pi0(seed, kind, tokenizer_max_length=PROMPT_TOKENS)
    local = f'{folder}/tokenizer'
    byte_tokenizer(['<pad>', '<eos>', '<bos>'], pad_token='<pad>', eos_token='<eos>',
                   bos_token='<bos>').save_pretrained(local)
    real = tokenizer_processor.AutoTokenizer
    tokenizer_processor.AutoTokenizer = types.SimpleNamespace(
        from_pretrained=lambda name: AutoTokenizer.from_pretrained(
            local if name == PALIGEMMA else name))
    try:
        pre, post = make_pre_post_processors(policy.config, dataset_stats=stats)
    finally:
        tokenizer_processor.AutoTokenizer = real
    for step in pre.steps:
        if isinstance(step, TokenizerProcessorStep):
            step.tokenizer_name = local
    for part in (policy, pre, post):
        part.save_pretrained(folder)
    return str(folder)


def raw_frames(count, seed=0):
    """Observations as a robot gives them: the raw state, the image in [0, 1], the task."""
    gen = torch.Generator().manual_seed(seed)
    return [{'observation.state': torch.randn(STATE_DIM, generator=gen) * 2,
             CAMERA: torch.rand(IMAGE, generator=gen),
             'task': ('pick up the red cube', 'open the drawer')[t // 4 % 2]}
            for t in range(count)]
