'''What a LeRobot checkpoint folder says about its policy's inputs and outputs, from its
config and pre-processor alone (the policy node's parameters, the launch's sizes, the camera
and instruction bridge): no model is built.'''

import torch

STATE, TOKENS, MASK = 'observation.state', 'observation.language.tokens', \
    'observation.language.attention_mask'


def observation_size(state_dim, cameras, tokens):
    '''The observation vector's length: the state, each camera's 3 x H x W, and the
    instruction's token ids and mask.'''
    return state_dim + sum(c * h * w for c, h, w in cameras.values()) + 2 * tokens


def checkpoint_sizes(folder):
    '''(policy type, obs_dim, act_dim) of a LeRobot checkpoint folder, from its config alone
    (what the policy node's parameters must say).'''
    import lerobot.policies  # noqa: F401 - registers the config classes from_pretrained picks
    from lerobot.configs.policies import PreTrainedConfig
    config = PreTrainedConfig.from_pretrained(folder)
    cameras = {k: tuple(f.shape) for k, f in config.image_features.items()}
    tokens = int(getattr(config, 'tokenizer_max_length', 0) or 0)
    state_dim = config.input_features[STATE].shape[0]
    return (config.type, observation_size(state_dim, cameras, tokens),
            config.output_features['action'].shape[0])


def checkpoint_inputs(folder):
    '''What a LeRobot checkpoint folder's observation holds, for whoever packs it (the
    vla_inputs node): ({camera key: (3, H, W)} in the config's order, the token count (0: no
    instruction), tokenize(text) -> (token ids, attention mask) as float32 arrays, or None).
    tokenize runs the checkpoint's own pre-processor (its tokenizer, SmolVLA's newline, its
    padding) on the text, so the ids are the ones LeRobot's pipeline gives its model.'''
    from lerobot.configs.policies import PreTrainedConfig
    from lerobot.policies.factory import make_pre_post_processors
    config = PreTrainedConfig.from_pretrained(folder)
    pre, _ = make_pre_post_processors(config, folder)
    cameras = {k: tuple(f.shape) for k, f in config.image_features.items()}
    blank = {STATE: torch.zeros(config.input_features[STATE].shape),
             **{k: torch.zeros(shape) for k, shape in cameras.items()}}
    tokens = int(getattr(config, 'tokenizer_max_length', 0) or 0)

    def tokenize(text):
        out = pre({**blank, 'task': text})
        return (out[TOKENS].reshape(-1).to(torch.float32).numpy(),
                out[MASK].reshape(-1).to(torch.float32).numpy())
    # Pi0.5's pre-processor writes the (discretised) state into the prompt: its tokens are
    # those of one observation, not of the instruction alone
    tokenize.state_in_prompt = config.type == 'pi05'
    return cameras, tokens, tokenize if tokens else None
