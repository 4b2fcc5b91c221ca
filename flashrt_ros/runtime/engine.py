"""PolicyEngine: the committed step boundary, capsule operations and the rollback ring.

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
one: actions then agree with single-session runs to float rounding, not bit for bit, and may
differ in the last bits between sessions given the same state (the row of a product can
change its rounding). Each session's actions still never depend on another session's state.
"""

import bisect
from collections import deque
from dataclasses import dataclass
from functools import partial
import logging
import math
import threading
import time

import numpy as np
import torch

from .capsule import Capsule, CapsuleStore, Manifest, check_compatible
from .errors import (CapacityExceeded, CapsuleExists, InvalidConfig, InvalidObservation,
                     RollbackUnavailable)
from .graph import probe_determinism, StepGraph
from .state import (BufferSpec, KINDS, META_EPISODE, META_POSITION, META_STEP, META_TAG,
                    StateArena)
from .transfer import Transfer

EPISODE_START = 'episode_start'     # the capsule reset_episode() restores


@dataclass
class OpResult:
    ok: bool
    message: str
    manifest: Manifest | None
    latency_us: float
    step: int
    path: str = ''          # the capsule file, for save and load


class _Timer:
    """Wall time of an operation's device work, ended by its one synchronisation.

    The window opens before the copies (or the graph replay) are issued and closes after
    Transfer.sync() returns, so latency_us is what the work costs the caller, issue overhead
    (and any host bookkeeping done while the copy is in flight) included, on every device.
    (CUDA events measured the copy alone and cost two records, an event wait and
    elapsed_time: about 12 us per call on the H200 host.)
    """

    def __init__(self, transfer):
        self._transfer = transfer
        self._depth = 0     # reset_episode times a restore that times itself: outermost wins

    def __enter__(self):
        self._depth += 1
        if self._depth == 1:
            self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self._depth -= 1
        if self._depth:
            self.us = math.nan      # an inner window has no figure of its own
            return False
        self._transfer.sync()
        self.us = (time.perf_counter() - self._t0) * 1e6
        return False


class RollbackRing:
    """depth slots per session of its static block; a session's slot (its meta step % depth)
    holds its PRE-step block.

    Invariant: the pre-step state of a session's step s lives in its slot s % depth until step
    s + depth overwrites it. Append buffers need no copy: a step only writes row `position`, so
    the prefix before an older position is unchanged, and the position itself is in the static
    block. A session left out of a tick has its slot rewritten with its unchanged state, which
    costs it the oldest entry (the engine then offers depth - 1).
    """

    def __init__(self, arena, depth, transfer):
        if depth < 1:
            raise InvalidConfig(f'rollback_depth must be >= 1, got {depth}')
        self.depth = int(depth)
        self.arena = arena
        self.static = arena.static_blocks()                 # uint8 [sessions, static_nbytes]
        sessions, self.nbytes = self.static.shape
        self.slots = torch.zeros(sessions, self.depth, self.nbytes, dtype=torch.uint8,
                                 device=arena.storage.device)
        self.step_view = arena.batched['meta'][:, META_STEP]        # int64 [sessions]
        self._rows = torch.arange(sessions, device=arena.storage.device)
        self._slot = torch.zeros(sessions, dtype=torch.int64, device=arena.storage.device)
        self._transfer = transfer

    def record(self):
        # Device-side slot indices: no host sync, so it rides inside the graph.
        if len(self._rows) == 1:    # one session: one index_copy_ (fewest kernels per step)
            self.slots[0].index_copy_(0, self.step_view % self.depth, self.static)
            return
        torch.remainder(self.step_view, self.depth, out=self._slot)
        self.slots.index_put_((self._rows, self._slot), self.static)

    def recorded(self):
        """[sessions, static_nbytes]: the blocks the latest record() saved (pre-step state;
        sessions > 1)."""
        return self.slots[self._rows, self._slot]

    def restore(self, step, session=0):
        """Put back a session's pre-step static block of step `step` (the caller checks
        availability)."""
        n = self.nbytes
        self._transfer.copy(self.arena.storage, self.slots, n,
                            dst_offset=session * self.arena.block_nbytes,
                            src_offset=(session * self.depth + step % self.depth) * n)


@dataclass
class Session:
    """Host mirrors of one session's counters and lineage (the device holds the truth in
    meta; these follow it deterministically from what each operation did)."""
    index: int
    name: str
    step_index: int = 0
    episode: int = 0
    position: int = 0
    rollback_available: int = 0
    lineage: str = ''       # the capsule the live state descends from (manifest.parent)


class PolicyEngine:
    """Owns policy, arena, step graph, capsule store and rollback ring."""

    def __init__(self, policy, device='cpu', cuda_graph=True, rollback_depth=32,
                 device_budget=1 << 30, host_budget=4 << 30, capsule_dir='capsules',
                 debug=False, last_action=None, signing_key=None, use_cuda_python=True,
                 sessions=1, session_names=None, batch_sessions=False, determinism_probe=3):
        """last_action: (start, size, scale, offset, clip) of an observation slot that the
        step fills from the previous action (ObservationLayout.device_feedback()), or None.
        That action is then state ('last_action' in the arena), restored with a capsule.
        use_cuda_python: issue copies through cuda-python where it imports (Transfer).
        sessions: independent policy states stepped together (step_all); session_names: a
        name for each (default '0', '1', ...), usable wherever a session is addressed.
        batch_sessions: compute the fleet as one batch (see the module notes: faster, not bit
        for bit with single-session runs); only for policies that can (policy.batched)."""
        self.device = torch.device(device)
        self.policy = policy.to(self.device)
        self.debug = debug
        specs = list(policy.state_specs())
        if any(s.name == 'meta' or s.kind == 'meta' for s in specs):
            raise InvalidConfig('policies must not declare meta buffers; the engine adds them')
        specs.append(BufferSpec('meta', (4,), torch.int64, 'meta'))   # step, episode, pos, tag
        self._feedback = None
        if last_action is not None:
            specs.append(BufferSpec('last_action', (int(policy.act_dim),), torch.float32,
                                    'history'))
        self.arena = StateArena(specs, self.device, sessions)
        self.sessions = self.arena.sessions
        names = [str(i) for i in range(self.sessions)] if session_names is None \
            else [str(n) for n in session_names]
        if len(names) != self.sessions or len(set(names)) != len(names) or not all(names):
            raise InvalidConfig(f'session_names must be {self.sessions} distinct non-empty '
                                f'names, got {names}')
        clash = [n for i, n in enumerate(names)
                 if n.isascii() and n.isdigit() and int(n) != i]   # session(): ASCII indices
        if clash:
            raise InvalidConfig(f'session names {clash} read as the index of another session')
        self._sessions = [Session(i, n) for i, n in enumerate(names)]
        self._by_name = {n: s for n, s in zip(names, self._sessions)}
        self.meta = self.arena['meta']          # session 0's counters
        self._meta_all = self.arena.batched['meta']                  # int64 [sessions, 4]
        self._batched = bool(batch_sessions)
        if self._batched and not getattr(policy, 'batched', False):
            raise InvalidConfig(f'batch_sessions: a {getattr(policy, "kind", "")!r} policy of '
                                f'this format steps one session at a time (batches: mlp and '
                                'recurrent policies built from weights, not TorchScript/ONNX '
                                'files or history policies); leave batch_sessions off')
        self._bind_for_step()
        self.transfer = Transfer(self.device, use_cuda_python)
        # signing_key: bytes (capsule.load_signing_key) to sign capsule files and require
        # signatures on load; None: unsigned files, checksums only
        # Jetson-class devices: GPU and CPU share one DRAM (cudaDevAttrIntegrated)
        integrated = self.device.type == 'cuda' and \
            torch.cuda.get_device_properties(self.device).is_integrated
        self.store = CapsuleStore(self.device, device_budget, host_budget, capsule_dir,
                                  signing_key=signing_key, integrated=integrated)
        self.ring = RollbackRing(self.arena, rollback_depth, self.transfer)
        self.model_digest = policy.model_digest()
        self.obs_dim, self.act_dim = int(policy.obs_dim), int(policy.act_dim)
        # Inputs and outputs are static buffers outside the state: not part of any capsule.
        # The output holds the action and, after it, the step's finite flag (1.0 when the
        # action and every static floating-point state buffer are finite, else 0.0): one
        # device->host copy and one synchronisation bring back both.
        # Rows are sessions. Control: per session (active, tag); tag 0 leaves meta's tag as is.
        n, dev = self.sessions, self.device
        self.obs_buf = torch.zeros(n, self.obs_dim, dtype=torch.float32, device=dev)
        self.out_buf = torch.zeros(n, self.act_dim + 1, dtype=torch.float32, device=dev)
        self.act_buf = self.out_buf[:, :self.act_dim]
        self._finite_flag = self.out_buf[:, self.act_dim]
        self._ctl_buf = torch.zeros(n, 2, dtype=torch.int64, device=dev)
        # Pinned host staging on CUDA: the obs/action transfers are then plain async DMA on the
        # step's stream instead of pageable copies that stall the host.
        pin = self.device.type == 'cuda'
        self._obs_host = torch.zeros(n, self.obs_dim, dtype=torch.float32, pin_memory=pin)
        self._out_host = torch.zeros(n, self.act_dim + 1, dtype=torch.float32, pin_memory=pin)
        self._ctl_host = torch.zeros(n, 2, dtype=torch.int64, pin_memory=pin)
        self._obs_np, self._out_np = self._obs_host.numpy(), self._out_host.numpy()
        self._ctl_np = self._ctl_host.numpy()
        self.last_step_finite = True    # the flag of the latest step (see verdict in recovery)
        self.last_finite = np.ones(n, dtype=bool)   # per session, from the latest step_all
        self._advances = self.arena.capacity > 0     # history policies move position each step
        self._lock = threading.Lock()
        self._timer = _Timer(self.transfer)
        self._latencies = deque(maxlen=1024)
        self._snap_count = 0
        self.rejected_observations = 0
        for s in self._sessions:
            self._reinit(s, episode=0)
        self._ptrs = {n: v.data_ptr() for n, v in self.arena.views.items()}
        if last_action is not None:
            self._feedback = self._make_feedback(*last_action)
        # What the finite flag covers, per session: the action and the static float buffers
        # (the history's append rows are checked when a checkpoint is taken or chosen:
        # nonfinite_buffers). One session: its plain views, for one multi-tensor kernel; a
        # fleet: rows of the batched views (a session's part is contiguous).
        static = [name for name, spec in self.arena.specs.items() if spec.growth == 'static'
                  and self.arena.views[name].is_floating_point()
                  and self.arena.views[name].numel()]
        if self.sessions == 1:
            self._finite_over = [self.act_buf[0]] + [self.arena.views[n] for n in static]
        else:
            self._finite_over = [self.act_buf] + [self.arena.batched[n].flatten(1)
                                                  for n in static]

        # Same step function on every device: captured on CUDA, called eagerly on CPU. A
        # policy whose step cost grows with the history span (spans()) gets one step per span,
        # all in one graph memory pool; step() runs the smallest span covering the position.
        enabled = bool(cuda_graph) and self.device.type == 'cuda'
        self.spans = list(getattr(policy, 'spans', list)()) or [None]
        self.graphs, pool = [], None
        for span in self.spans:
            graph = StepGraph(partial(self._step_fn, span), self.device, enabled,
                              state=self.arena.storage, pool=pool,
                              check=self.arena.views if debug else None)
            pool = graph.pool
            self.graphs.append(graph)
        self.graph = self.graphs[-1]            # the whole-capacity step
        self.graph_captured = self.graph.captured
        # determinism: replays of each step from one random state compared bit for bit (graph.
        # probe_determinism); a kernel that is not reproducible is reported, never silent
        self.determinism = {'deterministic': None, 'replays': 0, 'probed': False}
        if determinism_probe:
            # every span's step on CUDA (milliseconds); on CPU, whose kernels split no
            # reduction by timing, the whole-capacity step only (eager steps cost more there)
            which = list(range(len(self.graphs)))[0 if self.device.type == 'cuda' else -1:]
            probe = probe_determinism([self.graphs[i] for i in which],
                                      lambda j: self._probe_state(which[j]), self.arena.storage,
                                      self.out_buf, determinism_probe)
            probe['differing'] = [self.spans[which[j]] for j in probe['differing']]
            self.determinism = {**probe, 'probed': True}
            if not self.determinism['deterministic']:
                logging.getLogger(__name__).warning(
                    'the policy step is not reproducible on %s: %s', self.device,
                    self.determinism)

    def _probe_state(self, i):
        """A state for probe_determinism: random finite floats everywhere, obs too, and the
        position at the end of graph i's span (every key of the span live)."""
        gen = torch.Generator(self.device).manual_seed(i)
        for views in self.arena.session_views:
            for v in views.values():
                if v.is_floating_point() and v.numel():
                    v.copy_(torch.randn(v.shape, generator=gen, device=self.device) * 0.5)
        self.obs_buf.copy_(torch.randn(self.obs_buf.shape, generator=gen, device=self.device))
        if self._advances:
            span = self.spans[i] or self.arena.capacity
            self._meta_all[:, META_POSITION] = span - 1

    # -- the step ------------------------------------------------------------------------------

    def _make_feedback(self, start, size, scale, offset, clip):
        if size != self.act_dim or not 0 <= start <= self.obs_dim - size:
            raise InvalidConfig(f'last_action slot [{start}, {start + size}) does not fit '
                                f'obs_dim {self.obs_dim} with act_dim {self.act_dim}')
        scale, offset = np.asarray(scale, np.float64), np.asarray(offset, np.float64)
        identity = bool(np.all(scale == 1.0) and np.all(offset == 0.0) and clip is None)
        as_t = partial(torch.tensor, dtype=torch.float32, device=self.device)
        return (self.obs_buf[:, start:start + size], self.arena.batched['last_action'],
                identity, as_t(scale), as_t(offset), clip)

    def _bind_for_step(self):
        """Bind the policy the way the step runs it: batched views of every session when it
        computes a fleet at once, else session 0's views (the step rebinds per session)."""
        if self._batched:
            self.policy.bind(self.arena.batched, self.sessions)
        else:
            self.policy.bind(self.arena.session_views[0])

    def _bound_to(self, index):
        """Bind the policy to one session's own views (reset, prefill); _bind_for_step()
        undoes it."""
        self.policy.bind(self.arena.session_views[index])

    def _step_fn(self, span=None):
        self.ring.record()      # every session's pre-step static block, before any write
        if self.sessions > 1:   # (one session: the tag is written after the replay)
            tag = self._ctl_buf[:, 1]
            meta_tag = self._meta_all[:, META_TAG]
            meta_tag.copy_(torch.where(tag != 0, tag, meta_tag))
        if self._feedback is not None:
            slot, last, identity, scale, offset, clip = self._feedback
            if identity:        # a float32 copy: the slot holds the action bit for bit
                slot.copy_(last)
            else:
                value = (last - offset) * scale
                slot.copy_(value if clip is None else value.clamp(clip[0], clip[1]))
        extra = () if span is None else (span,)
        if self._batched:           # the whole fleet in one computation
            self.policy.step(self.obs_buf, self.act_buf, *extra)
        elif self.sessions == 1:
            self.policy.step(self.obs_buf[0], self.act_buf[0], *extra)
        else:                       # session by session, all inside one graph
            for i, views in enumerate(self.arena.session_views):
                self.policy.bind(views)
                self.policy.step(self.obs_buf[i], self.act_buf[i], *extra)
        if self._feedback is not None:
            self._feedback[1].copy_(self.act_buf)
        self._meta_all[:, META_STEP].add_(1)
        # The max-abs norm of a tensor (a row) is NaN or Inf exactly when an element is, and
        # never overflows. One session: one multi-tensor kernel over every buffer; a fleet:
        # one reduction per buffer gives every session's verdict.
        if self.sessions == 1:
            norms = torch._foreach_norm(self._finite_over, math.inf)
            self._finite_flag.copy_(torch.isfinite(torch.stack([n.float() for n in norms])).all())
            return
        norms = [torch.linalg.vector_norm(v, math.inf, dim=1).float() for v in self._finite_over]
        self._finite_flag.copy_(torch.isfinite(torch.stack(norms)).all(0))
        # sessions left out of this tick get their pre-step static block back (from the ring's
        # slot just written): their state, counters included, is unchanged; an append row
        # written at their position lies beyond their live prefix
        active = self._ctl_buf[:, 0:1] != 0
        static = self.ring.static
        static.copy_(torch.where(active, static, self.ring.recorded()))

    def _reinit(self, s, episode):
        """A session's initial state: zeros, the policy's own initial values, meta =
        [0, episode, 0, 0]."""
        self.arena.zero_(s.index)
        self._bound_to(s.index)
        try:
            self.policy.reset_state()
        finally:
            self._bind_for_step()
        self.arena.session_views[s.index]['meta'][META_EPISODE] = episode
        s.step_index, s.episode, s.position = 0, episode, 0
        s.rollback_available = 0
        s.lineage = ''

    # -- sessions ------------------------------------------------------------------------------

    def session(self, key=None):
        """The Session record for an index (int or decimal string) or a name. None or '' is
        the only session of a single-session engine; with several, leaving it out is refused
        (a capsule operation on a guessed robot would change the wrong robot's actions)."""
        if key is None or key == '':
            if self.sessions == 1:
                return self._sessions[0]
            raise InvalidConfig(f'this engine runs {self.sessions} sessions: name one '
                                f'(an index 0..{self.sessions - 1} or a name)')
        if isinstance(key, str) and key in self._by_name:
            return self._by_name[key]
        if isinstance(key, str) and key.isdigit() and not key.isascii():
            # str.isdigit and int() read other scripts' digits ('\u0661', fullwidth '\uff11')
            # and isdigit superscripts int() refuses ('\u00b2'): an index is 0-9 only
            raise InvalidConfig(f'no session {key!r}: an index is written in ASCII digits '
                                f'0-9 (0..{self.sessions - 1}), and no session has that name')
        if isinstance(key, str) and key.isdigit():
            key = int(key)
        if isinstance(key, int) and not isinstance(key, bool) and 0 <= key < self.sessions:
            return self._sessions[key]
        names = ', '.join(s.name for s in self._sessions[:8])
        more = ', ...' if self.sessions > 8 else ''
        raise InvalidConfig(f'no session {key!r}: indices are 0..{self.sessions - 1}, names '
                            f'{names}{more}')

    @property
    def session_names(self):
        return [s.name for s in self._sessions]

    # The single-session view of the counters (session 0 of a multi-session engine).
    step_index = property(lambda self: self._sessions[0].step_index)
    episode = property(lambda self: self._sessions[0].episode)
    position = property(lambda self: self._sessions[0].position)
    rollback_available = property(lambda self: self._sessions[0].rollback_available)

    def _to_obs(self, obs, rows=None):
        """Validate on the host before anything on the device is touched.

        numpy, not torch, on this per-step path: its small-array calls cost about a
        microsecond where a torch CPU op costs several. Returns a float32 ndarray.
        """
        try:
            if torch.is_tensor(obs):
                obs = obs.detach().cpu()
            a = np.asarray(obs, dtype=np.float32)
        except (TypeError, ValueError, RuntimeError) as e:
            raise InvalidObservation(f'observation is not numeric: {e}') from e
        want = (self.obs_dim,) if rows is None else (rows, self.obs_dim)
        if a.shape != want:
            raise InvalidObservation(
                f'observation has shape {a.shape}, expected {want} (obs_dim {self.obs_dim})')
        if not np.isfinite(a).all():
            idx = np.argwhere(~np.isfinite(a))[0].tolist()
            raise InvalidObservation(f'observation holds NaN or Inf (first at index {idx})')
        return a

    def _check_tag(self, tag):
        if tag is not None and not (isinstance(tag, int) and not isinstance(tag, bool)
                                    and 0 < tag < 1 << 63):
            raise InvalidObservation(f'step tag must be an int in [1, 2**63), got {tag!r}')
        return tag or 0

    def step(self, obs, tag=None, session=None):
        """Committed boundary: obs [obs_dim] -> action (CPU float32 [act_dim]).

        tag: an int in [1, 2**63) naming the input this step consumes (e.g. a lock-step
        node's sensor stamp), stored in the state (meta) so that a capsule, a rollback or a
        restart knows which input its state has already answered (input_tag()). Refuses
        (InvalidObservation, CapacityExceeded) before touching the state.
        session: which session steps (the others stay as they are); may be left out with one.
        """
        self._check_tag(tag)
        with self._lock:
            s = self.session(session)
            try:
                t = self._to_obs(obs)
            except InvalidObservation:
                self.rejected_observations += 1
                raise
            self._obs_np[s.index] = t
            out = self._step_locked([s], (tag or 0,))[s.index]
            self.last_step_finite = bool(out[self.act_dim] == 1.0)
            return torch.from_numpy(out[:self.act_dim].copy())

    def step_all(self, obs, active=None, tags=None):
        """One tick for the fleet: obs [sessions, obs_dim] -> actions (CPU float32
        [sessions, act_dim]), one graph replay for every session.

        active: bools [sessions] (default all): sessions left out keep their state bit for
        bit (their rows of obs are ignored but must be finite; their actions are
        meaningless). tags: per session an int in [1, 2**63) or None (see step()).
        last_finite holds each session's finite flag afterwards.
        """
        n = self.sessions
        tags = np.array([self._check_tag(t) for t in (tags if tags is not None else [None] * n)],
                        dtype=np.int64)
        mask = np.ones(n, dtype=bool) if active is None else np.asarray(active, dtype=bool)
        if tags.shape != (n,) or mask.shape != (n,):
            raise InvalidObservation(f'step_all needs {n} tags and {n} active flags, got '
                                     f'{tags.shape[0]} and {mask.shape}')
        with self._lock:
            try:
                t = self._to_obs(obs, rows=n)
            except InvalidObservation:
                self.rejected_observations += 1
                raise
            self._obs_np[:] = t
            sessions = [s for s in self._sessions if mask[s.index]]
            out = self._step_locked(sessions, tags[mask])
            self.last_finite = finite = out[:, self.act_dim] == 1.0
            self.last_step_finite = all(finite[s.index] for s in sessions)
            return torch.from_numpy(out[:, :self.act_dim].copy())

    def _step_locked(self, sessions, tags):
        """Steps `sessions` (Session records; their obs rows are staged) with their tags (0:
        none), in one replay; returns the host output [sessions, act_dim + 1] (actions, then
        each session's finite flag), valid until the next step. Host work kept small: this
        is every control step's path."""
        if not sessions:
            raise InvalidObservation('step_all: no session is active')
        if self._advances:
            full = [s.name for s in sessions if s.position >= self.arena.capacity]
            if full:
                which = '' if self.sessions == 1 else f' (sessions {full})'
                raise CapacityExceeded(
                    f'history is full ({self.arena.capacity} positions){which}; reset the '
                    'episode, restore or roll back')
        copy, n, ctl = self.transfer.copy, self.sessions, self._ctl_np
        if n > 1:
            ctl[:] = 0
            for s, tag in zip(sessions, tags):
                ctl[s.index] = (1, tag)
        elif tags[0]:
            ctl[0, 1] = tags[0]
        position = sessions[0].position if n == 1 else max(s.position for s in sessions)
        with self._timer as timer:      # its exit synchronises the device, once
            copy(self.obs_buf, self._obs_host, 4 * n * self.obs_dim)
            if n > 1:
                copy(self._ctl_buf, self._ctl_host, 16 * n)
            self._graph_for(position).replay()
            if n == 1 and tags[0]:      # after the replay: the ring holds the previous tag
                copy(self.meta, self._ctl_host, 8, dst_offset=8 * META_TAG, src_offset=8)
            copy(self._out_host, self.out_buf, 4 * n * (self.act_dim + 1))
        self._latencies.append(timer.us)
        depth, advance = self.ring.depth, int(self._advances)
        if n > 1:
            for s in self._sessions:    # left out: its ring slot was rewritten unchanged
                s.rollback_available = min(s.rollback_available, depth - 1)
        for s in sessions:
            s.step_index += 1
            s.position += advance
            s.rollback_available = min(s.rollback_available + 1, depth)
        self._check()
        return self._out_np

    def input_tag(self, session=None):
        """The tag of the input the live state's latest step consumed (step(tag=)); 0 when
        none. Read from the state itself, so it follows restores, rollbacks and resets."""
        with self._lock:
            s = self.session(session)
            return int(self.arena.session_views[s.index]['meta'][META_TAG])

    def last_action(self, session=None):
        """The previous action held in the state ('last_action', when the engine feeds it
        back), as float32 numpy [act_dim]; None when the state keeps none."""
        with self._lock:
            s = self.session(session)
            last = self.arena.session_views[s.index].get('last_action')
            return None if last is None else last.cpu().numpy().copy()

    def _graph_for(self, position):
        """The step for the smallest span that covers `position` (spans ascend)."""
        graphs = self.graphs
        if len(graphs) > 1:
            return graphs[bisect.bisect_right(self.spans, position)]
        return graphs[0]

    def prefill(self, observations, session=None):
        """Feed [T, obs_dim] observations into the history (eager); ring is cleared."""
        with self._lock:
            s = self.session(session)
            try:
                if not hasattr(observations, '__len__'):
                    raise InvalidObservation('prefill needs a [T, obs_dim] array of observations')
                rows = len(observations)
                t = self._to_obs(observations, rows=rows)
            except InvalidObservation:
                self.rejected_observations += 1
                raise
            if not self._advances:
                raise InvalidConfig(f'policy kind {self.policy.kind!r} has no history to prefill')
            if s.position + rows > self.arena.capacity:
                raise CapacityExceeded(
                    f'prefill of {rows} positions at position {s.position} exceeds the '
                    f'capacity {self.arena.capacity}')
            self._bound_to(s.index)
            try:
                self.policy.prefill(torch.from_numpy(t).to(self.device))
            finally:
                self._bind_for_step()
            s.position += rows
            s.rollback_available = 0   # ring slots are indexed by step, prefill is not one
            self._check()

    def nonfinite_buffers(self, name=None, static_only=False, session=None):
        """Names of floating-point buffers holding NaN/Inf in the live state (or in capsule
        `name`), live range only; static_only skips the append (history) buffers. Costs one
        reduction per buffer and one device sync."""
        with self._lock:
            if name is None:
                # the live views themselves (this runs every step when the node checks for
                # poison): append buffers sliced to the live prefix, nothing unpacked
                s = self.session(session)
                views = {n: v[:s.position] if self.arena.specs[n].growth == 'append' else v
                         for n, v in self.arena.session_views[s.index].items()}
            else:
                m = self.store.get(name).manifest
                views = self.arena.unpack(self.store.data_on(name, self.device), m.position)
            floats = [(n, v) for n, v in views.items() if v.is_floating_point() and not (
                static_only and self.arena.specs[n].growth == 'append')]
            if not floats:
                return []
            flags = torch.stack([torch.isfinite(v).all() for _, v in floats]).tolist()
            return [n for (n, _), ok in zip(floats, flags) if not ok]

    def clear_beyond_position(self, session=None):
        """Zeroes the append rows past the live position.

        Normally unneeded: steps mask those rows out. But a NaN/Inf row left there by a
        poisoned step would still reach the output (0 * NaN is NaN), so recovery from a
        poisoned state calls this once. Costs a write of the unused capacity.
        """
        with self._lock:
            s = self.session(session)
            self.arena.blocks[s.index][self.arena.live_nbytes(s.position):].zero_()

    def step_latency_us(self):
        """(p50, p99) over recent steps; NaN before the first step."""
        if not self._latencies:
            return math.nan, math.nan
        xs = sorted(self._latencies)
        return xs[len(xs) // 2], xs[min(len(xs) - 1, math.ceil(0.99 * len(xs)) - 1)]

    def _check(self):
        """Debug mode: addresses never move and host mirrors match the device counters."""
        if not self.debug:
            return
        for n, v in self.arena.views.items():
            assert v.data_ptr() == self._ptrs[n], f'buffer {n} moved'
        for s, meta in zip(self._sessions, self._meta_all.tolist()):
            assert meta[:3] == [s.step_index, s.episode, s.position], (s, meta)

    # -- capsule operations (all between steps, under the lock) --------------------------------

    def _result(self, message, manifest, us, s=None):
        """The OpResult; a manifest's tier as the store reports it (a CPU engine's 'device'
        tier is host memory, so it says 'host', as list_capsules does). step: the session's
        step (session 0's when the operation concerns none)."""
        if manifest is not None:
            manifest = self.store.reported(manifest)
        step = (s or self._sessions[0]).step_index
        return OpResult(True, message, manifest, us, step)

    def _take(self, name, overwrite, pin, tier, s):
        if not name:
            self._snap_count += 1
            name = f'snap-{s.step_index}-{self._snap_count}'
        self.store.validate_name(name)
        if name in self.store and not overwrite:
            raise CapsuleExists(f'capsule {name!r} exists; pass overwrite to replace it')
        data = self._room(name, overwrite, self.arena.live_nbytes(s.position), tier)
        with self._timer as timer:
            self.arena.read_live(s.position, data, self.transfer, s.index)
            # The copy is asynchronous: the manifest and the store's bookkeeping run on the
            # host while it is in flight, and the window's one synchronisation ends both. (A
            # refused put frees fresh bytes only: overwriting in place cannot be refused.)
            # No checksum here: it would cost a device->host read on the hot path. It is
            # computed when the capsule is written to disk and checked on every read from disk.
            m = Manifest(name=name, parent=s.lineage, tier=tier, pinned=bool(pin),
                         step=s.step_index, episode=s.episode, position=s.position,
                         nbytes=data.numel(), schema_digest=self.arena.schema_digest,
                         model_digest=self.model_digest, created=time.time())
            self.store.put(Capsule(m, data), overwrite=overwrite)
        return m, timer.us     # manifests are frozen: the caller cannot change the store's

    def _room(self, name, overwrite, nbytes, tier, avoid=None):
        """The bytes a new capsule `name` of `nbytes` in `tier` is copied into."""
        old = self.store.peek(name) if overwrite else None
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
        on_device = tier == 'device' or self.store.integrated
        return torch.empty(nbytes, dtype=torch.uint8,
                           device=self.device if on_device else 'cpu',
                           pin_memory=not on_device and self.device.type == 'cuda')

    def _of(self, s):
        """' of session <name>' in a multi-session engine's messages, else ''."""
        return '' if self.sessions == 1 else f' of session {s.name!r}'

    def snapshot(self, name='', overwrite=False, pin=False, tier='device', session=None):
        """Copy a session's live bytes into a new capsule (one copy). The live state is not
        changed.

        tier: 'device' (default) or 'host' (pinned host memory).
        """
        if tier not in ('device', 'host'):
            raise InvalidConfig(f"snapshot tier must be 'device' or 'host', got {tier!r}")
        with self._lock:
            s = self.session(session)
            m, us = self._take(name, overwrite, pin, tier, s)
            return self._result(f'snapshot {m.name!r}{self._of(s)}: {m.nbytes} bytes at step '
                                f'{m.step}', m, us, s)

    def _restore(self, name, kinds, s):
        capsule = self.store.get(name)
        m = capsule.manifest
        check_compatible(m, self.arena.schema_digest, self.model_digest)
        if kinds is not None:
            kinds = set(kinds)
            unknown = kinds - set(KINDS)
            if unknown:
                raise InvalidConfig(f'unknown kinds {sorted(unknown)}; kinds are {KINDS}')
            names = [n for n, s in self.arena.specs.items() if s.kind in kinds]
            if not names:
                raise InvalidConfig(f'the state has no buffers of kinds {sorted(kinds)}')
        if kinds is None:
            # Device or host tier: one copy from where the bytes are (pinned host memory
            # straight into the arena). Disk: read and verified here, before any write.
            data = self.store.held(capsule)
        else:
            data = self.store.data_on(name, self.device)
        with self._timer as timer:
            if kinds is None:
                self.arena.write_live(m.position, data, self.transfer, s.index)
            else:
                views = self.arena.unpack(data, m.position)
                for n in names:
                    dst = self.arena.session_views[s.index][n]
                    if self.arena.specs[n].growth == 'append':
                        dst = dst[:m.position]
                    dst.copy_(views[n])
            # host counters while the copy is in flight (nothing below can fail)
            if kinds is None or 'meta' in kinds:
                s.step_index, s.episode, s.position = m.step, m.episode, m.position
            s.rollback_available = 0
            s.lineage = name
        self._check()
        return m, timer.us

    def restore(self, name, kinds=None, session=None):
        """Make a session's live bytes equal the capsule's (kinds: only buffers of those
        kinds). The capsule may come from any session, or from a single-session engine of the
        same model: the layout of one session is the same everywhere.

        Runs between steps; does not reallocate; refusals leave the live state unchanged.
        """
        with self._lock:
            s = self.session(session)
            m, us = self._restore(name, kinds, s)
            what = 'all buffers' if kinds is None else f'kinds {sorted(set(kinds))}'
            return self._result(f'restored {name!r} ({what}){self._of(s)} to step {m.step}',
                                m, us, s)

    def fork(self, source, target, overwrite=False, session=None):
        """Copy capsule `source` (or a session's live state when source is '') to a new name.

        The copy owns its bytes: deleting or overwriting either leaves the other intact.
        """
        with self._lock:
            if not source:
                s = self.session(session)
                m, us = self._take(target, overwrite, False, 'device', s)
                return self._result(f'forked live state{self._of(s)} to {target!r}', m, us, s)
            self.store.validate_name(target)
            capsule = self.store.get(source)
            src = capsule.manifest
            if target in self.store and not overwrite:
                raise CapsuleExists(f'capsule {target!r} exists; pass overwrite to replace it')
            held = self.store.held(capsule)     # from disk: read, verified before any write
            data = self._room(target, overwrite, src.nbytes, 'device', avoid=held)
            with self._timer as timer:
                self.transfer.copy(data, held, src.nbytes)
                # bookkeeping while the copy is in flight, as in _take
                m = Manifest(name=target, parent=source, tier='device', pinned=False,
                             step=src.step, episode=src.episode, position=src.position,
                             nbytes=src.nbytes, schema_digest=src.schema_digest,
                             model_digest=src.model_digest, created=time.time())
                self.store.put(Capsule(m, data), overwrite=overwrite)
            return self._result(f'forked {source!r} to {target!r}', m, timer.us)

    def rollback(self, steps, session=None):
        """Restore a session's state of `steps` committed steps ago (1 <= steps <=
        rollback_available).

        Copies only the static block; append buffers keep their (unchanged) prefix.
        """
        with self._lock:
            s = self.session(session)
            if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
                raise RollbackUnavailable(f'rollback needs a whole number of steps >= 1, '
                                          f'got {steps!r}')
            if steps > s.rollback_available:
                raise RollbackUnavailable(
                    f'cannot roll back {steps} steps{self._of(s)}: {s.rollback_available} '
                    f'available (ring depth {self.ring.depth}; cleared by restore, reset and '
                    'prefill)')
            target = s.step_index - steps
            with self._timer as timer:
                self.ring.restore(target, s.index)
                s.step_index = target       # host counters while the copy is in flight
                s.position -= steps * int(self._advances)
                s.rollback_available -= steps
            self._check()
            return self._result(f'rolled back {steps} steps{self._of(s)} to step {target}',
                                None, timer.us, s)

    def delete(self, name):
        """Remove a capsule from the store; the live state is not touched."""
        with self._lock:
            m = self.store.get(name).manifest
            self.store.delete(name)
            return self._result(f'deleted {name!r}', m, 0.0)

    def save(self, name, path=''):
        """Write a capsule file atomically under the capsule directory; result.path holds it."""
        with self._lock:
            t0 = time.perf_counter()   # disk I/O is host work: wall time, not device events
            full, size = self.store.save(name, path)
            us = (time.perf_counter() - t0) * 1e6
            m = self.store.get(name).manifest
            result = self._result(f'saved {name!r} to {full} ({size} bytes)', m, us)
            result.path = full
            return result

    def load(self, path, name='', overwrite=False):
        """Read a capsule file into the store after checking checksum, schema and model.

        The live state is not touched (restore it to make it live), so the ring stays valid.
        """
        with self._lock:
            t0 = time.perf_counter()
            m = self.store.load(path, name, overwrite, schema_digest=self.arena.schema_digest,
                                model_digest=self.model_digest)
            us = (time.perf_counter() - t0) * 1e6
            result = self._result(f'loaded {m.name!r} from {path}', m, us)
            result.path = self.store.resolve(path)
            return result

    def reset_episode(self, session=None):
        """Restore 'episode_start' if present, else the initial state, into a session; then
        its episode += 1."""
        with self._lock:
            s = self.session(session)
            episode = s.episode + 1
            with self._timer as timer:
                if EPISODE_START in self.store:
                    m, _ = self._restore(EPISODE_START, None, s)
                else:
                    m = None
                    self._reinit(s, episode)
                self.arena.session_views[s.index]['meta'][META_EPISODE] = episode
            s.episode = episode
            s.rollback_available = 0
            self._check()
            source = repr(EPISODE_START) if m else 'the initial state'
            return self._result(f'episode {episode}{self._of(s)} started from {source}', m,
                                timer.us, s)
