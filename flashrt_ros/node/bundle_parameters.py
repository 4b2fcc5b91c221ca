'''policy_bundle at configure: the values a policy bundle derives (runtime/bundles.py) become
the node's parameters, so `ros2 param get/dump` shows what runs, except those the user set
(in a parameters file, on the command line or with `ros2 param set`), which the log names.'''

from rclpy.parameter import Parameter

from flashrt_ros.node import term_parameters
from flashrt_ros.runtime.bundles import load_bundle
from flashrt_ros.runtime.errors import InvalidConfig


def _shown(value):
    text = repr(value)
    return text if len(text) <= 70 else text[:67] + '...'


def apply_bundle(node, handler):
    '''Sets the parameters the node's policy_bundle derives; returns the Bundle (None without
    one). InvalidConfig names a field the bundle lacks or a value the node refuses.'''
    path = node.get_parameter('policy_bundle').value
    if not path:
        return None
    bundle = load_bundle(path, node.get_parameter('robot_joint_names').value)
    user = handler.user_set | set(getattr(node, '_parameter_overrides', {}))
    terms = node.get_parameter('observation_terms').value if 'observation_terms' in user \
        else bundle.values['observation_terms']
    term_parameters.term_specs(node, terms)     # declared, so that they can be set
    rows, changes = [], []
    for name, value in bundle.values.items():
        if name in user:
            rows.append(f'  {name} = {_shown(node.get_parameter(name).value)}   (parameter '
                        f'{name} overrides the bundle\'s {_shown(value)})')
            continue
        changes.append(Parameter(name, value=value))
        rows.append(f'  {name} = {_shown(value)}')
    handler.applying = True
    try:
        results = node.set_parameters(changes)
    finally:
        handler.applying = False
    for parameter, result in zip(changes, results):
        if not result.successful:
            raise InvalidConfig(f'policy bundle {bundle.deploy_file}: {parameter.name} = '
                                f'{_shown(parameter.value)} refused: {result.reason}')
    robot = bundle.robot
    notes = [f'  note: {n}' for n in bundle.notes]
    gains = [f'  for the controllers (joint_names order): kps {robot["kps"]}, kds '
             f'{robot["kds"]}']
    node.get_logger().info(
        f'policy bundle ({bundle.format}) {bundle.deploy_file}:\n' + '\n'.join(
            rows + gains + notes))
    return bundle
