"""Capsules (immutable copies of the live state) and the CapsuleStore that holds them by name.

Bookkeeping (names, tiers, budgets, LRU order, manifests) is plain Python; the only tensor
work is moving a capsule's bytes between tiers and files. Tiers: device -> pinned host -> disk.

Disk format (`<name>.capsule` by default): a safetensors file with one tensor 'state'
(uint8 [nbytes]) and metadata
{'format', 'manifest' (JSON), 'checksum' (sha256 over the manifest fields and the bytes)}, plus
'hmac_sha256' (HMAC-SHA256 of the checksum under the store's signing key) when the store has a
key. With a key, load refuses unsigned or wrongly signed files; without one, the signature is
ignored and the checksum still guards integrity.

OS errors (permission, disk full, read-only, not a file, name too long) become StorageError
with the path and a remedy. Names starting with CHECKPOINT_PREFIX belong to the recovery
checkpoints (runtime/recovery.py): creating one needs `allow_reserved()`.
"""

import contextlib
import errno
import functools
import hashlib
import hmac
import json
import os
import re
import stat
import struct
import tempfile
import threading
from typing import NamedTuple

import torch
from safetensors import safe_open

from .errors import (BudgetExceeded, CapsuleExists, CorruptCapsule, IncompatibleCapsule,
                     InvalidConfig, InvalidName, PathOutsideDirectory, ReservedName,
                     StorageError, UnknownCapsule, UntrustedCapsule)

FORMAT = 'flashrt-capsule/1'
TIERS = ('device', 'host', 'disk')
SUFFIX = '.capsule'     # save's default file: <capsule_dir>/<name>.capsule
CHECKPOINT_PREFIX = 'checkpoint-'   # reserved for the recovery checkpoints (and their files)
MIN_KEY_BYTES = 16      # a signing key shorter than this is refused as a mistake
_NAME = re.compile(r'[A-Za-z0-9_.-]{1,128}')
# Fields the checksum covers: tier, pinned and checksum itself are store-local, not content.
_CHECKED_FIELDS = ('name', 'parent', 'step', 'episode', 'position', 'nbytes',
                   'schema_digest', 'model_digest', 'created')


class Manifest(NamedTuple):
    """What a capsule is. Immutable: the engine hands the store's own manifest to callers, so
    nobody can change a capsule's record (changed copies come from _replace). A named tuple
    rather than a frozen dataclass: every snapshot makes one, and a frozen dataclass's
    __init__ cost about 5 us of the H200 host's ~26 us 4 KB snapshot call (one tuple: ~1 us)."""

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
    h.update(data.contiguous().numpy())     # the buffer itself: no copy of a large capsule
    return h.hexdigest()


def signature(key, digest):
    """HMAC-SHA256 under `key` of a capsule's checksum (which already covers the manifest's
    content fields and every byte), with the format as a domain separator."""
    return hmac.new(key, f'{FORMAT}\n{digest}'.encode(), hashlib.sha256).hexdigest()


def load_signing_key(path):
    """The signing key: the bytes of file `path`, exactly (e.g. `head -c 32 /dev/urandom`).

    StorageError when it cannot be read, InvalidConfig when shorter than MIN_KEY_BYTES.
    """
    path = os.path.expanduser(path)
    try:
        with open(path, 'rb') as f:
            key = f.read()
    except OSError as e:
        raise StorageError.from_os_error(e, path, 'read signing key file') from e
    if len(key) < MIN_KEY_BYTES:
        raise InvalidConfig(
            f'signing key file {path!r} holds {len(key)} bytes; use at least {MIN_KEY_BYTES} '
            'random bytes, e.g. head -c 32 /dev/urandom > key && chmod 600 key')
    return key


def _name_max(folder):
    try:
        return os.pathconf(folder, 'PC_NAME_MAX')
    except (OSError, ValueError):
        return 255


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


def _header(meta, nbytes):
    """The safetensors header of one uint8 tensor 'state': 8-byte little-endian length, JSON,
    space padding to a multiple of 8 (as safetensors writes it)."""
    body = json.dumps({'__metadata__': meta,
                       'state': {'dtype': 'U8', 'shape': [nbytes], 'data_offsets': [0, nbytes]}},
                      sort_keys=True, separators=(',', ':')).encode()
    body += b' ' * (-len(body) % 8)
    return struct.pack('<Q', len(body)) + body


def write_file(path, manifest, data, key=None):
    """Write a capsule file atomically: temp file in the same directory, fsync, os.replace.

    Returns the checksum written. A crash leaves either the old file or the new one. Signed
    with HMAC-SHA256 when `key` (bytes) is given. OS errors raise StorageError (temp file
    removed). The file is written here rather than by safetensors.save_file, whose errors carry
    no errno (a full disk surfaced as a SafetensorError string), and from the tensor's own
    buffer, with no serialised copy of it.
    """
    host = data.detach().to('cpu').contiguous()
    digest = checksum(manifest, host)
    meta = {'format': FORMAT, 'checksum': digest,
            'manifest': json.dumps(manifest._replace(checksum=digest)._asdict(),
                                   sort_keys=True)}
    if key is not None:
        meta['hmac_sha256'] = signature(key, digest)
    folder = os.path.dirname(path)
    doing = 'write capsule file'
    try:
        os.makedirs(folder, exist_ok=True)
        # Refuse before writing the bytes, not at the rename after writing them all.
        if len(os.fsencode(os.path.basename(path))) > _name_max(folder):
            raise OSError(errno.ENAMETOOLONG, os.strerror(errno.ENAMETOOLONG), path)
        if os.path.isdir(path):
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), path)
        fd, tmp = tempfile.mkstemp(prefix='.tmp-', suffix='.safetensors', dir=folder)
    except OSError as e:
        raise StorageError.from_os_error(e, path, doing) from e
    try:
        with os.fdopen(fd, 'wb') as f:
            f.write(_header(meta, host.numel()))
            f.write(host.numpy().data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(e, OSError):
            raise StorageError.from_os_error(e, path, doing) from e
        raise
    try:
        dfd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(dfd)   # make the rename itself durable
        finally:
            os.close(dfd)
    except OSError as e:
        raise StorageError.from_os_error(e, folder, 'sync capsule directory') from e
    return digest


def _check_readable(path):
    """Refuse, with the reason, what safetensors would misreport: it calls a file it may not
    read 'missing', and a directory or an empty file 'unreadable'."""
    try:
        st = os.stat(path)
        if stat.S_ISDIR(st.st_mode):
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), path)
        if not stat.S_ISREG(st.st_mode):
            raise StorageError(f'cannot read capsule file {path!r}: it is not a regular file; '
                               'name a capsule file instead', path)
        with open(path, 'rb'):
            pass
    except FileNotFoundError as e:
        raise CorruptCapsule(f'capsule file {path!r} is missing') from e
    except OSError as e:
        raise StorageError.from_os_error(e, path, 'read capsule file') from e
    if st.st_size == 0:
        raise CorruptCapsule(f'capsule file {path!r} is empty (0 bytes): an interrupted copy?')


def read_file(path, key=None):
    """Read and verify a capsule file; returns (Manifest, CPU uint8 tensor).

    CorruptCapsule (missing, truncated, checksum), StorageError (permission, not a file),
    UntrustedCapsule (a `key` is given and the file is unsigned or signed with another key).
    """
    _check_readable(path)
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
    if key is not None:
        signed = meta.get('hmac_sha256', '')
        if not signed:
            raise UntrustedCapsule(
                f'capsule file {path!r} is not signed, and this store requires signed files '
                '(a signing key is configured); if you trust it, load it into a store without '
                'a key and save it again with the key')
        if not hmac.compare_digest(signed.encode(), signature(key, actual).encode()):
            raise UntrustedCapsule(
                f'capsule file {path!r} is signed with another key than the configured one '
                '(or the signature was forged); not loaded')
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

    Tiers are budgets: 'device' (device_budget: memory of the engine's device), 'host'
    (host_budget), 'disk'. Manifests from list() and load() report where the bytes are, so a
    CPU store's device tier reports 'host' (it still counts against device_budget);
    placement() gives the budget tier of each capsule.
    """

    def __init__(self, device, device_budget, host_budget, directory, signing_key=None,
                 integrated=False):
        self.device = torch.device(device)
        self.device_budget = int(device_budget)
        self.host_budget = int(host_budget)
        self.directory = os.path.realpath(directory)
        if signing_key is not None:
            signing_key = bytes(signing_key)
            if len(signing_key) < MIN_KEY_BYTES:
                raise InvalidConfig(f'signing key of {len(signing_key)} bytes; use at least '
                                    f'{MIN_KEY_BYTES} random bytes')
        self._key = signing_key
        # integrated: the device shares the host's memory (cudaDevAttrIntegrated); moving a
        # capsule to the host tier then needs no copy (_demote), only the budget changes
        self.integrated = bool(integrated)
        # Where each budget tier's bytes live. On a CPU engine 'device' memory is host memory,
        # and reporting it as 'device' told people their capsules sat on a GPU.
        self._reported = {'device': 'host' if self.device.type == 'cpu' else 'device',
                          'host': 'host', 'disk': 'disk'}
        # Per thread, so that a service call on another executor thread never borrows the
        # recovery collaborator's permission to create checkpoint names.
        self._reserved_ok = threading.local()
        self._capsules = {}    # name -> Capsule
        self._used = {}        # name -> LRU tick (higher = more recent)
        self._tick = 0
        # Pinned host memory speeds up device<->host copies but needs CUDA.
        self._pin = torch.cuda.is_available()
        # The engine serialises its own calls; this lock covers readers such as a ROS
        # list_capsules callback running on another executor thread.
        self._lock = threading.RLock()

    # -- bookkeeping ---------------------------------------------------------------------------

    @property
    def signs_files(self):
        """True when files are signed on save and signatures are required on load."""
        return self._key is not None

    @staticmethod
    def check_name(name):
        """Names are [A-Za-z0-9_.-]{1,128} and not '.' or '..', so they are safe as file names."""
        if not isinstance(name, str) or not _NAME.fullmatch(name) or name in ('.', '..'):
            raise InvalidName(
                f'capsule name {name!r} is not allowed: use 1-128 characters from '
                '[A-Za-z0-9_.-], not "." or ".."')

    def validate_name(self, name):
        """A name a new capsule may take: check_name, and not in the checkpoint namespace
        unless inside allow_reserved() on this thread (ReservedName)."""
        self.check_name(name)
        if name.startswith(CHECKPOINT_PREFIX) and not self._reserved_allowed():
            raise ReservedName(
                f'capsule name {name!r} is reserved: names starting with {CHECKPOINT_PREFIX!r} '
                'belong to the periodic recovery checkpoints (a capsule there would be pruned '
                'as one, or chosen by recover); choose another name')

    def _reserved_allowed(self):
        return getattr(self._reserved_ok, 'depth', 0) > 0

    @contextlib.contextmanager
    def allow_reserved(self):
        """Within this block, on this thread only, names and capsule files in the checkpoint
        namespace may be created: for the recovery collaborator (checkpoints, resume)."""
        depth = getattr(self._reserved_ok, 'depth', 0)
        self._reserved_ok.depth = depth + 1
        try:
            yield self
        finally:
            self._reserved_ok.depth = depth

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

    def reported_tier(self, tier):
        """Where a budget tier's bytes are: 'host' for the device tier of a CPU store."""
        return self._reported[tier]

    def reported(self, manifest):
        """`manifest` with its tier as reported_tier() says (the same object when equal)."""
        tier = self._reported[manifest.tier]
        if tier == manifest.tier:
            return manifest
        return manifest._replace(tier=tier)

    def peek(self, name):
        """The capsule named `name`, or None; no name check, no LRU touch (the engine's
        overwrite path, which puts the capsule right after and touches it then)."""
        return self._capsules.get(name)

    @_locked
    def placement(self):
        """{name: budget tier ('device' | 'host' | 'disk')}; does not touch the LRU order."""
        return {n: c.manifest.tier for n, c in self._capsules.items()}

    @_locked
    def get(self, name):
        """The capsule (touches LRU order). UnknownCapsule if absent.

        Its manifest's tier is the budget tier (what placement() says), not the reported one.
        """
        self.check_name(name)
        if name not in self._capsules:
            known = ', '.join(sorted(self._capsules)) or 'none'
            raise UnknownCapsule(f'no capsule named {name!r} (known: {known})')
        self._touch(name)
        return self._capsules[name]

    @_locked
    def list(self):
        """Copies of every manifest, sorted by name, tiers as reported_tier() says."""
        return [m._replace(tier=self._reported[m.tier])
                for m in (self._capsules[n].manifest for n in sorted(self._capsules))]

    @_locked
    def delete(self, name):
        """Remove a capsule and its spill file (files written by save() are kept).

        The spill file goes first: if it cannot be removed (StorageError), the capsule stays.
        """
        capsule = self.get(name)
        if capsule.manifest.tier == 'disk' and capsule.path:
            try:
                os.unlink(capsule.path)
            except FileNotFoundError:
                pass
            except OSError as e:
                raise StorageError.from_os_error(e, capsule.path, 'remove spill file') from e
        del self._capsules[name]
        del self._used[name]

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
            if capsule.data.device.type == 'cpu' or self.integrated:
                # already host memory (a CPU engine, or an integrated GPU such as Jetson
                # Thor's, whose device memory is the host's DRAM): a relabel, no copy
                host = capsule.data
            else:
                # Straight into pinned memory when CUDA exists: one copy, and later
                # host->device restores can run asynchronously.
                host = torch.empty(m.nbytes, dtype=torch.uint8, pin_memory=self._pin)
                host.copy_(capsule.data)
            self._capsules[name] = Capsule(m._replace(tier='host'), host)
        else:
            path = os.path.join(self.directory, '.spill', f'{name}.safetensors')
            digest = write_file(path, m, capsule.data, self._key)
            self._capsules[name] = Capsule(m._replace(tier='disk', checksum=digest), None, path)

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
        old = self._capsules.get(m.name)
        if m.tier == 'disk' or (old is not None and old.manifest.tier == m.tier
                                and old.manifest.nbytes >= m.nbytes):
            moves = []      # an overwrite that fits in its predecessor's room demotes nothing
        else:
            moves = self._plan(m.tier, m.nbytes, skip=m.name)
        for name, _ in moves:
            self._demote(name)
        if old is not None and old.manifest.tier == 'disk' and old.path != capsule.path:
            # A stale spill file costs disk only; failing the put over it would refuse a
            # capsule that is already placed.
            with contextlib.suppress(OSError):
                os.unlink(old.path)
        self._capsules[m.name] = capsule
        self._touch(m.name)

    @_locked
    def held(self, capsule):
        """A capsule's bytes where they are (device or host memory, no copy), or read from
        its spill file into host memory with the checksum verified."""
        if capsule.data is not None:
            return capsule.data
        manifest, data = read_file(capsule.path, self._key)
        if (manifest.checksum != capsule.manifest.checksum
                or manifest.nbytes != capsule.manifest.nbytes):
            raise CorruptCapsule(f'spill file {capsule.path!r} does not hold capsule '
                                 f'{capsule.manifest.name!r} any more')
        return data

    @_locked
    def data_on(self, name, device):
        """The capsule's bytes on `device`; read from disk (checksum verified) if needed."""
        return self.held(self.get(name)).to(device, non_blocking=False)

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
        """Write capsule `name` atomically; returns (absolute path, bytes of the file).

        Signed when the store has a key. StorageError on OS errors; ReservedName for a file
        named like a checkpoint's that is not this capsule's own (resume would take it for
        one) outside allow_reserved().
        """
        capsule = self.get(name)
        full = self.resolve(path, name + SUFFIX)
        base = os.path.basename(full)
        if (os.path.dirname(full) == self.directory and base.startswith(CHECKPOINT_PREFIX)
                and base != name + SUFFIX and not self._reserved_allowed()):
            raise ReservedName(
                f'file name {base!r} is reserved: {CHECKPOINT_PREFIX}* files in the capsule '
                'directory are recovery checkpoints (restore_on_start would resume from it); '
                'choose another file name')
        data = self.held(capsule)
        digest = write_file(full, capsule.manifest, data, self._key)
        capsule.manifest = capsule.manifest._replace(checksum=digest)
        try:
            return full, os.path.getsize(full)
        except OSError as e:
            raise StorageError.from_os_error(e, full, 'stat capsule file') from e

    @_locked
    def load(self, path, name='', overwrite=False, schema_digest=None, model_digest=None):
        """Read, verify and put a capsule file into the device tier; returns its Manifest.

        Checks, in order: path inside the directory, readable file, checksum, signature (with
        a key), schema digest, model digest, name (a checkpoint name needs allow_reserved()),
        budget. Any refusal leaves the store unchanged. The returned manifest reports its
        tier as list() does.
        """
        if not path:
            raise UnknownCapsule('load needs a capsule file path')
        full = self.resolve(path, '')
        try:
            os.stat(full)
        except FileNotFoundError:
            raise UnknownCapsule(f'no capsule file at {full!r}') from None
        except OSError as e:    # permission on a directory on the way, name too long, ...
            raise StorageError.from_os_error(e, full, 'read capsule file') from e
        manifest, data = read_file(full, self._key)
        check_compatible(manifest, schema_digest, model_digest)
        name = name or manifest.name
        self.validate_name(name)
        if name in self._capsules and not overwrite:
            raise CapsuleExists(f'capsule {name!r} exists; pass overwrite to replace it')
        data = data.to(self.device)
        # The stored checksum covers the file's name; a renamed copy is unsaved until save().
        digest = manifest.checksum if name == manifest.name else ''
        m = manifest._replace(name=name, tier='device', pinned=False, checksum=digest)
        self.put(Capsule(m, data), overwrite=overwrite)
        return self.reported(m)
