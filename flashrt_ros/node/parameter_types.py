'''Parameter types on the wire: each parameter declared with the type its field means, and
values read as that type whatever representation of it they came in.

rclpy types a parameter from its default value, and an empty list reads as a byte array: list
parameters with an empty default described themselves as `byte array` and refused what `ros2
param set` sends. Here the type comes from the field (its annotation: float, list[float],
list[str], ...), empty default or not, and a value that is another representation of that
type is converted before rclpy checks it:

- the parameter services hand arrays over as array.array (tuples and lists are taken too);
- `ros2 param set` and `ros2 param load` parse `[]` as a bool array, `[0, 1]` as an integer
  array and `[0, 0.5]` (mixed) as a string; a double parameter set to `50` comes as an int.

Anything else keeps its type and rclpy refuses it, naming the expected one.
'''

import array
import math
import typing

from rcl_interfaces.msg import FloatingPointRange, IntegerRange, ParameterDescriptor, ParameterType
from rclpy.exceptions import InvalidParameterTypeException, InvalidParameterValueException
from rclpy.parameter import Parameter
import yaml

SCALARS = {bool: ParameterType.PARAMETER_BOOL, int: ParameterType.PARAMETER_INTEGER,
           float: ParameterType.PARAMETER_DOUBLE, str: ParameterType.PARAMETER_STRING}
ARRAYS = {bool: ParameterType.PARAMETER_BOOL_ARRAY, int: ParameterType.PARAMETER_INTEGER_ARRAY,
          float: ParameterType.PARAMETER_DOUBLE_ARRAY,
          str: ParameterType.PARAMETER_STRING_ARRAY}
_SCALAR_OF = {kind: python for python, kind in SCALARS.items()}
_ITEM_OF = {kind: python for python, kind in ARRAYS.items()}
WHAT = {ParameterType.PARAMETER_BOOL: 'a bool', ParameterType.PARAMETER_INTEGER: 'an integer',
        ParameterType.PARAMETER_DOUBLE: 'a number', ParameterType.PARAMETER_STRING: 'a string',
        ParameterType.PARAMETER_BOOL_ARRAY: 'a list of booleans',
        ParameterType.PARAMETER_INTEGER_ARRAY: 'a list of integers',
        ParameterType.PARAMETER_DOUBLE_ARRAY: 'a list of numbers',
        ParameterType.PARAMETER_STRING_ARRAY: 'a list of strings'}
# what a descriptor says of every parameter that is not live
AT_CONFIGURE = 'changes take effect at the next configure (cleanup, set, configure)'


def wire_type(annotation):
    '''The ParameterType of a field annotated bool, int, float, str or list[one of them].'''
    if typing.get_origin(annotation) is list:
        return ARRAYS[typing.get_args(annotation)[0]]
    return SCALARS[annotation]


def value_type(value):
    '''The wire type a default value means: a list's from its first element.'''
    if isinstance(value, (list, tuple)):
        return ARRAYS[type(value[0])]
    return SCALARS[type(value)]


def _is(python, value):
    # bool is an int to Python, never to a parameter; an int is a float's value
    if python is bool or isinstance(value, bool):
        return python is bool and isinstance(value, bool)
    return isinstance(value, (int, float) if python is float else python)


def as_type(kind, value):
    '''`value` as a plain Python value of wire type `kind` (a list for an array), or None
    when it is not one.'''
    if kind in _SCALAR_OF:
        python = _SCALAR_OF[kind]
        if not _is(python, value):
            return None
        return float(value) if python is float else value
    item = _ITEM_OF.get(kind)
    if item in (int, float) and isinstance(value, str):
        try:        # ros2 param set sends a list mixing 0 and 0.5 as its text
            value = yaml.safe_load(value)
        except yaml.YAMLError:
            return None
    if item is None or not isinstance(value, (list, tuple, array.array)) or \
            not all(_is(item, v) for v in value):
        return None
    return [float(v) for v in value] if item is float else list(value)


def typed(name, kind, value):
    '''Parameter `name` holding `value` as wire type `kind`, or None when it is not one.'''
    value = as_type(kind, value)
    return None if value is None else Parameter(name, Parameter.Type(kind), value)


def coerce(node, parameters):
    '''A pre-set-parameters callback's work: each of `parameters` the node declared with a
    type, holding another representation of that type, converted to it.'''
    converted = []
    for p in parameters:
        if node.has_parameter(p.name) and p.type_ != Parameter.Type.NOT_SET:
            kind = node.describe_parameter(p.name).type
            if kind != ParameterType.PARAMETER_NOT_SET and p.type_.value != kind:
                p = typed(p.name, kind, p.value) or p
        converted.append(p)
    return converted


def declare(node, name, kind, default, descriptor):
    '''Declares `name` as wire type `kind` holding its override (converted as a set would be)
    or else `default`; returns the Parameter. Raises rclpy's InvalidParameterTypeException or
    InvalidParameterValueException (out of range), naming the parameter.

    Declared by type first, then set: rclpy would type it from the value, and an empty list as
    a byte array. rclpy keeps a node's overrides (-p, params files, parameter_overrides) only
    in Node._parameter_overrides; they are read there so that one needing a conversion is
    converted rather than refused.
    '''
    descriptor.type = kind
    override = getattr(node, '_parameter_overrides', {}).get(name)
    value = override.value if override is not None else default
    parameter = typed(name, kind, value)
    if parameter is None:
        raise InvalidParameterTypeException(override, Parameter.Type(kind).name)
    node.declare_parameter(name, Parameter.Type(kind), descriptor, ignore_override=True)
    result = node.set_parameters([parameter])[0]
    if not result.successful:
        raise InvalidParameterValueException(name, parameter.value, result.reason)
    return node.get_parameter(name)


def descriptor(f):
    '''What `ros2 param describe` says of config field f: its description, type, choices,
    range (in words for arrays) and whether it waits for the next configure.'''
    meta, kind = f.metadata, wire_type(f.type)
    d = ParameterDescriptor(description=meta['description'], type=kind)
    if meta.get('choices'):
        d.additional_constraints = 'one of: ' + ', '.join(map(str, meta['choices']))
    if not meta.get('live'):
        d.additional_constraints = '; '.join(filter(None, [d.additional_constraints,
                                                           AT_CONFIGURE]))
    low, high = meta.get('low'), meta.get('high')
    if low is None and high is None:
        return d
    if kind == ParameterType.PARAMETER_INTEGER:
        d.integer_range = [IntegerRange(from_value=int(low if low is not None else -2**63),
                                        to_value=int(high if high is not None else 2**63 - 1))]
    elif kind == ParameterType.PARAMETER_DOUBLE:
        d.floating_point_range = [FloatingPointRange(
            from_value=float(low if low is not None else -math.inf),
            to_value=float(high if high is not None else math.inf))]
    else:       # rclpy ranges are for scalars: say the elements' bound in words
        bounds = [f'>= {low}'] * (low is not None) + [f'<= {high}'] * (high is not None)
        d.additional_constraints = '; '.join(filter(None, [f'each {" and ".join(bounds)}',
                                                           d.additional_constraints]))
    return d
