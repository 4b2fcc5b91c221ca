'''Typed configuration: one dataclass per policy kind, validated in one place.

Each field carries its description and range in `metadata`, so the ROS layer declares its
parameters from these fields (`ros2 param describe` then tells a user what is allowed) and a
script or test builds the same configuration without ROS. A field's annotation is its type,
lists with their element type (list[int]): the ROS layer declares each parameter with it, as
an empty default could not say. The registry from kind to (policy class, config class) lives
in `policies/__init__.py`.
'''

from dataclasses import dataclass, field, fields
import math

from .errors import InvalidConfig


def param(default, description, low=None, high=None, choices=None, **extra):
    '''A config field with what a user needs to know about it.'''
    meta = {'description': description, 'low': low, 'high': high, 'choices': choices, **extra}
    if isinstance(default, (list, tuple)):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)


def check_fields(config):
    '''Ranges and choices from each field's metadata; InvalidConfig names the field.'''
    for f in fields(config):
        check_field(f, getattr(config, f.name))


def check_field(f, value):
    '''One field's range and choices (each element's, for a list): what a ROS node checks
    when a single parameter is set, and check_fields when a whole config is built.'''
    meta = f.metadata
    if meta.get('choices') is not None and value not in meta['choices']:
        raise InvalidConfig(f'parameter {f.name!r} = {value!r}: must be one of '
                            f'{list(meta["choices"])}')
    values = value if isinstance(value, (list, tuple)) else [value]
    for v in values:
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            if isinstance(v, float) and not math.isfinite(v):
                raise InvalidConfig(f'parameter {f.name!r} = {value!r}: must be finite')
            if meta.get('low') is not None and v < meta['low']:
                raise InvalidConfig(f'parameter {f.name!r} = {value!r}: must be >= '
                                    f'{meta["low"]}')
            if meta.get('high') is not None and v > meta['high']:
                raise InvalidConfig(f'parameter {f.name!r} = {value!r}: must be <= '
                                    f'{meta["high"]}')


@dataclass
class PolicyConfig:
    '''What every policy kind takes.'''

    obs_dim: int = param(48, 'observation size the node receives (one frame when '
                         'obs_history > 1)', low=1)
    act_dim: int = param(12, 'action size the policy emits', low=1)
    policy_file: str = param('', 'policy file: TorchScript export (policy.pt, motion.pt), '
                             "rsl_rl checkpoint, state_dict .pt/.safetensors, ONNX; '' = a "
                             'seeded demo policy')
    activation: str = param('', 'hidden-layer activation (elu, tanh, relu, ...). Required for '
                            'checkpoints and state_dicts, which do not record it; checked '
                            "against TorchScript files; '' = from the file (elu for the demo)")
    seed: int = param(0, 'seed of the demo weights and of the sampling noise counters', low=0)
    noise_std: float = param(0.0, 'std of Gaussian action noise (0: deterministic); drawn '
                             'from counters in the arena, reproduced exactly after restore',
                             low=0.0)
    obs_history: int = param(1, 'observations stacked into one policy input (1: none); the '
                             'window is state, kept in capsules', low=1, high=1024)
    history_order: str = param('oldest_first', 'order of the stacked observations',
                               choices=('oldest_first', 'newest_first'))

    def __post_init__(self):
        check_fields(self)

    def options(self):
        '''Keyword arguments of the policy class (the fields a subclass adds).'''
        common = {f.name for f in fields(PolicyConfig)}
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name not in common}


@dataclass
class MLPConfig(PolicyConfig):
    '''Feed-forward actor. The sizes shape the demo only: files state their own.'''

    actor_hidden_dims: list[int] = param([256, 128, 64], 'demo actor hidden sizes', low=1)


@dataclass
class RecurrentConfig(PolicyConfig):
    '''LSTM/GRU actor. The sizes shape the demo only: files state their own.'''

    rnn_type: str = param('lstm', 'demo recurrent cell', choices=('lstm', 'gru'))
    rnn_hidden_dim: int = param(256, 'demo recurrent hidden size', low=1)
    actor_hidden_dims: list[int] = param([256, 128, 64], 'demo actor hidden sizes', low=1)


@dataclass
class HistoryConfig(PolicyConfig):
    '''Hybrid history model (KV cache + recurrence + action chunks).'''

    history_capacity: int = param(2048, 'positions (observations) an episode may hold',
                                  low=1)
    d_model: int = param(256, 'model width', low=1)
    n_layers: int = param(4, 'layers (attention and recurrence alternate)', low=2)
    heads: int = param(4, 'attention heads (d_model % heads == 0)', low=1)
    chunk: int = param(8, 'actions per action chunk', low=1)

    def options(self):
        o = super().options()
        o['capacity'] = o.pop('history_capacity')
        return o


# LeRobot's RTCAttentionSchedule values, lower-case (policies/lerobot_rtc.py)
RTC_SCHEDULES = ('zeros', 'ones', 'linear', 'exp')


@dataclass
class LeRobotConfig(PolicyConfig):
    '''A LeRobot checkpoint folder (policy_file; policies/lerobot_chunk.py): obs_dim and act_dim
    must be the checkpoint's (state, each camera's 3 x H x W, for a language policy the
    instruction's token ids and mask; its action size).'''


@dataclass
class ACTConfig(LeRobotConfig):
    '''A LeRobot ACT checkpoint folder (policy_file): obs_dim the state and each camera's
    3 x H x W (no instruction), act_dim its action size.'''


@dataclass
class DiffusionConfig(ACTConfig):
    '''A LeRobot Diffusion Policy checkpoint folder (policy_file): obs_dim and act_dim as
    ACT's (one observation; the policy keeps its own history).'''


@dataclass
class FlowMatchingConfig(LeRobotConfig):
    '''What the flow-matching VLAs' checkpoint folders (SmolVLA, Pi0, Pi0.5) share: obs_dim
    and act_dim must be the checkpoint's (state, each camera's 3 x H x W, the instruction's
    token ids and mask; its action size). rtc_*: real-time chunking (policies/lerobot_rtc.py).'''

    rtc_delay: int = param(
        -1, 'real-time chunking: the steps a chunk\'s computation is given (LeRobot\'s '
        'inference_delay, fixed): the next chunk is computed while the queue plays and '
        'replaces it this many steps later. -1: off (a chunk when the queue runs empty)',
        low=-1)
    rtc_queue_threshold: int = param(
        0, 'real-time chunking: the actions left in the queue when the next chunk is '
        'launched (LeRobot\'s action_queue_size_to_get_new_actions); rtc_delay <= it < '
        'chunk_size - rtc_delay', low=0)
    rtc_execution_horizon: int = param(
        10, 'real-time chunking: the actions of the old chunk the new one is guided toward '
        '(RTCConfig.execution_horizon)', low=1)
    rtc_schedule: str = param('linear', 'real-time chunking: the guidance weights over the '
                              'horizon (RTCConfig.prefix_attention_schedule)',
                              choices=RTC_SCHEDULES)
    rtc_max_guidance_weight: float = param(
        10.0, 'real-time chunking: the guidance weight\'s clamp (RTCConfig.max_guidance_weight)',
        low=1e-9)
    denoise_kernels: str = param(
        'lerobot', "smolvla, pi0, pi05: the denoising steps' kernels. lerobot: LeRobot's "
        "(its actions bit for bit); compiled: torch.compile's fused kernels in its "
        "deterministic mode, a faster chunk whose actions are off LeRobot's by rounding "
        '(the README measures how far), the first chunk compiling for about a minute; '
        "fused (smolvla, pi05): the action expert's step of our own (what depends on the "
        'time or the prefix alone computed once, attention over a static cache, merged '
        'projections), compiled alike, faster again, off LeRobot\'s by rounding',
        choices=('lerobot', 'compiled', 'fused'))
    prefix_kernels: str = param(
        'lerobot', "smolvla, pi0, pi05: the prefix pass's kernels (the VLM over the cameras "
        "and the instruction, the vision tower), as denoise_kernels: lerobot (LeRobot's) "
        "or compiled (faster; the kept prefix and the actions off LeRobot's by rounding)",
        choices=('lerobot', 'compiled'))


@dataclass
class SmolVLAConfig(FlowMatchingConfig):
    '''A LeRobot SmolVLA checkpoint folder (policy_file; policies/lerobot_chunk.py).'''

    expert_dtype: str = param(
        'float32', "smolvla: the action expert's dtype. float32: LeRobot's (its actions bit "
        'for bit); bfloat16: faster denoising steps (tensor cores), actions off LeRobot\'s '
        'by rounding (the README measures how far)', choices=('float32', 'bfloat16'))


@dataclass
class Pi0Config(FlowMatchingConfig):
    '''A LeRobot (>= 0.6) Pi0 checkpoint folder (policy_file): obs_dim and act_dim as
    SmolVLA's.'''

    vision_dtype: str = param(
        'float32', "pi0, pi05: the SigLIP vision tower's and projector's dtype. float32: "
        "LeRobot's (its actions bit for bit); bfloat16 (a bfloat16 checkpoint): a faster "
        "prefix pass, actions off LeRobot's by rounding (the README measures how far)",
        choices=('float32', 'bfloat16'))


@dataclass
class Pi05Config(Pi0Config):
    '''A LeRobot (>= 0.6) Pi0.5 checkpoint folder (policy_file): as Pi0's; the instruction's
    tokens hold the state too (runtime/policies/lerobot_pi0.py).'''
