"""Style in the spirit of ament_flake8 (99 columns) and ament's single-quote rule."""
import io
import pathlib
import subprocess
import sys
import tokenize

ROOT = pathlib.Path(__file__).resolve().parents[2]
DIRS = ['flashrt_ros', 'test', 'launch', 'benchmarks', 'scripts', 'setup.py']


def _python_files():
    files = []
    for entry in DIRS:
        path = ROOT / entry
        if path.is_file():
            files.append(path)
        elif path.is_dir():
            files += sorted(p for p in path.rglob('*') if p.is_file() and _is_python(p))
    return files


def _is_python(path):
    if path.suffix == '.py':
        return True
    with open(path, 'rb') as f:
        first = f.readline()
    return first.startswith(b'#!') and b'python' in first


def test_flake8_clean():
    files = [str(p) for p in _python_files()]
    assert files
    result = subprocess.run([sys.executable, '-m', 'flake8', '--max-line-length=99', *files],
                            capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0, result.stdout + result.stderr


def test_single_quotes():
    offenders = []
    for path in _python_files():
        tokens = tokenize.generate_tokens(io.StringIO(path.read_text()).readline)
        for tok in tokens:
            if tok.type != tokenize.STRING:
                continue
            body = tok.string.lstrip('rbfuRBFU')
            # Docstrings use triple double quotes; a double-quoted string that holds a single
            # quote is fine (ament's flake8-quotes allows avoiding escapes).
            if body.startswith('"') and not body.startswith('"""') and "'" not in body:
                offenders.append('%s:%d %s' % (path.relative_to(ROOT), tok.start[0], tok.string))
    assert not offenders, '\n'.join(offenders)
