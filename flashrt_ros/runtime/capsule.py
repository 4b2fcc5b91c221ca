"""Capsules (immutable copies of the live state) and the CapsuleStore that holds them by name.

Bookkeeping (names, tiers, budgets, LRU order, manifests) is plain Python; the only tensor
work is moving a capsule's bytes between tiers and files. Tiers: device -> pinned host -> disk.
Files are written and read (checksums, signatures) by capsule_file.py; which names and files
a capsule may take, the checkpoint namespace included, is capsule_names.py's.
"""

import contextlib
import functools
import os
import threading

import torch

from .capsule_file import checked_signing_key, Manifest, read_file, write_file
from .capsule_names import CapsuleNames, check_name
from .enums import Tier
from .errors import (BudgetExceeded, CapsuleExists, CorruptCapsule, IncompatibleCapsule,
                     StorageError, UnknownCapsule)

# Manifest is defined with the file format (the fields a file carries) and is part of this
# module's API: a Capsule is a Manifest plus bytes.
__all__ = ['Capsule', 'CapsuleStore', 'check_compatible', 'Manifest']

TIERS = tuple(Tier)


class Capsule:
    """Immutable live bytes plus a manifest. Nothing ever writes into `data` after creation."""

    def __init__(self, manifest, data=None, path=None):
        self.manifest = manifest
        self.data = data     # uint8 [nbytes] on the device or in host memory; None on disk
        self.path = path     # file when tier == 'disk'


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
        self.names = CapsuleNames(directory)
        self.directory = self.names.directory
        self._key = None if signing_key is None else checked_signing_key(signing_key)
        # integrated: the device shares the host's memory (cudaDevAttrIntegrated); moving a
        # capsule to the host tier then needs no copy (_demote), only the budget changes
        self.integrated = bool(integrated)
        # Where each budget tier's bytes live. On a CPU engine 'device' memory is host memory,
        # and reporting it as 'device' told people their capsules sat on a GPU.
        self._reported = {Tier.DEVICE: Tier.HOST if self.device.type == 'cpu' else Tier.DEVICE,
                          Tier.HOST: Tier.HOST, Tier.DISK: Tier.DISK}
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

    check_name = staticmethod(check_name)

    def validate_name(self, name):
        """A name a new capsule may take (CapsuleNames.validate)."""
        self.names.validate(name)

    @contextlib.contextmanager
    def allow_reserved(self):
        """Within this block, on this thread only, names and capsule files in the checkpoint
        namespace may be created: for the recovery collaborator (checkpoints, resume)."""
        with self.names.allow_reserved():
            yield self

    def _touch(self, name):
        self._tick += 1
        self._used[name] = self._tick

    def _bytes_in(self, tier, skip=None):
        return sum(c.manifest.nbytes for n, c in self._capsules.items()
                   if c.manifest.tier == tier and n != skip)

    @property
    @_locked
    def device_bytes_used(self):
        return self._bytes_in(Tier.DEVICE)

    @property
    @_locked
    def host_bytes_used(self):
        return self._bytes_in(Tier.HOST)

    def _budget(self, tier):
        return self.device_budget if tier == Tier.DEVICE else self.host_budget

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
        if capsule.manifest.tier == Tier.DISK and capsule.path:
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
        if m.tier == Tier.DEVICE:
            if capsule.data.device.type == 'cpu' or self.integrated:
                # already host memory (a CPU engine, or an integrated GPU such as Jetson
                # Thor's, whose device memory is the host's DRAM): a relabel, no copy
                host = capsule.data
            else:
                # Straight into pinned memory when CUDA exists: one copy, and later
                # host->device restores can run asynchronously.
                host = torch.empty(m.nbytes, dtype=torch.uint8, pin_memory=self._pin)
                host.copy_(capsule.data)
            self._capsules[name] = Capsule(m._replace(tier=Tier.HOST), host)
        else:
            path = os.path.join(self.directory, '.spill', f'{name}.safetensors')
            digest = write_file(path, m, capsule.data, self._key)
            self._capsules[name] = Capsule(m._replace(tier=Tier.DISK, checksum=digest), None,
                                           path)

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
        if m.tier not in TIERS or (m.pinned and m.tier == Tier.DISK):
            raise BudgetExceeded(f'capsule {m.name!r} cannot live in tier {m.tier!r}')
        old = self._capsules.get(m.name)
        if m.tier == Tier.DISK or (old is not None and old.manifest.tier == m.tier
                                   and old.manifest.nbytes >= m.nbytes):
            moves = []      # an overwrite that fits in its predecessor's room demotes nothing
        else:
            moves = self._plan(m.tier, m.nbytes, skip=m.name)
        for name, _ in moves:
            self._demote(name)
        if old is not None and old.manifest.tier == Tier.DISK and old.path != capsule.path:
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

    @_locked
    def save(self, name, path=''):
        """Write capsule `name` atomically; returns (absolute path, bytes of the file).

        Signed when the store has a key. StorageError on OS errors; ReservedName for a file
        named like a checkpoint's that is not this capsule's own (resume would take it for
        one) outside allow_reserved().
        """
        capsule = self.get(name)
        full = self.names.save_path(name, path)
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
        manifest, data = read_file(self.names.load_path(path), self._key)
        check_compatible(manifest, schema_digest, model_digest)
        name = name or manifest.name
        self.validate_name(name)
        if name in self._capsules and not overwrite:
            raise CapsuleExists(f'capsule {name!r} exists; pass overwrite to replace it')
        data = data.to(self.device)
        # The stored checksum covers the file's name; a renamed copy is unsaved until save().
        digest = manifest.checksum if name == manifest.name else ''
        m = manifest._replace(name=name, tier=Tier.DEVICE, pinned=False, checksum=digest)
        self.put(Capsule(m, data), overwrite=overwrite)
        return self.reported(m)
