'''What a LeRobot checkpoint folder says about its policy's inputs and outputs, from its
config and pre-processor alone (the policy node's parameters and cameras observation, the
launch's sizes): no model is built; and the model itself, loaded whole or refused
(load_lerobot).'''

import json
from pathlib import Path

import torch

from ..errors import InvalidConfig, InvalidObservation

STATE, TOKENS, MASK = 'observation.state', 'observation.language.tokens', \
    'observation.language.attention_mask'
# LeRobot's normalisations onto [-1, 1] (the quantile ones Pi0.5's default): mode -> the
# statistics that bound it
BOUNDS = {'min_max': ('min', 'max'), 'quantiles': ('q01', 'q99'), 'quantile10': ('q10', 'q90')}


def checkpoint_type(folder):
    '''The policy type a LeRobot checkpoint folder's config.json names ("type": act,
    smolvla, pi05...); InvalidConfig when the folder holds no LeRobot policy config.'''
    path = Path(folder) / 'config.json'
    try:
        config = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise InvalidConfig(f'{folder} is not a LeRobot checkpoint folder: {path}: '
                            f'{exc}') from exc
    kind = config.get('type') if isinstance(config, dict) else None
    if not isinstance(kind, str):
        raise InvalidConfig(f'{path} names no policy "type": not a LeRobot policy config')
    if config.get('use_peft'):
        # LeRobot loads the base policy the adapter's config names (often a hub id) under it
        base = _json(Path(folder) / 'adapter_config.json').get('base_model_name_or_path')
        raise InvalidConfig(f'{folder} is a PEFT adapter (use_peft) on {base or "a base policy"}'
                            ': merge it into its base (peft\'s merge_and_unload, then '
                            'save_pretrained with use_peft false) and load that folder')
    return kind


def load_lerobot(kind, folder):
    '''LeRobot's policy of `kind` from a checkpoint folder (its from_pretrained), every
    weight of the config loaded from model.safetensors, else InvalidConfig. LeRobot's loaders
    are lenient: ACT's, Diffusion's and SmolVLA's log the weights missing from the file and
    keep their random initial values, Pi0's and Pi0.5's print a failed load, or a missing file,
    and return the model unloaded: a robot acting on random weights. Weights the file holds
    beyond the config's are left unused, as LeRobot leaves them.'''
    from lerobot.policies import pretrained
    from lerobot.policies.factory import get_policy_class
    policy_cls = get_policy_class(kind)
    if not (Path(folder) / 'model.safetensors').is_file():
        raise InvalidConfig(f'{folder} holds no model.safetensors (the policy\'s weights)')
    seen, log_keys = {}, pretrained.log_model_loading_keys
    own = policy_cls.__dict__.get('load_state_dict')

    def logged(missing, unexpected):        # what LeRobot's safetensors load found
        seen['lerobot'] = list(missing)
        return log_keys(missing, unexpected)

    def load_state_dict(module, state_dict, strict=True, **kwargs):     # Pi0's and Pi0.5's
        try:                                # (strict or not, the matching weights load)
            result = torch.nn.Module.load_state_dict(module, state_dict, strict=False, **kwargs)
        except RuntimeError as exc:         # a weight of another shape
            seen['failed'] = exc
            raise
        seen.setdefault('torch', []).extend(result.missing_keys)
        return result
    # a refused checkpoint leaves the process as it was: LeRobot's constructor sets the
    # float32 matmul precision when the config asks it to compile
    precision = torch.get_float32_matmul_precision()
    pretrained.log_model_loading_keys, policy_cls.load_state_dict = logged, load_state_dict
    try:
        policy = policy_cls.from_pretrained(folder)
    except RuntimeError as exc:             # (safetensors': a weight of another shape)
        seen['failed'] = exc
    finally:
        torch.set_float32_matmul_precision(precision)
        pretrained.log_model_loading_keys = log_keys
        if own is None:
            del policy_cls.load_state_dict
        else:
            policy_cls.load_state_dict = own
    missing = seen.get('lerobot', seen.get('torch'))
    if 'failed' in seen or missing is None:
        raise InvalidConfig(f'{folder}: LeRobot could not load model.safetensors: '
                            f'{str(seen.get("failed", "no weights loaded")).strip()[:600]}')
    if missing:
        raise InvalidConfig(f'{folder}: model.safetensors lacks {len(missing)} of the weights '
                            'its config describes (LeRobot would leave them at random initial '
                            f'values): {", ".join(missing[:4])}')
    return policy


def _json(path):
    '''The dict a JSON file holds, {} when it holds none or cannot be read.'''
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def observation_size(state_dim, cameras, tokens):
    '''The observation vector's length: the state, each camera's 3 x H x W, and the
    instruction's token ids and mask.'''
    return state_dim + sum(c * h * w for c, h, w in cameras.values()) + 2 * tokens


def robot_cameras(config):
    '''{camera key: (3, H, W)} of a LeRobot policy config, in its order: the cameras a robot
    feeds. Not the placeholders SmolVLA's, Pi0's and Pi0.5's configs add for `empty_cameras`
    (placeholder_cameras): LeRobot fills those itself when the batch lacks them, as a
    robot's does (an image of -1, masked out); an image fed there would be attended to.'''
    placeholders = placeholder_cameras(config)
    return {k: tuple(f.shape) for k, f in config.image_features.items()
            if k not in placeholders}


def state_shape(config):
    '''The shape of a LeRobot config's observation.state (the robot's joints), or
    InvalidConfig for a config without one (an environment state or images alone).'''
    feature = config.input_features.get(STATE)
    if feature is None:
        raise InvalidConfig(f'a {config.type} checkpoint without observation.state (its inputs:'
                            f' {sorted(config.input_features)}): the node feeds the robot\'s '
                            'joint state there')
    return tuple(feature.shape)


def placeholder_cameras(config):
    '''The image keys a config adds for its `empty_cameras` (LeRobot's naming).'''
    return {f'observation.images.empty_camera_{i}'
            for i in range(int(getattr(config, 'empty_cameras', 0) or 0))}


def checkpoint_sizes(folder):
    '''(policy type, obs_dim, act_dim) of a LeRobot checkpoint folder, from its config alone
    (what the policy node's parameters must say).'''
    import lerobot.policies  # noqa: F401 - registers the config classes from_pretrained picks
    from lerobot.configs.policies import PreTrainedConfig
    checkpoint_type(folder)     # (not LeRobot's hub lookup's error)
    config = PreTrainedConfig.from_pretrained(folder)
    cameras = robot_cameras(config)
    tokens = int(getattr(config, 'tokenizer_max_length', 0) or 0)
    state_dim = state_shape(config)[0]
    return (config.type, observation_size(state_dim, cameras, tokens),
            config.output_features['action'].shape[0])


def checkpoint_inputs(folder):
    '''What a LeRobot checkpoint folder's observation holds, for whoever packs it (the
    node's cameras observation): ({camera key: (3, H, W)} in the config's order, the token
    count (0: no instruction), tokenize(text, state=None) -> (token ids, attention mask) as
    float32 arrays, or None). tokenize runs the checkpoint's own pre-processor (its
    tokenizer, SmolVLA's newline, its padding) on the text, so the ids are the ones LeRobot's
    pipeline gives its model. Where the prompt holds the state (tokenize.state_in_prompt:
    Pi0.5's pre-processor writes it there, normalised and discretised), the tokens belong to
    one observation: tokenize then needs that observation's raw state, and refuses to run
    without it.

    LeRobot's tokenizer step cuts a prompt to the checkpoint's tokenizer_max_length. Where
    the prompt holds the state, a cut one loses the state and the "Action:" cue after it:
    tokenize refuses it (InvalidObservation). An instruction alone is only shortened (the
    model reads no more): tokenize.length(text) is its whole count, for a caller's warning.

    A checkpoint that pads the prompt only to its own length (SmolVLA's default
    pad_language_to, 'longest'; tokenize.padded_from says so) gets it padded to
    tokenizer_max_length, the padding masked out: the engine's shapes are static. Its
    actions then agree with LeRobot's within float rounding, not bit for bit (attention
    sums over more, masked, keys).'''
    from lerobot.configs.policies import PreTrainedConfig
    from lerobot.policies.factory import make_pre_post_processors
    from lerobot.policies.pi05.processor_pi05 import Pi05PrepareStateTokenizerProcessorStep
    from lerobot.processor import TokenizerProcessorStep
    checkpoint_type(folder)
    config = PreTrainedConfig.from_pretrained(folder)
    on_cpu = processor_steps(folder)
    pre, _ = make_pre_post_processors(config, folder,
                                      preprocessor_overrides=on_cpu['preprocessor'],
                                      postprocessor_overrides=on_cpu['postprocessor'])
    step = next((s for s in pre.steps if isinstance(s, TokenizerProcessorStep)), None)
    cameras = robot_cameras(config)
    joints = state_shape(config)
    blank = {STATE: torch.zeros(joints),
             **{k: torch.zeros(shape) for k, shape in cameras.items()}}
    tokens = int(getattr(config, 'tokenizer_max_length', 0) or 0)
    # the prompt holds the state where the pre-processor puts it there (Pi0.5's step), as
    # LeRobot's pipeline does, whatever the checkpoint's type
    state_in_prompt = any(isinstance(s, Pi05PrepareStateTokenizerProcessorStep)
                          for s in pre.steps)
    padded_from = None
    if step is not None:
        if step.max_length != tokens:
            raise InvalidConfig(f'{folder}: policy_preprocessor.json tokenizes to '
                                f'{step.max_length} tokens, config.json says {tokens} '
                                '(tokenizer_max_length)')
        if step.padding != 'max_length':
            # SmolVLA's default pad_language_to, longest: LeRobot's prompt is as long as each
            # instruction; the engine's is static, padded (masked) to tokenizer_max_length
            padded_from, step.padding = step.padding, 'max_length'

    def frame_of(text, state):
        frame = {**blank, 'task': text}
        if state_in_prompt:
            if state is None:
                raise ValueError(f'{config.type}: the prompt holds the state; tokenize each '
                                 'observation with its state')
            frame[STATE] = torch.as_tensor(state, dtype=torch.float32).reshape(joints)
        return frame

    def length(text, state=None):
        '''The prompt's whole token count, as LeRobot's tokenizer step counts it, uncut (the
        step's settings put back: callers hold the node's lock).'''
        kept = step.truncation, step.padding
        step.truncation, step.padding = False, 'longest'
        try:
            return int(pre(frame_of(text, state))[MASK].sum())
        finally:
            step.truncation, step.padding = kept

    def tokenize(text, state=None):
        out = pre(frame_of(text, state))
        mask = out[MASK].reshape(-1)
        # every slot used: the prompt may have been cut to fit (counted again only then)
        whole = length(text, state) if state_in_prompt and bool(mask.all()) else tokens
        if whole > tokens:
            raise InvalidObservation(
                f'{config.type}: the prompt with the state is {whole} tokens, the '
                f'checkpoint reads {tokens} (tokenizer_max_length): LeRobot would cut off the '
                'state and the "Action:" cue after the instruction; shorten the instruction')
        return (out[TOKENS].reshape(-1).to(torch.float32).numpy(),
                mask.to(torch.float32).numpy())
    tokenize.state_in_prompt, tokenize.length = state_in_prompt, length
    tokenize.padded_from = padded_from
    return cameras, tokens, tokenize if tokens else None


# The pre/post-processor steps whose effect the engine reproduces (normalisation, the
# tokenizer's ids through checkpoint_inputs) or that change no value (renaming keys that are
# not the model's inputs, batching, moving to a device): any other step would change
# LeRobot's actions and not the engine's.
KNOWN_STEPS = {
    'preprocessor': {'rename_observations_processor', 'to_batch_processor', 'device_processor',
                     'normalizer_processor', 'tokenizer_processor', 'smolvla_new_line_processor',
                     'pi0_new_line_processor', 'pi05_prepare_state_tokenizer_processor_step',
                     'relative_actions_processor'},
    'postprocessor': {'unnormalizer_processor', 'device_processor',
                      'absolute_actions_processor'}}
# LeRobot 0.6's Pi0 and Pi0.5 processors hold these always, doing nothing unless enabled
SWITCHED = {'relative_actions_processor', 'absolute_actions_processor'}


def processor_steps(folder):
    '''Refuses (InvalidConfig) a checkpoint whose policy_preprocessor.json or
    policy_postprocessor.json holds a step the engine does not reproduce (a crop, a resize, a
    delta-action map, a rename of the model's own inputs), or a device step that casts the
    floats (the model would see other inputs than the engine's float32 ones): either way
    LeRobot's actions and the node's would differ without an error. Returns each side's
    from_pretrained overrides that keep its device step on the CPU: a checkpoint trained on a
    GPU names cuda there (LeRobot's scripts override it with the run's device), which a CPU
    machine cannot load; the engine moves what it takes from the processors to its device.'''
    overrides = {}
    try:        # the model's inputs, which the node names its cameras and state by
        inputs = set(json.loads((Path(folder) / 'config.json').read_text())['input_features'])
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as exc:
        raise InvalidConfig(f'{folder}/config.json: no input_features ({exc!r})') from exc
    for side, known in KNOWN_STEPS.items():
        path = Path(folder) / f'policy_{side}.json'
        if not path.is_file():      # LeRobot < 0.4 kept the normalisation in the model
            raise InvalidConfig(f'{folder} has no policy_{side}.json: a checkpoint from '
                                'LeRobot < 0.4? Convert it: python -m lerobot.processor.'
                                'migrate_policy_normalization --pretrained-path <folder>')
        try:
            steps = json.loads(path.read_text())['steps']
        except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as exc:
            raise InvalidConfig(f'{path}: not a LeRobot processor file ({exc!r})') from exc
        overrides[side] = {}
        for step in steps:
            name = step.get('registry_name') or step.get('class')
            if name not in known:
                raise InvalidConfig(f'{path}: step {name!r} is not one the node reproduces '
                                    f'({sorted(known)}): LeRobot would run it on every '
                                    'observation and the node would not')
            config = step.get('config') or {}
            if name in SWITCHED and config.get('enabled', True):
                raise InvalidConfig(f'{path}: step {name!r} is enabled: relative actions are '
                                    'not supported yet')
            renamed = {k: v for k, v in (config.get('rename_map') or {}).items()
                       if k != v and k in inputs}
            if name == 'rename_observations_processor' and renamed:
                raise InvalidConfig(f'{path}: its rename_map {renamed} feeds what arrives as '
                                    'an input of the model into another one; the node names '
                                    'its inputs by the model\'s features: remove those entries')
            if name == 'device_processor':
                dtype = config.get('float_dtype')
                if dtype not in (None, 'float32'):
                    raise InvalidConfig(f'{path}: its device step casts the floats to {dtype}: '
                                        'the node feeds the model float32 inputs (save the '
                                        'processor with float_dtype null)')
                overrides[side] = {'device_processor': {'device': 'cpu'}}
    return overrides


def processor_statistics(folder):
    '''What LeRobot's pipeline of a checkpoint folder normalises with, as it applies it:
    {key: {'mode': ..., 'eps': ..., statistic: values}} from the policy_preprocessor's
    NormalizerProcessorStep for the inputs and the policy_postprocessor's
    UnnormalizerProcessorStep for the actions (files of their own: they may differ). A key's
    mode is the step's norm_map's for its feature type, not config.json's
    normalization_mapping (the steps are what LeRobot runs; a processor saved again may
    differ); identity for a feature no step normalises, as in LeRobot's pipeline.'''
    import lerobot.policies  # noqa: F401 - registers the config classes from_pretrained picks
    from lerobot.configs.policies import PreTrainedConfig
    from lerobot.configs.types import FeatureType, NormalizationMode
    from lerobot.processor import (NormalizerProcessorStep, PolicyProcessorPipeline,
                                   UnnormalizerProcessorStep)
    config = PreTrainedConfig.from_pretrained(folder)
    overrides = processor_steps(folder)
    found = {k: {'mode': 'identity'} for k in (*config.input_features, 'action')}
    for name, kind, actions in (('preprocessor', NormalizerProcessorStep, False),
                                ('postprocessor', UnnormalizerProcessorStep, True)):
        pipeline = PolicyProcessorPipeline.from_pretrained(
            folder, config_filename=f'policy_{name}.json', overrides=overrides[name])
        steps = [s for s in pipeline.steps if isinstance(s, kind)]
        if len(steps) > 1:      # each would normalise again
            raise InvalidConfig(f'{folder}: policy_{name}.json has {len(steps)} '
                                f'{kind.__name__} steps; one is supported')
        for step in steps:
            keys = {'action': FeatureType.ACTION} if actions else {
                k: f.type for k, f in step.features.items() if f.type != FeatureType.ACTION and
                (step.normalize_observation_keys is None or
                 k in step.normalize_observation_keys)}
            for key, ftype in keys.items():
                mode = step.norm_map.get(ftype, NormalizationMode.IDENTITY)
                found[key] = {'mode': mode.value.lower(), 'eps': float(step.eps),
                              **step.stats.get(key, {})}
    return found


def feature_statistics(kind, cfg, key, feature_type, stats):
    '''((mode, eps), float32 statistics) of LeRobot's (Un)NormalizerProcessorStep for feature
    `key`: ('identity', {}), ('mean_std', mean and std) or a bounded mode's bounds. The mode
    and eps the checkpoint's processor step applies where stats carries them
    (processor_statistics), else the config's normalization_mapping's and LeRobot's eps.'''
    from lerobot.configs.types import FeatureType, NormalizationMode
    have = (stats or {}).get(key) or {}
    mode, eps = have.get('mode'), float(have.get('eps', 1e-8))
    if mode is None:
        mode = cfg.normalization_mapping.get(getattr(FeatureType, feature_type),
                                             NormalizationMode.IDENTITY).value.lower()
    if mode == 'identity':
        return (mode, eps), {}
    names = {'mean_std': ('mean', 'std'), **BOUNDS}.get(mode)
    if names is None:
        raise InvalidConfig(f'{kind}: normalisation {mode} of {key!r} is not supported yet')
    if any(n not in have for n in names):
        raise InvalidConfig(f'{kind}: the checkpoint normalises {key!r} ({mode}) and no '
                            f'{"/".join(names)} statistics were given (load the checkpoint '
                            'with from_pretrained, or pass stats=): its actions would be wrong')
    return (mode, eps), {n: torch.as_tensor(have[n], dtype=torch.float32) for n in names}
