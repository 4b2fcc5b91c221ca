"""The package's layout holds: one layer per folder, no import circle, no oversized module.

Read from the source with ast (nothing is imported), so this runs anywhere. The rules are the
README's Layout section: the runtime imports no ROS and no other layer; node, sim and harness
build on the runtime and the shared modules; the harness may drive the simulated worlds;
nothing but the node's executable imports the node.
"""
import ast
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / 'flashrt_ros'
ROS_MODULES = ('rclpy', 'rcl_interfaces', 'std_msgs', 'sensor_msgs', 'geometry_msgs',
               'diagnostic_msgs', 'lifecycle_msgs', 'trajectory_msgs', 'std_srvs',
               'builtin_interfaces', 'simulation_interfaces')
MAX_LINES = 360     # "about 350"


def _module_name(path):
    parts = path.relative_to(PACKAGE.parent).with_suffix('').parts
    return '.'.join(parts[:-1] if parts[-1] == '__init__' else parts)


def _imports(path):
    """Absolute names of the modules `path` imports (relative imports resolved)."""
    tree = ast.parse(path.read_text(), str(path))
    package = _module_name(path).split('.')
    if path.name != '__init__.py':
        package = package[:-1]
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            module = '.'.join(base + ([node.module] if node.module else []))
            names.append(module)
            # `from flashrt_ros import msg` names a module too
            names += [f'{module}.{a.name}' for a in node.names]
    return names


def _graph():
    modules = {_module_name(p): p for p in PACKAGE.rglob('*.py')}
    graph = {}
    for name, path in modules.items():
        graph[name] = {i for i in _imports(path) if i in modules and i != name}
    return modules, graph


def _layer(module):
    parts = module.split('.')
    return parts[1] if len(parts) > 2 and parts[1] in ('runtime', 'node', 'sim', 'harness') \
        else 'shared'


def test_no_import_circle():
    _, graph = _graph()
    state, cycles = {}, []

    def visit(name, stack):
        state[name] = 'open'
        for dep in sorted(graph[name]):
            if state.get(dep) == 'open':
                cycles.append(stack[stack.index(dep):] + [dep])
            elif dep not in state:
                visit(dep, stack + [dep])
        state[name] = 'done'
    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    assert not cycles, cycles


def test_each_folder_is_one_layer():
    modules, graph = _graph()
    allowed = {'runtime': {'runtime'}, 'shared': {'shared'},
               'node': {'runtime', 'shared', 'node'}, 'sim': {'runtime', 'shared', 'sim'},
               'harness': {'runtime', 'shared', 'sim', 'harness'}}
    wrong = [(m, d) for m, deps in graph.items() for d in deps
             if _layer(d) not in allowed[_layer(m)]]
    assert not wrong, wrong
    ros = [(m, i) for m, p in modules.items() if _layer(m) == 'runtime'
           for i in _imports(p) if i.split('.')[0] in ROS_MODULES]
    assert not ros, f'the runtime must not need ROS: {ros}'


def test_no_module_is_oversized():
    big = {str(p.relative_to(PACKAGE)): n for p in PACKAGE.rglob('*.py')
           if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not big, f'split these by role (about 350 lines at most): {big}'


def test_the_rules_can_fail():
    """The checks see real imports: the node imports the runtime, and the graph has edges."""
    _, graph = _graph()
    assert 'flashrt_ros.runtime.engine' in graph['flashrt_ros.node.settings']
    assert _layer('flashrt_ros.node.settings') == 'node'
    assert _layer('flashrt_ros.client') == 'shared'
