"""Real file-system faults and permissions for the tests: a tmpfs mount (to fill, or to remount
read-only) and a subprocess that runs with CAP_DAC_OVERRIDE dropped. Each skips the test with
the reason where the machine refuses (no root, no setpriv)."""
import contextlib
import errno
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


@contextlib.contextmanager
def tmpfs(path, size='64k'):
    """A real tmpfs at `path` (skips with the reason when mounting is refused)."""
    os.makedirs(path, exist_ok=True)
    r = subprocess.run(['mount', '-t', 'tmpfs', '-o', f'size={size},mode=0755', 'tmpfs',
                        str(path)], capture_output=True, text=True)
    if r.returncode:
        pytest.skip(f'cannot mount a tmpfs (needs root / CAP_SYS_ADMIN): {r.stderr.strip()}')
    try:
        yield path
    finally:
        if subprocess.run(['umount', str(path)], capture_output=True).returncode:
            subprocess.run(['umount', '-l', str(path)], capture_output=True)


def remount_read_only(path):
    # A read-only mount, not mode bits: root ignores those.
    r = subprocess.run(['mount', '-o', 'remount,ro', str(path)], capture_output=True, text=True)
    if r.returncode:
        pytest.skip(f'cannot remount {path} read-only: {r.stderr.strip()}')


def fill(path):
    """Fill the file system holding `path` until it reports ENOSPC."""
    with open(os.path.join(path, 'filler'), 'wb', buffering=0) as f:
        try:
            while True:
                f.write(b'\0' * 4096)
        except OSError as e:
            assert e.errno == errno.ENOSPC


def without_dac(code, *args):
    """Run Python `code` in a subprocess that cannot bypass file permissions (root with
    CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH dropped via setpriv). Returns its stdout."""
    cmd = [sys.executable, '-c', f'import sys; sys.path.insert(0, {str(ROOT)!r})\n{code}', *args]
    if os.geteuid() == 0:
        if shutil.which('setpriv') is None:
            pytest.skip('setpriv (util-linux) is missing: cannot drop CAP_DAC_OVERRIDE as root')
        cmd = ['setpriv', '--inh-caps=-all',
               '--bounding-set=-dac_override,-dac_read_search', *cmd]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=120)
    if r.returncode and 'setpriv' in r.stderr:
        pytest.skip(f'setpriv refused to drop capabilities: {r.stderr.strip()}')
    assert r.returncode == 0, r.stderr
    return r.stdout
