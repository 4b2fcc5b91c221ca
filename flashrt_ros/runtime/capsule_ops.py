"""Capsule operations on an engine's live state: snapshot, restore, fork, rollback, delete,
save, load and reset_episode (PolicyEngine's, which delegates them here).

Each holds the engine's one lock, so it runs between two steps, and refuses (FlashRTError
subclasses) leaving the live state and the store unchanged. latency_us is the Timer's window:
the operation's copies, the host bookkeeping done while they are in flight and its one
synchronisation.
"""

from dataclasses import dataclass
import math
import time

import torch

from .capsule import Capsule, check_compatible
from .capsule_file import Manifest
from .enums import Growth, Tier
from .errors import CapsuleExists, InvalidConfig, RollbackUnavailable
from .state import KINDS, META_EPISODE

EPISODE_START = 'episode_start'     # the capsule reset_episode() restores


@dataclass
class OpResult:
    message: str
    manifest: Manifest | None
    latency_us: float
    step: int
    path: str = ''          # the capsule file, for save and load


def _new_manifest(name, parent, tier, pinned, nbytes, counters, digests, created):
    """The manifest of a capsule created at `created` (the engine's clock), holding a state
    at counters (step, episode, position) with digests (schema, model); its checksum is ''
    until it is written."""
    step, episode, position = counters
    schema_digest, model_digest = digests
    return Manifest(name=name, parent=parent, tier=tier, pinned=bool(pinned), step=step,
                    episode=episode, position=position, nbytes=nbytes,
                    schema_digest=schema_digest, model_digest=model_digest, created=created)


def _pinned(replaced):
    """An overwrite never unpins: the LRU would then be free to drop a reset point such as
    episode_start, with no word to whoever overwrote it."""
    return replaced is not None and replaced.manifest.pinned


class CapsuleOps:
    """The capsule operations over one engine's parts: the arena and its sessions, the store,
    the rollback ring, the step program (initial state), the transfer and its timer."""

    def __init__(self, arena, sessions, store, ring, program, timer, lock, model_digest,
                 check, clock):
        """lock: the engine's; check: its debug check, run after the live state changed;
        clock: seconds now, for the manifests' `created`."""
        self.arena, self.sessions, self.store, self.ring = arena, sessions, store, ring
        self.program, self.transfer, self.timer = program, program.transfer, timer
        self.lock, self.model_digest, self.check = lock, model_digest, check
        self.clock = clock
        self._snap_count = 0

    def _result(self, message, manifest, us, s=None):
        """The OpResult; a manifest's tier as the store reports it (a CPU engine's 'device'
        tier is host memory, so it says 'host', as list_capsules does). step: the session's
        step (session 0's when the operation concerns none)."""
        if manifest is not None:
            manifest = self.store.reported(manifest)
        return OpResult(message, manifest, us, (s or self.sessions[0]).step_index)

    def _session_suffix(self, s):
        """' of session <name>' in a multi-session engine's messages, else ''."""
        return '' if len(self.sessions) == 1 else f' of session {s.name!r}'

    def _snapshot_live(self, name, overwrite, pin, tier, s, describe):
        """The OpResult of a snapshot of session s's live state; its message is describe(the
        manifest), composed while the copy is in flight, as is all of the bookkeeping."""
        if not name:
            self._snap_count += 1
            name = f'snap-{s.step_index}-{self._snap_count}'
        self.store.validate_name(name)
        old = self._replaced(name, overwrite)
        data = self._bytes_for(old, self.arena.live_nbytes(s.position), tier)
        with self.timer as timer:
            self.arena.read_live(s.position, data, self.transfer, s.index)
            # The copy is asynchronous: the manifest and the store's bookkeeping run on the
            # host while it is in flight, and the window's one synchronisation ends both. (A
            # refused put frees fresh bytes only: overwriting in place cannot be refused.)
            # No checksum here: it would cost a device->host read on the hot path. It is
            # computed when the capsule is written to disk and checked on every read from disk.
            m = _new_manifest(name, s.lineage, tier, pin or _pinned(old), data.numel(),
                              (s.step_index, s.episode, s.position),
                              (self.arena.schema_digest, self.model_digest), self.clock())
            self.store.put(Capsule(m, data), overwrite=overwrite)
            result = self._result(describe(m), m, math.nan, s)
        result.latency_us = timer.us    # manifests are frozen: the caller cannot change them
        return result

    def _replaced(self, name, overwrite):
        """The capsule a new capsule `name` replaces (None: the name is new); CapsuleExists
        unless overwrite."""
        old = self.store.peek(name)
        if old is not None and not overwrite:
            raise CapsuleExists(f'capsule {name!r} exists; pass overwrite to replace it')
        return old

    def _bytes_for(self, old, nbytes, tier, avoid=None):
        """The bytes a new capsule of `nbytes` in `tier` is copied into; old: the capsule it
        replaces, or None."""
        if (old is not None and old.manifest.tier == tier and old.data is not None
                and old.manifest.nbytes == nbytes and old.data is not avoid):
            # Overwriting a capsule of the same size in the same tier (periodic checkpoints, a
            # planner's 'current' capsule): reuse its bytes, no allocation. put() cannot refuse
            # it: the new capsule takes exactly the old one's room.
            return old.data
        # tier 'host': one copy straight into (pinned) host memory, e.g. for checkpoints that
        # should not take device budget. On an integrated device the device's memory is host
        # memory already: the capsule stays a device allocation (a device-speed copy, no
        # pinned staging) and only counts against the host budget.
        device = self.arena.device
        on_device = tier == Tier.DEVICE or self.store.integrated
        return torch.empty(nbytes, dtype=torch.uint8, device=device if on_device else 'cpu',
                           pin_memory=not on_device and device.type == 'cuda')

    def snapshot(self, name, overwrite, pin, tier, session):
        if tier not in (Tier.DEVICE, Tier.HOST):
            raise InvalidConfig(f"snapshot tier must be 'device' or 'host', got {tier!r}")
        with self.lock:
            s = self.sessions.find(session)
            suffix = self._session_suffix(s)
            return self._snapshot_live(name, overwrite, pin, tier, s, lambda m: (
                f'snapshot {m.name!r}{suffix}: {m.nbytes} bytes at step {m.step}'))

    def _restore(self, name, kinds, s, describe=None):
        """The OpResult of restoring capsule `name` (only buffers of `kinds`, or all) into
        session s; its message is describe(the manifest) (None: ''), composed while the copy
        is in flight."""
        capsule = self.store.get(name)
        m = capsule.manifest
        check_compatible(m, self.arena.schema_digest, self.model_digest)
        if kinds is not None:
            kinds = set(kinds)
            unknown = kinds - set(KINDS)
            if unknown:
                raise InvalidConfig(f'unknown kinds {sorted(unknown)}; kinds are {KINDS}')
            names = [n for n, spec in self.arena.specs.items() if spec.kind in kinds]
            if not names:
                raise InvalidConfig(f'the state has no buffers of kinds {sorted(kinds)}')
        if kinds is None:
            # Device or host tier: one copy from where the bytes are (pinned host memory
            # straight into the arena). Disk: read and verified here, before any write.
            data = self.store.held(capsule)
        else:
            data = self.store.data_on(name, self.arena.device)
        with self.timer as timer:
            if kinds is None:
                self.arena.write_live(m.position, data, self.transfer, s.index)
            else:
                views = self.arena.unpack(data, m.position)
                for n in names:
                    dst = s.views[n]
                    if self.arena.specs[n].growth == Growth.APPEND:
                        dst = dst[:m.position]
                    dst.copy_(views[n])
            # host counters while the copy is in flight (nothing below can fail)
            if kinds is None or 'meta' in kinds:
                s.step_index, s.episode, s.position = m.step, m.episode, m.position
            s.rollback_available = 0
            s.lineage = name
            result = self._result(describe(m) if describe else '', m, math.nan, s)
        self.check()
        result.latency_us = timer.us
        return result

    def restore(self, name, kinds, session):
        with self.lock:
            s = self.sessions.find(session)
            what = 'all buffers' if kinds is None else f'kinds {sorted(set(kinds))}'
            suffix = self._session_suffix(s)
            counters = kinds is None or 'meta' in kinds
            # a partial restore without the meta buffers leaves the step counter where it was
            return self._restore(name, kinds, s, lambda m: (
                f'restored {name!r} ({what}){suffix} to step {m.step}' if counters else
                f'restored {name!r} ({what}, taken at step {m.step}){suffix}; the step '
                f'counter stays at {s.step_index}'))

    def fork(self, source, target, overwrite, session):
        with self.lock:
            if not source:
                s = self.sessions.find(session)
                suffix = self._session_suffix(s)
                return self._snapshot_live(target, overwrite, False, Tier.DEVICE, s,
                                           lambda m: f'forked live state{suffix} to {target!r}')
            self.store.validate_name(target)
            capsule = self.store.get(source)
            src = capsule.manifest
            old = self._replaced(target, overwrite)
            held = self.store.held(capsule)     # from disk: read, verified before any write
            data = self._bytes_for(old, src.nbytes, Tier.DEVICE, avoid=held)
            with self.timer as timer:
                self.transfer.copy(data, held, src.nbytes)
                # bookkeeping while the copy is in flight, as in _snapshot_live
                m = _new_manifest(target, source, Tier.DEVICE, _pinned(old), src.nbytes,
                                  (src.step, src.episode, src.position),
                                  (src.schema_digest, src.model_digest), self.clock())
                self.store.put(Capsule(m, data), overwrite=overwrite)
            return self._result(f'forked {source!r} to {target!r}', m, timer.us)

    def rollback(self, steps, session):
        with self.lock:
            s = self.sessions.find(session)
            if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
                raise RollbackUnavailable(f'rollback needs a whole number of steps >= 1, '
                                          f'got {steps!r}')
            if steps > s.rollback_available:
                raise RollbackUnavailable(
                    f'cannot roll back {steps} steps{self._session_suffix(s)}: '
                    f'{s.rollback_available} available (ring depth {self.ring.depth}; cleared '
                    'by restore, reset and prefill)')
            target = s.step_index - steps
            with self.timer as timer:
                self.ring.restore(target, s.index)
                s.step_index = target       # host counters while the copy is in flight
                s.position -= steps * int(self.program.advances)
                s.rollback_available -= steps
            self.check()
            return self._result(f'rolled back {steps} steps{self._session_suffix(s)} to step '
                                f'{target}', None, timer.us, s)

    def delete(self, name):
        with self.lock:
            m = self.store.get(name).manifest
            self.store.delete(name)
            return self._result(f'deleted {name!r}', m, 0.0)

    def save(self, name, path):
        with self.lock:
            t0 = time.perf_counter()   # disk I/O is host work: wall time, not device events
            full, size = self.store.save(name, path)
            us = (time.perf_counter() - t0) * 1e6
            m = self.store.get(name).manifest
            result = self._result(f'saved {name!r} to {full} ({size} bytes)', m, us)
            result.path = full
            return result

    def load(self, path, name, overwrite):
        with self.lock:
            t0 = time.perf_counter()
            m = self.store.load(path, name, overwrite, schema_digest=self.arena.schema_digest,
                                model_digest=self.model_digest)
            us = (time.perf_counter() - t0) * 1e6
            result = self._result(f'loaded {m.name!r} from {path}', m, us)
            result.path = self.store.names.resolve(path)
            return result

    def reset_episode(self, session):
        with self.lock:
            s = self.sessions.find(session)
            episode = s.episode + 1
            with self.timer as timer:
                if EPISODE_START in self.store:
                    m = self._restore(EPISODE_START, None, s).manifest
                else:
                    m = None
                    self.program.initial_state(s.index, episode)
                    s.step_index, s.position, s.lineage = 0, 0, ''
                s.views['meta'][META_EPISODE] = episode
            s.episode = episode
            s.rollback_available = 0
            self.check()
            source = repr(EPISODE_START) if m else 'the initial state'
            return self._result(f'episode {episode}{self._session_suffix(s)} started from '
                                f'{source}', m, timer.us, s)
