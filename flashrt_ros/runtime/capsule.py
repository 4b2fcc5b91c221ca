"""Capsules (immutable copies of the live state) and the CapsuleStore that holds them by name.

Bookkeeping (names, tiers, budgets, LRU order, manifests) is plain Python; the only tensor
work is moving a capsule's bytes between tiers and files. Tiers: device -> pinned host -> disk.

Disk format (`<name>.capsule` by default): a safetensors file with one tensor 'state'
(uint8 [nbytes]) and metadata
{'format', 'manifest' (JSON), 'checksum' (sha256 over the manifest fields and the bytes)}.
"""

from dataclasses import asdict, dataclass, replace
import functools
import hashlib
import json
import os
import re
import tempfile
import threading

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .errors import (BudgetExceeded, CapsuleExists, CorruptCapsule, IncompatibleCapsule,
                     InvalidName, PathOutsideDirectory, UnknownCapsule)

FORMAT = 'flashrt-capsule/1'
TIERS = ('device', 'host', 'disk')
SUFFIX = '.capsule'     # save's default file: <capsule_dir>/<name>.capsule
_NAME = re.compile(r'[A-Za-z0-9_.-]{1,128}')
# Fields the checksum covers: tier, pinned and checksum itself are store-local, not content.
_CHECKED_FIELDS = ('name', 'parent', 'step', 'episode', 'position', 'nbytes',
                   'schema_digest', 'model_digest', 'created')


@dataclass
class Manifest:
    name: str
    parent: str
    tier: str                # 'device' | 'host' | 'disk'
    pinned: bool
    step: int
    episode: int
    position: int
    nbytes: int
    schema_digest: str
    model_digest: str
    created: float           # unix seconds
    checksum: str = ''       # '' until written to disk


class Capsule:
    """Immutable live bytes plus a manifest. Nothing ever writes into `data` after creation."""

    def __init__(self, manifest, data=None, path=None):
        self.manifest = manifest
        self.data = data     # uint8 [nbytes] on the device or in host memory; None on disk
        self.path = path     # file when tier == 'disk'


def checksum(manifest, data):
    """sha256 over the content fields of the manifest and the bytes (a CPU uint8 tensor)."""
    h = hashlib.sha256()
    fields = {k: getattr(manifest, k) for k in _CHECKED_FIELDS}
    h.update(json.dumps(fields, sort_keys=True).encode())
    h.update(data.contiguous().numpy().tobytes() if data.numel() else b'')
    return h.hexdigest()


def check_compatible(manifest, schema_digest=None, model_digest=None):
    """Raise IncompatibleCapsule naming which digest differs (first 12 hex chars of both)."""
    if schema_digest is not None and manifest.schema_digest != schema_digest:
        raise IncompatibleCapsule(
            f'capsule {manifest.name!r} was taken with schema digest '
            f'{manifest.schema_digest[:12]} but the running state arena is {schema_digest[:12]} '
            '(different buffers, shapes, dtypes or capacity)')
    if model_digest is not None and manifest.model_digest != model_digest:
        raise IncompatibleCapsule(
            f'capsule {manifest.name!r} was taken with model digest '
            f'{manifest.model_digest[:12]} but the loaded policy is {model_digest[:12]}')


def write_file(path, manifest, data):
    """Write a capsule file atomically: temp file in the same directory, fsync, os.replace.

    Returns the checksum written. A crash leaves either the old file or the new one.
    """
    host = data.detach().to('cpu').contiguous()
    digest = checksum(manifest, host)
    meta = {'format': FORMAT, 'checksum': digest,
            'manifest': json.dumps(asdict(replace(manifest, checksum=digest)), sort_keys=True)}
    folder = os.path.dirname(path)
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix='.tmp-', suffix='.safetensors', dir=folder)
    os.close(fd)
    try:
        save_file({'state': host}, tmp, metadata=meta)
        with open(tmp, 'rb') as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    dfd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(dfd)   # make the rename itself durable
    finally:
        os.close(dfd)
    return digest


def read_file(path):
    """Read and verify a capsule file; returns (Manifest, CPU uint8 tensor). CorruptCapsule."""
    try:
        with safe_open(path, framework='pt') as f:
            meta = f.metadata() or {}
            data = f.get_tensor('state')
    except FileNotFoundError as e:
        raise CorruptCapsule(f'capsule file {path!r} is missing') from e
    except Exception as e:   # safetensors raises several types for truncated/garbled headers
        raise CorruptCapsule(f'capsule file {path!r} is truncated or unreadable: {e}') from e
    if meta.get('format') != FORMAT:
        raise CorruptCapsule(f'capsule file {path!r} is not a {FORMAT} file')
    try:
        manifest = Manifest(**json.loads(meta['manifest']))
    except Exception as e:
        raise CorruptCapsule(f'capsule file {path!r} has an unreadable manifest: {e}') from e
    if data.dtype != torch.uint8 or data.dim() != 1 or data.numel() != manifest.nbytes:
        raise CorruptCapsule(
            f'capsule file {path!r} holds {data.numel()} {data.dtype} values, '
            f'manifest says {manifest.nbytes} bytes')
    actual = checksum(manifest, data)
    if actual != meta.get('checksum') or actual != manifest.checksum:
        raise CorruptCapsule(
            f'capsule file {path!r} failed its checksum: stored {meta.get("checksum", "")[:12]}, '
            f'computed {actual[:12]} (the file was modified or damaged)')
    return manifest, data


def _locked(method):
    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        with self._lock:
            return method(self, *args, **kwargs)
    return wrapper


class CapsuleStore:
    """Capsules by name, with a byte budget per memory tier and LRU demotion.

    Invariants: a capsule is never dropped silently; pinned capsules stay in device or host
    memory; a refused put/load leaves every capsule where it was.
    """

    def __init__(self, device, device_budget, host_budget, directory):
        self.device = torch.device(device)
        self.device_budget = int(device_budget)
        self.host_budget = int(host_budget)
        self.directory = os.path.realpath(directory)
        self._capsules = {}    # name -> Capsule
        self._used = {}        # name -> LRU tick (higher = more recent)
        self._tick = 0
        # Pinned host memory speeds up device<->host copies but needs CUDA.
        self._pin = torch.cuda.is_available()
        # The engine serialises its own calls; this lock covers readers such as a ROS
        # list_capsules callback running on another executor thread.
        self._lock = threading.RLock()

    # -- bookkeeping ---------------------------------------------------------------------------

    @staticmethod
    def validate_name(name):
        """Names are [A-Za-z0-9_.-]{1,128} and not '.' or '..', so they are safe as file names."""
        if not isinstance(name, str) or not _NAME.fullmatch(name) or name in ('.', '..'):
            raise InvalidName(
                f'capsule name {name!r} is not allowed: use 1-128 characters from '
                '[A-Za-z0-9_.-], not "." or ".."')

    def _touch(self, name):
        self._tick += 1
        self._used[name] = self._tick

    def _bytes_in(self, tier, skip=None):
        return sum(c.manifest.nbytes for n, c in self._capsules.items()
                   if c.manifest.tier == tier and n != skip)

    @property
    @_locked
    def device_bytes_used(self):
        return self._bytes_in('device')

    @property
    @_locked
    def host_bytes_used(self):
        return self._bytes_in('host')

    def _budget(self, tier):
        return self.device_budget if tier == 'device' else self.host_budget

    def __contains__(self, name):
        return name in self._capsules

    @_locked
    def get(self, name):
        """The capsule (touches LRU order). UnknownCapsule if absent."""
        self.validate_name(name)
        if name not in self._capsules:
            known = ', '.join(sorted(self._capsules)) or 'none'
            raise UnknownCapsule(f'no capsule named {name!r} (known: {known})')
        self._touch(name)
        return self._capsules[name]

    @_locked
    def list(self):
        """Copies of every manifest, sorted by name."""
        return [replace(self._capsules[n].manifest) for n in sorted(self._capsules)]

    @_locked
    def delete(self, name):
        """Remove a capsule and its spill file (files written by save() are kept)."""
        capsule = self.get(name)
        del self._capsules[name]
        del self._used[name]
        if capsule.manifest.tier == 'disk' and capsule.path and os.path.exists(capsule.path):
            os.unlink(capsule.path)

    # -- placement -----------------------------------------------------------------------------

    def _plan(self, tier, nbytes, skip):
        """Names to demote (in order, lowest tier first) so `nbytes` fit in `tier`.

        Pure bookkeeping: raises BudgetExceeded before anything moves.
        """
        moves = []
        incoming = nbytes
        for level in TIERS[TIERS.index(tier):2]:
            free = self._budget(level) - self._bytes_in(level, skip)
            victims = sorted((n for n, c in self._capsules.items()
                              if c.manifest.tier == level and not c.manifest.pinned
                              and n != skip), key=self._used.get)
            chosen = []
            while free < incoming and victims:
                name = victims.pop(0)
                chosen.append(name)
                free += self._capsules[name].manifest.nbytes
            if free < incoming:
                pinned = sum(c.manifest.nbytes for n, c in self._capsules.items()
                             if c.manifest.tier == level and c.manifest.pinned and n != skip)
                raise BudgetExceeded(
                    f'{level} tier cannot take {incoming} bytes: budget {self._budget(level)}, '
                    f'{pinned} bytes pinned there; raise the {level} budget, unpin or delete '
                    'capsules')
            moves = [(n, level) for n in chosen] + moves
            incoming = sum(self._capsules[n].manifest.nbytes for n in chosen)
            if not chosen:
                break
        return moves

    def _demote(self, name):
        capsule = self._capsules[name]
        m = capsule.manifest
        if m.tier == 'device':
            # Straight into pinned memory when CUDA exists: one copy, and later host->device
            # restores can run asynchronously.
            host = torch.empty(m.nbytes, dtype=torch.uint8, pin_memory=self._pin)
            host.copy_(capsule.data)
            self._capsules[name] = Capsule(replace(m, tier='host'), host)
        else:
            path = os.path.join(self.directory, '.spill', f'{name}.safetensors')
            digest = write_file(path, m, capsule.data)
            self._capsules[name] = Capsule(replace(m, tier='disk', checksum=digest), None, path)

    @_locked
    def put(self, capsule, overwrite=False):
        """Add a capsule in its manifest's tier, demoting LRU unpinned capsules one tier down.

        Refuses (CapsuleExists, BudgetExceeded) leaving the store unchanged. Pinned capsules are
        never demoted; a pinned capsule cannot be put on disk.
        """
        m = capsule.manifest
        self.validate_name(m.name)
        if m.name in self._capsules and not overwrite:
            raise CapsuleExists(f'capsule {m.name!r} exists; pass overwrite to replace it')
        if m.tier not in TIERS or (m.pinned and m.tier == 'disk'):
            raise BudgetExceeded(f'capsule {m.name!r} cannot live in tier {m.tier!r}')
        moves = [] if m.tier == 'disk' else self._plan(m.tier, m.nbytes, skip=m.name)
        for name, _ in moves:
            self._demote(name)
        old = self._capsules.get(m.name)
        if old is not None and old.manifest.tier == 'disk' and old.path != capsule.path:
            os.unlink(old.path)
        self._capsules[m.name] = capsule
        self._touch(m.name)

    @_locked
    def data_on(self, name, device):
        """The capsule's bytes on `device`; read from disk (checksum verified) if needed."""
        capsule = self.get(name)
        if capsule.data is not None:
            return capsule.data.to(device, non_blocking=False)
        manifest, data = read_file(capsule.path)
        if (manifest.checksum != capsule.manifest.checksum
                or manifest.nbytes != capsule.manifest.nbytes):
            raise CorruptCapsule(
                f'spill file {capsule.path!r} does not hold capsule {name!r} any more')
        return data.to(device)

    # -- files ---------------------------------------------------------------------------------

    def resolve(self, path, default=''):
        """Absolute path under the capsule directory; PathOutsideDirectory otherwise."""
        path = path or default
        full = os.path.realpath(os.path.join(self.directory, os.path.expanduser(path)))
        if os.path.commonpath([full, self.directory]) != self.directory or full == self.directory:
            raise PathOutsideDirectory(
                f'path {path!r} resolves to {full!r}, outside the capsule directory '
                f'{self.directory!r}')
        return full

    @_locked
    def save(self, name, path=''):
        """Write capsule `name` atomically; returns (absolute path, bytes of the file)."""
        capsule = self.get(name)
        full = self.resolve(path, name + SUFFIX)
        data = capsule.data if capsule.data is not None else self.data_on(name, 'cpu')
        digest = write_file(full, capsule.manifest, data)
        capsule.manifest.checksum = digest
        return full, os.path.getsize(full)

    @_locked
    def load(self, path, name='', overwrite=False, schema_digest=None, model_digest=None):
        """Read, verify and put a capsule file into the device tier; returns its Manifest.

        Checks, in order: path inside the directory, readable file, checksum, schema digest,
        model digest, name, budget. Any refusal leaves the store unchanged.
        """
        if not path:
            raise UnknownCapsule('load needs a capsule file path')
        full = self.resolve(path, '')
        if not os.path.isfile(full):
            raise UnknownCapsule(f'no capsule file at {full!r}')
        manifest, data = read_file(full)
        check_compatible(manifest, schema_digest, model_digest)
        name = name or manifest.name
        self.validate_name(name)
        if name in self._capsules and not overwrite:
            raise CapsuleExists(f'capsule {name!r} exists; pass overwrite to replace it')
        data = data.to(self.device)
        # The stored checksum covers the file's name; a renamed copy is unsaved until save().
        digest = manifest.checksum if name == manifest.name else ''
        m = replace(manifest, name=name, tier='device', pinned=False, checksum=digest)
        self.put(Capsule(m, data), overwrite=overwrite)
        return replace(m)
