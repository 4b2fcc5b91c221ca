'''`pip install .` (the runtime as a plain library, as README offers it) installs every module
of the package, and every module of flashrt_ros.runtime imports from the installed copy alone,
without rclpy.

The expected modules come from the source tree, so a new subpackage cannot be forgotten by
setup.py without this test failing. pip builds from a copy of the tree: an in-tree build would
write build/lib and an egg-info beside colcon's build folder.
'''
import json
import os
import pathlib
import shutil
import subprocess
import sys
import textwrap

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGE = ROOT / 'flashrt_ros'
# what a source checkout holds besides the package and its setup files; none is installed
_NOT_COPIED = ('.git', '.venv', 'build', 'install', 'log', '__pycache__', '*.pyc')

# runs in the subprocess: rclpy cannot be imported, each runtime module is imported, and
# where each came from is printed
_IMPORT_ALL = textwrap.dedent('''
    import importlib, importlib.abc, json, sys

    class NoRos(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split('.')[0] in ('rclpy', 'rosidl_runtime_py'):
                raise ImportError(f'{name} is blocked: the runtime must not need ROS')
            return None

    sys.meta_path.insert(0, NoRos())
    print(json.dumps({name: importlib.import_module(name).__file__
                      for name in json.loads(sys.argv[1])}))
''')


def _modules(top):
    '''Dotted names of every module (packages included) under the source folder `top`.'''
    names = []
    for path in sorted(top.rglob('*.py')):
        if '__pycache__' in path.parts:
            continue
        parts = path.relative_to(PACKAGE.parent).with_suffix('').parts
        names.append('.'.join(parts[:-1] if parts[-1] == '__init__' else parts))
    return names


@pytest.fixture(scope='module')
def installed(tmp_path_factory):
    '''The folder `pip install --no-deps --target` filled from a copy of this tree.'''
    work = tmp_path_factory.mktemp('pip')
    source, target = work / 'source', work / 'site'
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(*_NOT_COPIED))
    # no index and no build isolation: the venv's pinned setuptools builds it, offline
    done = subprocess.run([sys.executable, '-m', 'pip', 'install', '--no-deps', '--no-index',
                           '--no-build-isolation', '--quiet', '--target', str(target),
                           str(source)], capture_output=True, text=True, cwd=work)
    if done.returncode != 0 and 'No module named pip' in done.stderr:
        pytest.skip(f'{sys.executable} has no pip')
    assert done.returncode == 0, f'pip install failed:\n{done.stdout}{done.stderr}'
    return target


def test_every_source_file_of_the_package_is_installed(installed):
    want = sorted(str(p.relative_to(PACKAGE.parent)) for p in PACKAGE.rglob('*.py')
                  if '__pycache__' not in p.parts)
    got = sorted(str(p.relative_to(installed)) for p in (installed / 'flashrt_ros').rglob('*.py')
                 if '__pycache__' not in p.parts)
    assert 'flashrt_ros/runtime/policies/onnx.py' in want
    missing = sorted(set(want) - set(got))
    assert not missing, f'pip install . leaves out {missing}'


def test_every_runtime_module_imports_from_the_installed_copy_without_ros(installed, tmp_path):
    names = _modules(PACKAGE / 'runtime')
    assert 'flashrt_ros.runtime.policies.scripted' in names
    # only the installed folder on the path, run from elsewhere: the source tree cannot leak in
    env = {**os.environ, 'PYTHONPATH': str(installed), 'PYTHONWARNINGS': 'ignore'}
    done = subprocess.run([sys.executable, '-c', _IMPORT_ALL, json.dumps(names)], env=env,
                          cwd=tmp_path, capture_output=True, text=True)
    assert done.returncode == 0, f'importing the installed runtime failed:\n{done.stderr}'
    files = json.loads(done.stdout.strip().splitlines()[-1])
    assert sorted(files) == sorted(names)
    outside = {name: f for name, f in files.items()
               if installed.resolve() not in pathlib.Path(f).resolve().parents}
    assert not outside, f'imported from outside the installed folder {installed}: {outside}'
