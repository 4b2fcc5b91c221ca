"""PolicyEngine: the committed step boundary, capsule operations and the rollback ring.

One lock serialises step() and every capsule operation, so an operation always sees the state
between two steps. Host mirrors of the meta counters (step_index, episode, position) are
updated deterministically from what each operation did; the step path never reads the device.
"""

import bisect
from collections import deque
from dataclasses import dataclass
from functools import partial
import math
import threading
import time

import numpy as np
import torch

from .capsule import Capsule, CapsuleStore, Manifest, check_compatible
from .errors import (CapacityExceeded, CapsuleExists, InvalidConfig, InvalidObservation,
                     RollbackUnavailable)
from .graph import StepGraph
from .state import BufferSpec, KINDS, META_EPISODE, META_STEP, META_TAG, StateArena
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
    included, on every device. (CUDA events measured the copy alone and cost two records, an
    event wait and elapsed_time: about 12 us per call on the H200 host.)
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
    """depth slots of the static block; slot (meta step % depth) holds the PRE-step block.

    Invariant: the pre-step state of step s lives in slot s % depth until step s + depth
    overwrites it. Append buffers need no copy: a step only writes row `position`, so the prefix
    before an older position is unchanged, and the position itself is in the static block.
    """

    def __init__(self, arena, depth, transfer):
        if depth < 1:
            raise InvalidConfig(f'rollback_depth must be >= 1, got {depth}')
        self.depth = int(depth)
        self.static = arena.static_block()                          # uint8 [static_nbytes]
        self.slots = torch.zeros(self.depth, self.static.numel(), dtype=torch.uint8,
                                 device=arena.storage.device)       # [depth, static_nbytes]
        self.step_view = arena['meta'][META_STEP:META_STEP + 1]     # int64 [1]
        self._transfer = transfer

    def record(self):
        # Device-side slot index and index_copy_: no host sync, so it rides inside the graph.
        self.slots.index_copy_(0, self.step_view % self.depth, self.static.unsqueeze(0))

    def restore(self, step):
        """Put back the pre-step static block of step `step` (the caller checks availability)."""
        n = self.static.numel()
        self._transfer.copy(self.static, self.slots, n, src_offset=(step % self.depth) * n)


class PolicyEngine:
    """Owns policy, arena, step graph, capsule store and rollback ring."""

    def __init__(self, policy, device='cpu', cuda_graph=True, rollback_depth=32,
                 device_budget=1 << 30, host_budget=4 << 30, capsule_dir='capsules',
                 debug=False, last_action=None, signing_key=None, use_cuda_python=True):
        """last_action: (start, size, scale, offset, clip) of an observation slot that the
        step fills from the previous action (ObservationLayout.device_feedback()), or None.
        That action is then state ('last_action' in the arena), restored with a capsule.
        use_cuda_python: issue copies through cuda-python where it imports (Transfer)."""
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
        self.arena = StateArena(specs, self.device)
        self.meta = self.arena['meta']
        self.policy.bind(self.arena.views)
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
        self.obs_buf = torch.zeros(self.obs_dim, dtype=torch.float32, device=self.device)
        self.out_buf = torch.zeros(self.act_dim + 1, dtype=torch.float32, device=self.device)
        self.act_buf = self.out_buf[:self.act_dim]
        self._finite_flag = self.out_buf[self.act_dim:]
        # Pinned host staging on CUDA: the obs/action transfers are then plain async DMA on the
        # step's stream instead of pageable copies that stall the host.
        pin = self.device.type == 'cuda'
        self._obs_host = torch.zeros(self.obs_dim, dtype=torch.float32, pin_memory=pin)
        self._out_host = torch.zeros(self.act_dim + 1, dtype=torch.float32, pin_memory=pin)
        self._obs_np, self._out_np = self._obs_host.numpy(), self._out_host.numpy()
        self._tag_host = torch.zeros(1, dtype=torch.int64, pin_memory=pin)
        self._tag_np = self._tag_host.numpy()
        self.last_step_finite = True    # the flag of the latest step (see verdict in recovery)
        self._advances = self.arena.capacity > 0     # history policies move position each step
        self._lock = threading.Lock()
        self._timer = _Timer(self.transfer)
        self._latencies = deque(maxlen=1024)
        self._snap_count = 0
        self._lineage = ''          # capsule the live state descends from (manifest.parent)
        self.rejected_observations = 0
        self.episode = 0
        self._reinit(episode=0)
        self._ptrs = {n: v.data_ptr() for n, v in self.arena.views.items()}
        if last_action is not None:
            self._feedback = self._make_feedback(*last_action)
        # What the finite flag covers: the action and the static float buffers (the history's
        # append rows are checked when a checkpoint is taken or chosen: nonfinite_buffers).
        self._finite_over = [self.act_buf] + [
            v for n, v in self.arena.views.items() if v.is_floating_point() and v.numel()
            and self.arena.specs[n].growth == 'static']

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

    # -- the step ------------------------------------------------------------------------------

    def _make_feedback(self, start, size, scale, offset, clip):
        if size != self.act_dim or not 0 <= start <= self.obs_dim - size:
            raise InvalidConfig(f'last_action slot [{start}, {start + size}) does not fit '
                                f'obs_dim {self.obs_dim} with act_dim {self.act_dim}')
        scale, offset = np.asarray(scale, np.float64), np.asarray(offset, np.float64)
        identity = bool(np.all(scale == 1.0) and np.all(offset == 0.0) and clip is None)
        as_t = partial(torch.tensor, dtype=torch.float32, device=self.device)
        return (self.obs_buf[start:start + size], self.arena['last_action'], identity,
                as_t(scale), as_t(offset), clip)

    def _step_fn(self, span=None):
        self.ring.record()
        if self._feedback is not None:
            slot, last, identity, scale, offset, clip = self._feedback
            if identity:        # a float32 copy: the slot holds the action bit for bit
                slot.copy_(last)
            else:
                value = (last - offset) * scale
                slot.copy_(value if clip is None else value.clamp(clip[0], clip[1]))
        if span is None:
            self.policy.step(self.obs_buf, self.act_buf)
        else:
            self.policy.step(self.obs_buf, self.act_buf, span)
        if self._feedback is not None:
            self._feedback[1].copy_(self.act_buf)
        self.meta[META_STEP:META_STEP + 1].add_(1)
        # The max-abs norm of a tensor is NaN or Inf exactly when an element is, and never
        # overflows; one multi-tensor kernel covers every buffer.
        norms = torch._foreach_norm(self._finite_over, math.inf)
        self._finite_flag.copy_(torch.isfinite(torch.stack([n.float() for n in norms])).all())

    def _reinit(self, episode):
        """Initial state: zeros, the policy's own initial values, meta = [0, episode, 0, 0]."""
        self.arena.zero_()
        self.policy.reset_state()
        self.meta[META_EPISODE] = episode
        self.step_index, self.episode, self.position = 0, episode, 0
        self.rollback_available = 0
        self._lineage = ''

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

    def step(self, obs, tag=None):
        """Committed boundary: obs [obs_dim] -> action (CPU float32 [act_dim]).

        tag: an int in [1, 2**63) naming the input this step consumes (e.g. a lock-step
        node's sensor stamp), stored in the state (meta) so that a capsule, a rollback or a
        restart knows which input its state has already answered (input_tag()). Refuses
        (InvalidObservation, CapacityExceeded) before touching the state.
        """
        if tag is not None and not (isinstance(tag, int) and 0 < tag < 1 << 63):
            raise InvalidObservation(f'step tag must be an int in [1, 2**63), got {tag!r}')
        with self._lock:
            try:
                t = self._to_obs(obs)
            except InvalidObservation:
                self.rejected_observations += 1
                raise
            if self._advances and self.position >= self.arena.capacity:
                raise CapacityExceeded(
                    f'history is full ({self.arena.capacity} positions); reset the episode, '
                    'restore or roll back')
            self._obs_np[:] = t
            copy = self.transfer.copy
            with self._timer as timer:      # its exit synchronises the device, once
                copy(self.obs_buf, self._obs_host, 4 * self.obs_dim)
                self._graph_for(self.position).replay()
                if tag is not None:     # after the replay: the ring holds the previous tag
                    self._tag_np[0] = tag
                    copy(self.meta, self._tag_host, 8, dst_offset=8 * META_TAG)
                copy(self._out_host, self.out_buf, 4 * (self.act_dim + 1))
            out = self._out_np
            action = torch.from_numpy(out[:self.act_dim].copy())
            self.last_step_finite = bool(out[self.act_dim] == 1.0)
            self._latencies.append(timer.us)
            self.step_index += 1
            self.position += int(self._advances)
            self.rollback_available = min(self.rollback_available + 1, self.ring.depth)
            self._check()
            return action

    def input_tag(self):
        """The tag of the input the live state's latest step consumed (step(tag=)); 0 when
        none. Read from the state itself, so it follows restores, rollbacks and resets."""
        with self._lock:
            return int(self.meta[META_TAG])

    def last_action(self):
        """The previous action held in the state ('last_action', when the engine feeds it
        back), as float32 numpy [act_dim]; None when the state keeps none."""
        with self._lock:
            last = self.arena.views.get('last_action')
            return None if last is None else last.cpu().numpy().copy()

    def _graph_for(self, position):
        """The step for the smallest span that covers `position` (spans ascend)."""
        graphs = self.graphs
        if len(graphs) > 1:
            return graphs[bisect.bisect_right(self.spans, position)]
        return graphs[0]

    def prefill(self, observations):
        """Feed [T, obs_dim] observations into the history (eager); ring is cleared."""
        with self._lock:
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
            if self.position + rows > self.arena.capacity:
                raise CapacityExceeded(
                    f'prefill of {rows} positions at position {self.position} exceeds the '
                    f'capacity {self.arena.capacity}')
            self.policy.prefill(torch.from_numpy(t).to(self.device))
            self.position += rows
            self.rollback_available = 0   # ring slots are indexed by step, prefill is not one
            self._check()

    def nonfinite_buffers(self, name=None, static_only=False):
        """Names of floating-point buffers holding NaN/Inf in the live state (or in capsule
        `name`), live range only; static_only skips the append (history) buffers. Costs one
        reduction per buffer and one device sync."""
        with self._lock:
            if name is None:
                # the live views themselves (this runs every step when the node checks for
                # poison): append buffers sliced to the live prefix, nothing unpacked
                views = {n: v[:self.position] if self.arena.specs[n].growth == 'append' else v
                         for n, v in self.arena.views.items()}
            else:
                m = self.store.get(name).manifest
                views = self.arena.unpack(self.store.data_on(name, self.device), m.position)
            floats = [(n, v) for n, v in views.items() if v.is_floating_point() and not (
                static_only and self.arena.specs[n].growth == 'append')]
            if not floats:
                return []
            flags = torch.stack([torch.isfinite(v).all() for _, v in floats]).tolist()
            return [n for (n, _), ok in zip(floats, flags) if not ok]

    def clear_beyond_position(self):
        """Zeroes the append rows past the live position.

        Normally unneeded: steps mask those rows out. But a NaN/Inf row left there by a
        poisoned step would still reach the output (0 * NaN is NaN), so recovery from a
        poisoned state calls this once. Costs a write of the unused capacity.
        """
        with self._lock:
            self.arena.storage[self.arena.live_nbytes(self.position):].zero_()

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
        meta = self.meta.tolist()
        assert meta[:3] == [self.step_index, self.episode, self.position], (meta, self.step_index)

    # -- capsule operations (all between steps, under the lock) --------------------------------

    def _result(self, message, manifest, us):
        """The OpResult; a manifest's tier as the store reports it (a CPU engine's 'device'
        tier is host memory, so it says 'host', as list_capsules does)."""
        if manifest is not None:
            manifest = self.store.reported(manifest)
        return OpResult(True, message, manifest, us, self.step_index)

    def _take(self, name, overwrite, pin, tier='device'):
        if not name:
            self._snap_count += 1
            name = f'snap-{self.step_index}-{self._snap_count}'
        self.store.validate_name(name)
        if name in self.store and not overwrite:
            raise CapsuleExists(f'capsule {name!r} exists; pass overwrite to replace it')
        # Bookkeeping first, outside the timed window: latency_us is the copy itself.
        data = self._room(name, overwrite, self.arena.live_nbytes(self.position), tier)
        with self._timer as timer:
            self.arena.read_live(self.position, data, self.transfer)
        # No checksum here: it would cost a device->host read on the hot path. It is computed
        # when the capsule is written to disk and checked on every read from disk.
        m = Manifest(name=name, parent=self._lineage, tier=tier, pinned=bool(pin),
                     step=self.step_index, episode=self.episode, position=self.position,
                     nbytes=data.numel(), schema_digest=self.arena.schema_digest,
                     model_digest=self.model_digest, created=time.time())
        self.store.put(Capsule(m, data), overwrite=overwrite)
        return m, timer.us     # manifests are frozen: the caller cannot change the store's

    def _room(self, name, overwrite, nbytes, tier, avoid=None):
        """The bytes a new capsule `name` of `nbytes` in `tier` is copied into."""
        old = self.store.peek(name) if overwrite else None
        if (old is not None and old.manifest.tier == tier and old.data is not None
                and old.data.numel() == nbytes and old.data is not avoid):
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

    def snapshot(self, name='', overwrite=False, pin=False, tier='device'):
        """Copy the live bytes into a new capsule (one copy). The live state is not changed.

        tier: 'device' (default) or 'host' (pinned host memory).
        """
        if tier not in ('device', 'host'):
            raise InvalidConfig(f"snapshot tier must be 'device' or 'host', got {tier!r}")
        with self._lock:
            m, us = self._take(name, overwrite, pin, tier)
            return self._result(f'snapshot {m.name!r}: {m.nbytes} bytes at step {m.step}',
                                m, us)

    def _restore(self, name, kinds=None):
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
                self.arena.write_live(m.position, data, self.transfer)
            else:
                views = self.arena.unpack(data, m.position)
                for n in names:
                    dst = self.arena[n]
                    if self.arena.specs[n].growth == 'append':
                        dst = dst[:m.position]
                    dst.copy_(views[n])
        if kinds is None or 'meta' in kinds:
            self.step_index, self.episode, self.position = m.step, m.episode, m.position
        self.rollback_available = 0
        self._lineage = name
        self._check()
        return m, timer.us

    def restore(self, name, kinds=None):
        """Make the live bytes equal the capsule's (kinds: only buffers of those kinds).

        Runs between steps; does not reallocate; refusals leave the live state unchanged.
        """
        with self._lock:
            m, us = self._restore(name, kinds)
            what = 'all buffers' if kinds is None else f'kinds {sorted(set(kinds))}'
            return self._result(f'restored {name!r} ({what}) to step {m.step}', m, us)

    def fork(self, source, target, overwrite=False):
        """Copy capsule `source` (or the live state when source is '') to a new name.

        The copy owns its bytes: deleting or overwriting either leaves the other intact.
        """
        with self._lock:
            if not source:
                m, us = self._take(target, overwrite, pin=False)
                return self._result(f'forked live state to {target!r}', m, us)
            self.store.validate_name(target)
            capsule = self.store.get(source)
            src = capsule.manifest
            if target in self.store and not overwrite:
                raise CapsuleExists(f'capsule {target!r} exists; pass overwrite to replace it')
            held = self.store.held(capsule)     # from disk: read, verified before any write
            data = self._room(target, overwrite, src.nbytes, 'device', avoid=held)
            with self._timer as timer:
                self.transfer.copy(data, held, src.nbytes)
            m = Manifest(name=target, parent=source, tier='device', pinned=False, step=src.step,
                         episode=src.episode, position=src.position, nbytes=src.nbytes,
                         schema_digest=src.schema_digest, model_digest=src.model_digest,
                         created=time.time())
            self.store.put(Capsule(m, data), overwrite=overwrite)
            return self._result(f'forked {source!r} to {target!r}', m, timer.us)

    def rollback(self, steps):
        """Restore the state of `steps` committed steps ago (1 <= steps <= rollback_available).

        Copies only the static block; append buffers keep their (unchanged) prefix.
        """
        with self._lock:
            if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
                raise RollbackUnavailable(f'rollback needs a whole number of steps >= 1, '
                                          f'got {steps!r}')
            if steps > self.rollback_available:
                raise RollbackUnavailable(
                    f'cannot roll back {steps} steps: {self.rollback_available} available '
                    f'(ring depth {self.ring.depth}; cleared by restore, reset and prefill)')
            target = self.step_index - steps
            with self._timer as timer:
                self.ring.restore(target)
            self.step_index = target
            self.position -= steps * int(self._advances)
            self.rollback_available -= steps
            self._check()
            return self._result(f'rolled back {steps} steps to step {target}', None, timer.us)

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

    def reset_episode(self):
        """Restore 'episode_start' if present, else the initial state; then episode += 1."""
        with self._lock:
            episode = self.episode + 1
            with self._timer as timer:
                if EPISODE_START in self.store:
                    m, _ = self._restore(EPISODE_START)
                else:
                    m = None
                    self._reinit(episode)
                self.meta[META_EPISODE] = episode
            self.episode = episode
            self.rollback_available = 0
            self._check()
            source = repr(EPISODE_START) if m else 'the initial state'
            return self._result(f'episode {episode} started from {source}', m, timer.us)
