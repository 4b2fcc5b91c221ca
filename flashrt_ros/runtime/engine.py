"""PolicyEngine: the committed step boundary, session addressing and diagnostics; the facade
over step.py, capsule_ops.py, the capsule store and the rollback ring.

One lock serialises step() and every capsule operation, so an operation always sees the state
between two steps. Host mirrors of the meta counters (step_index, episode, position) are
updated deterministically from what each operation did; the step path never reads the device.

Sessions: an engine built with sessions=N holds N independent policy states (one contiguous
block each, StateArena) and steps them all in one replay: step_all() takes [N, obs_dim] and an
active mask; an inactive session's state is put back from the rollback ring inside the same
graph, so it stays bit for bit what it was. Every capsule operation takes `session` (index or
name); with one session it may be left out, with several it must be given.

How the replay computes the fleet: by default session by session (the graph holds each
session's kernels one after another), so every session's actions are bit for bit those of a
single-session engine of the same model, and a capsule replays the same actions in any
session. batch_sessions=True computes the fleet as one batch (one matrix product per layer
for all sessions: far fewer kernels), which BLAS libraries round differently from a batch of
one: actions then agree with single-session runs to float rounding, not bit for bit (a row's
rounding may depend on its place); they never depend on another session's state.
A policy on batch-invariant kernels (policy.set_kernels('batch_invariant'), invariant.py)
steps a fleet as one batch and exactly: every session bit for bit a single-session engine on
the same kernels (checked on this machine at construction, invariant.verify).
"""

from collections import deque
import logging
import math
import threading
import time

import numpy as np
import torch

from .capsule import CapsuleStore
from .capsule_ops import CapsuleOps, EPISODE_START
from .enums import Growth, Tier
from .errors import CapacityExceeded, InvalidConfig, InvalidObservation
from .policies.invariant import verify
from .ring import RollbackRing
from .sessions import Session, Sessions
from .state import BufferSpec, META_TAG, StateArena
from .inputs import as_device_observations, as_observations, as_tag, tick_control
from .step import StepProgram
from .transfer import Timer, Transfer

__all__ = ['EPISODE_START', 'PolicyEngine']     # EPISODE_START: the node imports it from here


class PolicyEngine:
    """Owns policy, arena, step program, capsule store and rollback ring."""

    def __init__(self, policy, device='cpu', cuda_graph=True, rollback_depth=32,
                 device_budget=1 << 30, host_budget=4 << 30, capsule_dir='capsules',
                 debug=False, last_action=None, signing_key=None, use_cuda_python=True,
                 sessions=1, session_names=None, batch_sessions=False, determinism_probe=3,
                 clock=time.time):
        """last_action: (start, size, scale, offset, clip) of an observation slot that the
        step fills from the previous action (ObservationLayout.device_feedback()), or None.
        That action is then state ('last_action' in the arena), restored with a capsule.
        use_cuda_python: issue copies through cuda-python where it imports (Transfer).
        sessions: independent policy states stepped together (step_all); session_names: a
        name for each (default '0', '1', ...), usable wherever a session is addressed.
        batch_sessions: compute the fleet as one batch (see the module notes: faster, not bit
        for bit with single-session runs); only for policies that can (policy.batched).
        signing_key: bytes (capsule_file.load_signing_key) to sign capsule files and require
        signatures on load; None: unsigned files, checksums only. determinism_probe: replays
        of each step compared at construction (0: none; see `determinism`). clock: seconds
        now, the capsules' `created` (a node passes its ROS clock: sim time under
        use_sim_time)."""
        self.device, self.debug = torch.device(device), debug
        self.policy = policy.to(self.device)
        specs = list(policy.state_specs())
        if any(s.name == 'meta' or s.kind == 'meta' for s in specs):
            raise InvalidConfig('policies must not declare meta buffers; the engine adds them')
        specs.append(BufferSpec('meta', (4,), torch.int64, 'meta'))   # step, episode, pos, tag
        if last_action is not None:
            specs.append(BufferSpec('last_action', (int(policy.act_dim),), torch.float32,
                                    'history'))
        self.arena = StateArena(specs, self.device, sessions)
        self.sessions = self.arena.sessions
        self._sessions = Sessions(self.arena, session_names)
        self.transfer = Transfer(self.device, use_cuda_python)
        # Jetson-class devices: GPU and CPU share one DRAM (cudaDevAttrIntegrated)
        integrated = self.device.type == 'cuda' and \
            torch.cuda.get_device_properties(self.device).is_integrated
        self.store = CapsuleStore(self.device, device_budget, host_budget, capsule_dir,
                                  signing_key=signing_key, integrated=integrated)
        self.ring = RollbackRing(self.arena, rollback_depth, self.transfer)
        self.model_digest = policy.model_digest()
        self.obs_dim, self.act_dim = int(policy.obs_dim), int(policy.act_dim)
        invariant = getattr(policy, 'kernels', 'default') == 'batch_invariant'
        if invariant and self.sessions > 1:
            verify(self.policy, self.sessions, self.device)
        self.exact = invariant or not batch_sessions or self.sessions == 1   # = lone engines
        self.program = StepProgram(self.policy, self.arena, self.ring, self.transfer,
                                   batched=batch_sessions or (invariant and self.sessions > 1),
                                   last_action=last_action,
                                   cuda_graph=cuda_graph, debug=debug)
        self.graph_captured = self.program.captured
        self.last_step_finite = True    # the flag of the latest step (see verdict in recovery)
        # per session, the flag of its latest step (step_all replaces all of them): what
        # recovery.Recovery.verdict reads for the session it guards
        self.last_finite = np.ones(self.sessions, dtype=bool)
        self._lock = threading.Lock()
        self._timer = Timer(self.transfer)
        self._latencies = deque(maxlen=1024)
        self.rejected_observations = 0
        self._ptrs = {n: v.data_ptr() for n, v in self.arena.views.items()}
        self._capsules = CapsuleOps(self.arena, self._sessions, self.store, self.ring,
                                    self.program, self._timer, self._lock, self.model_digest,
                                    self._check, clock)
        # determinism: replays of each step from one random state compared bit for bit (graph.
        # probe_determinism); a kernel that is not reproducible is reported, never silent
        self.determinism = {'deterministic': None, 'replays': 0, 'probed': False}
        if determinism_probe:
            self.determinism = {**self.program.probe_determinism(determinism_probe),
                                'probed': True}
            if not self.determinism['deterministic']:
                logging.getLogger(__name__).warning(
                    'the policy step is not reproducible on %s: %s', self.device,
                    self.determinism)

    # -- sessions ------------------------------------------------------------------------------

    def session(self, key=None):
        """The Session record for an index (int or decimal string) or a name. None or '' is
        the only session of a single-session engine; with several, leaving it out is refused
        (a capsule operation on a guessed robot would change the wrong robot's actions)."""
        return self._sessions.find(key)

    @property
    def session_names(self):
        return self._sessions.names

    # The single-session view of the counters (session 0 of a multi-session engine).
    step_index = property(lambda self: self._sessions[0].step_index)
    episode = property(lambda self: self._sessions[0].episode)
    position = property(lambda self: self._sessions[0].position)
    rollback_available = property(lambda self: self._sessions[0].rollback_available)

    # -- the step ------------------------------------------------------------------------------

    def _observations(self, obs, rows=None, on_device=False, stage=False):
        """inputs.as_observations (as_device_observations) here; a refusal is counted. stage: a
        fleet's host observations, checked while on their way to the device (program.stage)."""
        try:
            if on_device:
                obs = as_device_observations(obs, self.obs_dim, rows)
            else:
                obs = as_observations(obs, self.obs_dim, rows, finite=not stage)
                obs = self.program.stage(obs) if stage else obs
            getattr(self.policy, 'check_observation', id)(obs)   # inputs that are not floats
            return obs
        except InvalidObservation:
            self.rejected_observations += 1
            raise

    def step(self, obs, tag=None, session=None):
        """Committed boundary: obs [obs_dim] -> action (CPU float32 [act_dim]).

        tag: an int in [1, 2**63) naming the input this step consumes (e.g. a lock-step
        node's sensor stamp), stored in the state (meta) so that a capsule, a rollback or a
        restart knows which input its state has already answered (input_tag()). Refuses
        (InvalidObservation, CapacityExceeded) before touching the state.
        session: which session steps (the others stay as they are); may be left out with one.
        """
        as_tag(tag)
        with self._lock:
            s = self._sessions.find(session)
            self.program.obs_np[s.index] = self._observations(obs)
            self._step_locked(s, (tag or 0,))
            finite = self.last_finite[s.index] = self.program.finite_np[s.index] == 1.0
            self.last_step_finite = bool(finite)
            return torch.from_numpy(self.program.act_np[s.index].copy())

    def step_all(self, obs, active=None, tags=None):
        """One tick for the fleet: obs [sessions, obs_dim] -> actions (CPU float32 [sessions,
        act_dim]), one graph replay for every session. obs as a tensor on the engine's device
        (a GPU-resident farm) is validated and staged there, and the actions come back there.

        active: bools [sessions] (default all): sessions left out keep their state bit for
        bit (their rows of obs are ignored but must be finite; their actions are meaningless).
        tags: per session an int in [1, 2**63) or None (see step()). last_finite holds each
        session's finite flag afterwards.
        """
        which, tags = tick_control(self.sessions, active, tags)
        program = self.program
        on_device = torch.is_tensor(obs) and obs.device == program.obs_buf.device
        with self._lock:
            staged = self._observations(obs, self.sessions, on_device, stage=not on_device)
            self._step_locked(which, tags, staged if on_device else None, not on_device)
            self.last_finite = finite = program.finite_np == 1.0
            self.last_step_finite = bool(finite[which].all())
            return program.actions(on_device)

    def _step_locked(self, which, tags, device_obs=None, copied_in=False):
        """Steps the sessions `which` (an index array, a slice, or one Session), whose obs rows
        are staged (or in device_obs, or copied_in), with their tags (0 or None: none), in one
        replay, into program.act_np and finite_np (valid until the next step). Host work:
        scalars for one session, numpy operations for a fleet (its counters while the device
        runs)."""
        which = self._sessions[0] if self.sessions == 1 else which    # plain counters
        one = isinstance(which, Session)
        counters, program, capacity = self._sessions.counters, self.program, self.arena.capacity
        advance = int(program.advances)
        position = which.position if one else counters[which, Session.POSITION]
        if not one and not position.size:
            raise InvalidObservation('step_all: no session is active')
        top = position if one else int(position.max())     # (np.max of an int costs ~3 us)
        if advance and top >= capacity:
            full = [which.name] if one else [self._sessions[int(i)].name for i in np.arange(
                self.sessions)[which][position >= capacity]]
            where = '' if self.sessions == 1 else f' (sessions {full})'
            raise CapacityExceeded(f'history is full ({capacity} positions){where}; reset '
                                   'the episode, restore or roll back')
        program.stage_control(slice(which.index, which.index + 1) if one else which, tags)
        with self._timer as timer:      # its exit synchronises the device, once
            program.issue(top, 0 if tags is None else tags[0], device_obs, copied_in)
            self._sessions.stepped(which, advance, self.ring.depth)
        self._latencies.append(timer.us)
        self._check()

    def input_tag(self, session=None):
        """The tag of the input the live state's latest step consumed (step(tag=)); 0 when
        none. Read from the state itself, so it follows restores, rollbacks and resets."""
        with self._lock:
            return int(self._sessions.find(session).views['meta'][META_TAG])

    def last_action(self, session=None):
        """The previous action held in the state as float32 numpy [act_dim] ('last_action',
        when the engine feeds it back; a chunk policy's, in its queue); None if none is."""
        with self._lock:
            views = self._sessions.find(session).views
            if 'last_action' in views:
                return views['last_action'].cpu().numpy().copy()
            rest = getattr(self.policy, 'chunk_left', lambda views: None)(views)
            return None if rest is None else rest[0]

    def prefill(self, observations, session=None):
        """Feed [T, obs_dim] observations into the history (eager); ring is cleared."""
        with self._lock:
            s = self._sessions.find(session)
            if not hasattr(observations, '__len__'):
                self.rejected_observations += 1
                raise InvalidObservation('prefill needs a [T, obs_dim] array of observations')
            rows = len(observations)
            t = self._observations(observations, rows=rows)
            if not self.program.advances:
                raise InvalidConfig(f'policy kind {self.policy.kind!r} has no history to prefill')
            if s.position + rows > self.arena.capacity:
                raise CapacityExceeded(
                    f'prefill of {rows} positions at position {s.position} exceeds the '
                    f'capacity {self.arena.capacity}')
            with self.program.bound_to(s.views) as policy:
                policy.prefill(torch.from_numpy(t).to(self.device))
            s.position += rows
            s.rollback_available = 0   # ring slots are indexed by step, prefill is not one
            self._check()

    # -- diagnostics ---------------------------------------------------------------------------

    def nonfinite_buffers(self, name=None, static_only=False, session=None):
        """Names of floating-point buffers holding NaN/Inf in the live state (or in capsule
        `name`), live range only; static_only skips the append (history) buffers. Costs one
        reduction per buffer and one device sync."""
        with self._lock:
            specs = self.arena.specs
            if name is None:
                # the live views themselves (this runs every step when the node checks for
                # poison): append buffers sliced to the live prefix, nothing unpacked
                s = self._sessions.find(session)
                views = {n: v[:s.position] if specs[n].growth == Growth.APPEND else v
                         for n, v in s.views.items()}
            else:
                m = self.store.get(name).manifest
                views = self.arena.unpack(self.store.data_on(name, self.device), m.position)
            floats = [(n, v) for n, v in views.items() if v.is_floating_point() and not (
                static_only and specs[n].growth == Growth.APPEND)]
            if not floats:
                return []
            flags = torch.stack([torch.isfinite(v).all() for _, v in floats]).tolist()
            return [n for (n, _), ok in zip(floats, flags) if not ok]

    def clear_beyond_position(self, session=None):
        """Zeroes the append rows past the live position. Normally unneeded: steps mask those
        rows out, but a NaN/Inf row left there by a poisoned step would still reach the output
        (0 * NaN is NaN), so recovery from a poisoned state calls this once. Costs a write of
        the unused capacity."""
        with self._lock:
            s = self._sessions.find(session)
            self.arena.blocks[s.index][self.arena.live_nbytes(s.position):].zero_()

    def step_latency_us(self):
        """(p50, p99) over recent steps; NaN before the first step."""
        xs = sorted(self._latencies) or [math.nan]
        return xs[len(xs) // 2], xs[min(len(xs) - 1, math.ceil(0.99 * len(xs)) - 1)]

    def _check(self):
        """Debug mode: addresses never move and host mirrors match the device counters."""
        if not self.debug:
            return
        for n, v in self.arena.views.items():
            assert v.data_ptr() == self._ptrs[n], f'buffer {n} moved'
        for s, meta in zip(self._sessions, self.program.meta_all.tolist()):
            assert meta[:3] == [s.step_index, s.episode, s.position], (s, meta)

    # -- capsule operations (capsule_ops.py; each between two steps, under the lock) -----------

    def snapshot(self, name='', overwrite=False, pin=False, tier=Tier.DEVICE, session=None):
        """Copy a session's live bytes into a new capsule (one copy). The live state is not
        changed.

        tier: 'device' (default) or 'host' (pinned host memory).
        """
        return self._capsules.snapshot(name, overwrite, pin, tier, session)

    def restore(self, name, kinds=None, session=None):
        """Make a session's live bytes equal the capsule's (kinds: only buffers of those
        kinds). The capsule may come from any session, or from a single-session engine of the
        same model: the layout of one session is the same everywhere.

        Runs between steps; does not reallocate; refusals leave the live state unchanged.
        """
        return self._capsules.restore(name, kinds, session)

    def fork(self, source, target, overwrite=False, session=None):
        """Copy capsule `source` (or a session's live state when source is '') to a new name.

        The copy owns its bytes: deleting or overwriting either leaves the other intact.
        """
        return self._capsules.fork(source, target, overwrite, session)

    def rollback(self, steps, session=None):
        """Restore a session's state of `steps` committed steps ago (1 <= steps <=
        rollback_available).

        Copies only the static block; append buffers keep their (unchanged) prefix.
        """
        return self._capsules.rollback(steps, session)

    def delete(self, name):
        """Remove a capsule from the store; the live state is not touched."""
        return self._capsules.delete(name)

    def save(self, name, path=''):
        """Write a capsule file atomically under the capsule directory; result.path holds it."""
        return self._capsules.save(name, path)

    def load(self, path, name='', overwrite=False):
        """Read a capsule file into the store after checking checksum, schema and model.

        The live state is not touched (restore it to make it live), so the ring stays valid.
        """
        return self._capsules.load(path, name, overwrite)

    def reset_episode(self, session=None):
        """Restore 'episode_start' if present, else the initial state, into a session; then
        its episode += 1."""
        return self._capsules.reset_episode(session)
