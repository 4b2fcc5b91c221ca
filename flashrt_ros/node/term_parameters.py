'''observation.<term>.<setting> parameters: declared per term at configure (their names come
from observation_terms), read into the term dicts of ObservationLayout, and checked when set
by ObservationLayout itself (runtime/observation.py), the code that configure builds them with.

A setting is checked on its own whenever it is set: in a probe term of the type that uses it
(a phase for period, a raw term for clip, ...), whose other settings cannot fail, so that
whatever observation.py refuses in it is refused at once, naming the parameter. Rules that
span settings (a scale per joint of the term, joints from joint_names, the terms adding up to
obs_dim) are checked at configure: a user changes those parameters one at a time, in any
order. While configured, nothing that configure built may change, so a term setting is
refused; its whole term is checked first, against the configuration in use, so that the reason
says what is wrong with the value rather than only to reconfigure.
'''

import array

from rcl_interfaces.msg import ParameterDescriptor

from flashrt_ros.node.parameter_types import AT_CONFIGURE, declare, value_type
from flashrt_ros.runtime.errors import InvalidConfig
from flashrt_ros.runtime.observation import ObservationLayout, TERM_TYPES

PREFIX = 'observation.'
TERM_SETTINGS = {'type': '', 'scale': [1.0], 'offset': [0.0], 'clip': [0.0], 'joints': [''],
                 'period': 0.0, 'dt': 0.0, 'decimation': 1, 'size': 0, 'history_length': 1}
_TERM_HELP = {'type': f'term type (default: the term name): one of {TERM_TYPES}',
              'scale': 'multiplies (x - offset): one value or one per element (unitree_rl_gym '
                       'numerics: one value is a Python float, a list float32, as there)',
              'offset': 'subtracted before scaling (joint_pos: the default angles if unset)',
              'clip': '[limit] or [low, high] after scaling (before it with isaaclab '
                      'numerics); [0.0] = no clip',
              'joints': "joint_pos/joint_vel: joints in order; [''] = joint_names",
              'period': 'phase: gait period (s)',
              'dt': 'phase: seconds per counter tick (per policy step when decimation is 1)',
              'decimation': 'phase: counter ticks per policy step (the deploy loop counts '
                            'simulation steps: t = ((step + 1) * decimation) * dt)',
              'size': 'raw: number of values',
              'history_length': "the term's last N readings in the policy input, oldest "
                                'first, filled with the first reading after a reset (Isaac '
                                'Lab); 1 = none'}


def split(name):
    '''(term, setting) of an observation.<term>.<setting> parameter name, else None.'''
    head, _, setting = name.rpartition('.')
    if head.startswith(PREFIX) and len(head) > len(PREFIX) and setting in TERM_SETTINGS:
        return head[len(PREFIX):], setting
    return None


def _plain(value):
    return list(value) if isinstance(value, (list, tuple, array.array)) else value


def _spec_value(setting, value):
    '''A setting as ObservationLayout takes it; None when it holds its default (unset: the
    term's own default applies).'''
    value = _plain(value)
    return None if value == TERM_SETTINGS[setting] else value


def _spec(node, term, changes):
    spec = {'name': term}
    for setting, default in TERM_SETTINGS.items():
        full = f'{PREFIX}{term}.{setting}'
        if full in changes:
            value = changes[full]
        elif node.has_parameter(full):
            value = node.get_parameter(full).value
        else:
            value = default
        value = _spec_value(setting, value)
        if value is not None:
            spec[setting] = value
    return spec


def term_specs(node, names):
    '''observation.<name>.<setting> parameters -> term dicts for ObservationLayout. Declared
    here on first use, typed, with their help (so `ros2 param describe` and `dump` show
    them).'''
    for name in names:
        for setting, default in TERM_SETTINGS.items():
            full = f'{PREFIX}{name}.{setting}'
            if not node.has_parameter(full):
                declare(node, full, value_type(default), default, ParameterDescriptor(
                    description=_TERM_HELP[setting], additional_constraints=AT_CONFIGURE))
    return [_spec(node, name, {}) for name in names]


def _probe(term, setting, value):
    '''ObservationLayout's checks of one setting: a term of the type that uses it holding it,
    every other setting one that cannot fail.'''
    joints = ['j']
    spec = {'name': term, 'type': 'raw', 'size': 1, setting: value}
    if setting == 'type' and value == 'phase':
        spec.update(period=1.0, dt=1.0)
    elif setting in ('period', 'dt', 'decimation'):
        spec = dict({'name': term, 'type': 'phase', 'period': 1.0, 'dt': 1.0}, **{setting: value})
    elif setting == 'joints':
        spec = {'name': term, 'type': 'joint_pos', 'joints': value}
        joints = list(dict.fromkeys(value))
    elif setting in ('scale', 'offset'):
        spec['size'] = max(len(value), 1)
    ObservationLayout([spec], joints, [], 1)


def check(node, changes, settings):
    '''Vets term setting changes ({parameter name: value}) against observation.py's rules;
    InvalidConfig names the parameter. `settings`: the configured Settings (settings.py), or
    None: with them, each changed term is checked whole, as the configuration in use would
    build it.'''
    terms = {}
    for full, value in changes.items():
        term, setting = split(full)
        terms.setdefault(term, []).append(full)
        value = _spec_value(setting, value)
        if value is not None:
            try:
                _probe(term, setting, value)
            except (InvalidConfig, TypeError, ValueError) as exc:
                raise InvalidConfig(f'parameter {full!r} = {value!r}: {exc}') from None
    if settings is None or not settings.terms:
        return
    cfg = settings.node
    for term in set(terms) & set(cfg.observation_terms):
        try:
            ObservationLayout([_spec(node, term, changes)], cfg.joint_names,
                              cfg.default_angles, settings.policy.act_dim,
                              cfg.observation_numerics)
        except (InvalidConfig, TypeError, ValueError) as exc:
            shown = ', '.join(f'{n!r} = {_plain(changes[n])!r}' for n in terms[term])
            raise InvalidConfig(f'parameter {shown}: {exc}') from None
