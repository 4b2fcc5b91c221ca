"""The capsule file: a safetensors file with one tensor 'state' (uint8 [nbytes]) and metadata
{'format', 'manifest' (JSON), 'checksum' (sha256 over the manifest's content fields and the
bytes)}, plus 'hmac_sha256' (HMAC-SHA256 of the checksum under a signing key) when written with
a key. Reading with a key refuses unsigned or wrongly signed files; without one, the signature
is ignored and the checksum still guards integrity.

Written here rather than by safetensors.save_file, whose errors carry no errno (a full disk
surfaced as a SafetensorError string); OS errors (permission, disk full, read-only, not a
file, name too long) become StorageError with the path and a remedy. CapsuleStore
(capsule.py) decides which capsule goes to which file.
"""

import contextlib
import errno
import hashlib
import hmac
import json
import os
import stat
import struct
import tempfile
from typing import NamedTuple

import torch
from safetensors import safe_open

from .enums import Tier
from .errors import CorruptCapsule, InvalidConfig, StorageError, UntrustedCapsule

FORMAT = 'flashrt-capsule/1'
MIN_KEY_BYTES = 16      # a signing key shorter than this is refused as a mistake


class Manifest(NamedTuple):
    """What a capsule is. Immutable: the engine hands the store's own manifest to callers, so
    nobody can change a capsule's record (changed copies come from _replace). A named tuple
    rather than a frozen dataclass: every snapshot makes one, and a frozen dataclass's
    __init__ cost about 5 us of the H200 host's ~26 us 4 KB snapshot call (one tuple: ~1 us)."""

    name: str
    parent: str
    tier: Tier               # or its string: a manifest read from a file holds that
    pinned: bool
    step: int
    episode: int
    position: int
    nbytes: int
    schema_digest: str
    model_digest: str
    created: float           # seconds, the engine's clock (a node's: ROS time)
    checksum: str = ''       # '' until written to disk


# Fields the checksum covers: tier, pinned and checksum itself are store-local, not content.
_CHECKED_FIELDS = ('name', 'parent', 'step', 'episode', 'position', 'nbytes',
                   'schema_digest', 'model_digest', 'created')


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


def checked_signing_key(key):
    """`key` as bytes; InvalidConfig when shorter than MIN_KEY_BYTES."""
    key = bytes(key)
    if len(key) < MIN_KEY_BYTES:
        raise InvalidConfig(f'signing key of {len(key)} bytes; use at least {MIN_KEY_BYTES} '
                            'random bytes')
    return key


def _name_max(folder):
    try:
        return os.pathconf(folder, 'PC_NAME_MAX')
    except (OSError, ValueError):
        return 255


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
