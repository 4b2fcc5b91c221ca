"""The runtime's closed sets of names: policy kinds, storage tiers, buffer growth.

Each member IS its string (a str subclass): it compares and hashes equal to it, and prints,
formats and reprs as it, because ROS messages, parameters, manifests and capsule files carry
the plain strings and every message a person reads names them as strings. Python 3.10 has
no enum.StrEnum, and 3.11's would still repr as <Tier.DEVICE: 'device'>.
"""

import enum


class _StringEnum(str, enum.Enum):
    __str__ = str.__str__
    __format__ = str.__format__
    __repr__ = str.__repr__


class PolicyKind(_StringEnum):
    """What a policy computes with, besides its weights (policies.KINDS maps each to its
    class and typed config)."""

    MLP = 'mlp'                 # feed-forward: no state but the noise counters
    RECURRENT = 'recurrent'     # LSTM/GRU state (or a file's own state buffers)
    HISTORY = 'history'         # the hybrid history model: KV cache, recurrence, chunks
    SMOLVLA = 'smolvla'         # a LeRobot SmolVLA checkpoint: prefix KV cache, action chunk
    ACT = 'act'                 # a LeRobot ACT checkpoint: action chunk
    DIFFUSION = 'diffusion'     # a LeRobot Diffusion Policy checkpoint: history, chunk, rng
    PI0 = 'pi0'                 # a LeRobot (>= 0.6) Pi0 checkpoint: action chunk, rng
    PI05 = 'pi05'               # a LeRobot (>= 0.6) Pi0.5 checkpoint: action chunk, rng


class Tier(_StringEnum):
    """Where a capsule's bytes are kept, and the budget they count against (capsule.py)."""

    DEVICE = 'device'
    HOST = 'host'               # pinned host memory on CUDA
    DISK = 'disk'               # a spill file in the capsule directory


class Growth(_StringEnum):
    """How a state buffer grows with the episode (state.py)."""

    STATIC = 'static'           # fixed size: the static block, copied whole
    APPEND = 'append'           # one row per position: the live prefix grows with position
