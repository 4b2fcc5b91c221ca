"""What a step takes, validated on its way in: observations (on the host, or already on the
device), step tags and a fleet tick's active flags. Each refusal is InvalidObservation, raised
before anything of the state is touched.
"""

import numpy as np
import torch

from .errors import InvalidObservation


def as_observations(obs, obs_dim, rows=None, finite=True):
    """obs as a float32 ndarray [obs_dim] (or [rows, obs_dim]), validated on the host before
    anything of the state is touched (InvalidObservation). finite=False leaves out the check
    for NaN / Inf (check_finite), for a caller that runs it while the copy is in flight.

    numpy, not torch, on this per-step path: its small-array calls cost about a microsecond
    where a torch CPU op costs several.
    """
    try:
        if torch.is_tensor(obs):
            obs = obs.detach().cpu()
        a = np.asarray(obs, dtype=np.float32)
    except (TypeError, ValueError, RuntimeError) as e:
        raise InvalidObservation(f'observation is not numeric: {e}') from e
    want = (obs_dim,) if rows is None else (rows, obs_dim)
    if a.shape != want:
        raise InvalidObservation(
            f'observation has shape {a.shape}, expected {want} (obs_dim {obs_dim})')
    return check_finite(a) if finite else a


def checked_row(obs, obs_dim, policy):
    """One session's observation [obs_dim] as as_observations takes it, and as the policy
    takes it (check_observation: a language policy's token ids), or InvalidObservation: a
    fleet's node refuses that row alone, not the tick of every session."""
    a = as_observations(obs, obs_dim)
    getattr(policy, 'check_observation', id)(a)
    return a


def check_finite(a):
    """a (an ndarray), or InvalidObservation naming its first NaN / Inf."""
    if not np.isfinite(a).all():
        idx = np.argwhere(~np.isfinite(a))[0].tolist()
        raise InvalidObservation(f'observation holds NaN or Inf (first at index {idx})')
    return a


def as_device_observations(obs, obs_dim, rows):
    """obs, a tensor already on the engine's device (a GPU-resident farm's observations),
    as float32 [rows, obs_dim], validated there before anything of the state is touched:
    one reduction and one wait, instead of a copy through the host."""
    if obs.is_complex() or obs.dtype == torch.bool:
        raise InvalidObservation(f'observation is not real numbers: {obs.dtype}')
    if tuple(obs.shape) != (rows, obs_dim):
        raise InvalidObservation(f'observation has shape {tuple(obs.shape)}, expected '
                                 f'{(rows, obs_dim)} (obs_dim {obs_dim})')
    a = obs.detach().to(torch.float32)
    if a.device.type == 'cpu':     # a CPU engine's: numpy's pass, several times torch's there
        check_finite(a.numpy())     # (2.8 M floats of three VGA cameras: 40 % of a CPU tick)
    elif not bool(torch.isfinite(a).all()):
        idx = torch.nonzero(~torch.isfinite(a))[0].tolist()
        raise InvalidObservation(f'observation holds NaN or Inf (first at index {idx})')
    return a


def as_tag(tag):
    """A step tag (an int in [1, 2**63)) or 0 for None; InvalidObservation otherwise."""
    if tag is not None and not (isinstance(tag, int) and not isinstance(tag, bool)
                                and 0 < tag < 1 << 63):
        raise InvalidObservation(f'step tag must be an int in [1, 2**63), got {tag!r}')
    return tag or 0


def tick_control(sessions, active, tags):
    """step_all's active flags and tags as (which: the sessions that step, a slice of all or
    an index array; their tags: int64, or None when untagged); InvalidObservation when either
    is malformed. The usual tick (every session, untagged) builds no array."""
    if tags is not None:
        tags = np.array([as_tag(t) for t in tags], dtype=np.int64)
    mask = None if active is None else np.asarray(active, dtype=bool)
    if (tags is not None and tags.shape != (sessions,)) or (
            mask is not None and mask.shape != (sessions,)):
        raise InvalidObservation(f'step_all needs {sessions} tags and {sessions} active flags, '
                                 f'got {None if tags is None else tags.shape[0]} and '
                                 f'{None if mask is None else mask.shape}')
    which = slice(None) if mask is None or mask.all() else np.flatnonzero(mask)
    return which, None if tags is None else tags[which]
