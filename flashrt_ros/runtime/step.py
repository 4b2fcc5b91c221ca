"""The step program: what one control tick runs on the device, and the buffers it runs over.

One step function, the same on every device: captured as a CUDA graph on CUDA (one per history
span, sharing one graph memory pool), called eagerly on CPU. Inside it: the rollback ring
records every session's pre-step static block, the fed-back previous action is written into
its observation slot, the policy steps (the fleet at once, or session by session), the step
counters advance, the finite flag is computed, and sessions left out of the tick get their
pre-step static block back.

Inputs and outputs are static buffers outside the state, so no capsule holds them: obs
[sessions, obs_dim], out (the actions [sessions, act_dim], then each session's finite flag
[sessions]: one device->host copy and one synchronisation bring back both, and each part is
contiguous on the host, where a fleet's tick reads it) and control [sessions, 2] (active,
tag; tag 0 leaves meta's tag as is). On CUDA each has a pinned host twin, so the
transfers are plain async DMA on the step's stream instead of pageable copies that stall the
host.
"""

import bisect
import contextlib
from functools import partial
import math
from typing import NamedTuple

import numpy as np
import torch

from .enums import Growth
from .errors import InvalidConfig, InvalidObservation
from .graph import probe_determinism, StepGraph
from .inputs import check_finite
from .state import META_EPISODE, META_POSITION, META_STEP, META_TAG


class Feedback(NamedTuple):
    """The previous action fed into an observation slot: (last - offset) * scale, clipped."""
    slot: torch.Tensor          # obs [sessions, size] columns the action is written into
    last: torch.Tensor          # the arena's 'last_action' [sessions, act_dim]
    identity: bool              # scale 1, offset 0, no clip: a plain copy, bit for bit
    scale: torch.Tensor
    offset: torch.Tensor
    clip: tuple | None


class StepProgram:
    """The step buffers, the step function and its graphs for one arena, whose sessions it
    puts in their initial state before capturing.

    batched: step the fleet as one batch (policy.batched); else session by session inside the
    one graph. last_action: (start, size, scale, offset, clip) of the observation slot fed from
    the previous action (the arena then holds 'last_action'), or None. cuda_graph: capture on
    CUDA (else eager); debug: every replay checks that no arena view moved.
    """

    def __init__(self, policy, arena, ring, transfer, batched=False, last_action=None,
                 cuda_graph=True, debug=False):
        if batched and not getattr(policy, 'batched', False):
            raise InvalidConfig(f'batch_sessions: a {getattr(policy, "kind", "")!r} policy of '
                                f'this format steps one session at a time (batches: mlp and '
                                'recurrent policies built from weights, not TorchScript/ONNX '
                                'files or history policies); leave batch_sessions off')
        self.policy, self.arena, self.ring, self.transfer = policy, arena, ring, transfer
        self.batched = bool(batched)
        self.sessions = n = arena.sessions
        self.obs_dim, self.act_dim = int(policy.obs_dim), int(policy.act_dim)
        self.advances = arena.capacity > 0     # history policies move position each step
        self.bind_for_step()
        dev = arena.device
        self._meta = arena['meta']                                  # session 0's counters
        self.meta_all = arena.batched['meta']                       # int64 [sessions, 4]
        self.obs_buf = torch.zeros(n, self.obs_dim, dtype=torch.float32, device=dev)
        self.out_buf = torch.zeros(n * (self.act_dim + 1), dtype=torch.float32, device=dev)
        self.act_buf, self._finite_flag = self._out_parts(self.out_buf)
        self._ctl_buf = torch.zeros(n, 2, dtype=torch.int64, device=dev)
        pin = dev.type == 'cuda'
        self._obs_host = torch.zeros(n, self.obs_dim, dtype=torch.float32, pin_memory=pin)
        self._out_host = torch.zeros(self.out_buf.numel(), dtype=torch.float32, pin_memory=pin)
        self._ctl_host = torch.zeros(n, 2, dtype=torch.int64, pin_memory=pin)
        self.obs_np = self._obs_host.numpy()
        self.act_np, self.finite_np = (t.numpy() for t in self._out_parts(self._out_host))
        self._ctl_np = self._ctl_host.numpy()
        self._ctl_usual = self._ctl_staged = False  # stage_control: the device's control
        self.feedback = None if last_action is None else self._make_feedback(*last_action)
        # What the finite flag covers, per session: the action and the static float buffers
        # but those marked finite_checked=False (the history's append rows are checked when a
        # checkpoint is taken or chosen: PolicyEngine.nonfinite_buffers). One session: its
        # plain views, for one multi-tensor kernel; a fleet: rows of the batched views (a
        # session's part is contiguous).
        static = [name for name, spec in arena.specs.items() if spec.growth == Growth.STATIC
                  and spec.finite_checked and arena.views[name].is_floating_point()
                  and arena.views[name].numel()]
        if n == 1:
            self._finite_over = [self.act_buf[0]] + [arena.views[s] for s in static]
        else:
            self._finite_over = [self.act_buf] + [arena.batched[s].flatten(1) for s in static]
        for index in range(n):
            self.initial_state(index, episode=0)
        self._capture(cuda_graph, debug)

    def _out_parts(self, out):
        """The actions [sessions, act_dim] and the finite flags [sessions] of an out buffer."""
        split = self.sessions * self.act_dim
        return out[:split].view(self.sessions, self.act_dim), out[split:]

    def _make_feedback(self, start, size, scale, offset, clip):
        if size != self.act_dim or not 0 <= start <= self.obs_dim - size:
            raise InvalidConfig(f'last_action slot [{start}, {start + size}) does not fit '
                                f'obs_dim {self.obs_dim} with act_dim {self.act_dim}')
        scale, offset = np.asarray(scale, np.float64), np.asarray(offset, np.float64)
        identity = bool(np.all(scale == 1.0) and np.all(offset == 0.0) and clip is None)
        as_t = partial(torch.tensor, dtype=torch.float32, device=self.arena.device)
        return Feedback(self.obs_buf[:, start:start + size], self.arena.batched['last_action'],
                        identity, as_t(scale), as_t(offset), clip)

    # -- binding -------------------------------------------------------------------------------

    def bind_for_step(self):
        """Bind the policy the way the step runs it: batched views of every session when it
        computes a fleet at once, else session 0's views (the step rebinds per session)."""
        if self.batched:
            self.policy.bind(self.arena.batched, self.sessions)
        else:
            self.policy.bind(self.arena.session_views[0])

    @contextlib.contextmanager
    def bound_to(self, views):
        """The policy bound to one session's own views (reset, prefill), then as the step
        runs it again."""
        self.policy.bind(views)
        try:
            yield self.policy
        finally:
            self.bind_for_step()

    def initial_state(self, index, episode):
        """Session `index`'s initial state: zeros, the policy's own initial values, meta =
        [0, episode, 0, 0]."""
        self.arena.zero_(index)
        views = self.arena.session_views[index]
        with self.bound_to(views) as policy:
            policy.reset_state()
        views['meta'][META_EPISODE] = episode

    # -- the step ------------------------------------------------------------------------------

    def _capture(self, cuda_graph, debug):
        """The step's graphs: captured on CUDA (cuda_graph), eager otherwise. A policy whose
        step cost grows with the history span (spans()) gets one step per span, all in one
        graph memory pool; a tick runs the smallest span covering the position."""
        device = self.arena.device
        enabled = bool(cuda_graph) and device.type == 'cuda'
        if not getattr(self.policy, 'capturable', True):
            # a step with a host-side branch (lerobot_chunk.py: compute a chunk or pop the
            # queue) runs eagerly and captures its own parts
            self.policy.capture(enabled)
            enabled = False
        self.spans = list(getattr(self.policy, 'spans', list)()) or [None]
        self.graphs, pool = [], None
        for span in self.spans:
            graph = StepGraph(partial(self._step_fn, span), device, enabled,
                              state=self.arena.storage, pool=pool,
                              check=self.arena.views if debug else None)
            pool = graph.pool
            self.graphs.append(graph)
        self.graph = self.graphs[-1]            # the whole-capacity step

    @property
    def captured(self):
        return self.graph.captured

    def _step_fn(self, span=None):
        self.ring.record()      # every session's pre-step static block, before any write
        if self.sessions > 1:   # (one session: the tag is written after the replay)
            tag = self._ctl_buf[:, 1]
            meta_tag = self.meta_all[:, META_TAG]
            meta_tag.copy_(torch.where(tag != 0, tag, meta_tag))
        if self.feedback is not None:
            slot, last, identity, scale, offset, clip = self.feedback
            if identity:        # a float32 copy: the slot holds the action bit for bit
                slot.copy_(last)
            else:
                value = (last - offset) * scale
                slot.copy_(value if clip is None else value.clamp(clip[0], clip[1]))
        extra = () if span is None else (span,)
        if self.batched:            # the whole fleet in one computation
            self.policy.step(self.obs_buf, self.act_buf, *extra)
        elif self.sessions == 1:
            self.policy.step(self.obs_buf[0], self.act_buf[0], *extra)
        else:                       # session by session, all inside one graph
            # an eager step (a chunk policy's, the same on every device) leaves out the
            # sessions this tick leaves out: their state is put back below either way, and a
            # chunk computed for one would cost a whole VLA pass, again at every tick
            eager = not getattr(self.policy, 'capturable', True)
            for i, views in enumerate(self.arena.session_views):
                if eager and not self._ctl_np[i, 0]:
                    continue
                self.policy.bind(views)
                self.policy.step(self.obs_buf[i], self.act_buf[i], *extra)
        if self.feedback is not None:
            self.feedback.last.copy_(self.act_buf)
        self.meta_all[:, META_STEP].add_(1)
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
        words = self.ring.words
        words.copy_(torch.where(active, words, self.ring.recorded()))

    def graph_for(self, position):
        """The step for the smallest span that covers `position` (spans ascend)."""
        graphs = self.graphs
        if len(graphs) > 1:
            return graphs[bisect.bisect_right(self.spans, position)]
        return graphs[0]

    def stage_control(self, which, tags):
        """Host side of a tick, before it is issued: which sessions (an index array, or a
        slice) step with which tags (an int64 array, 0: none; None: untagged), whose obs rows
        are staged in obs_np. A fleet's usual tick (every session, untagged) again after
        another stages and copies nothing: the device holds that control already."""
        ctl = self._ctl_np
        if self.sessions > 1:
            every = isinstance(which, slice) and which == slice(None)
            usual = every and tags is None
            if usual and self._ctl_usual:
                return
            if not every:
                ctl[:] = 0
            ctl[which, 0] = 1
            ctl[which, 1] = 0 if tags is None else tags
            self._ctl_usual, self._ctl_staged = usual, True
        elif tags is not None and tags[0]:
            ctl[0, 1] = tags[0]

    def copy_in(self, device_obs=None):
        """The observations into the step's buffer, asynchronous: those staged in obs_np, or
        device_obs (a validated tensor on the device). No state is touched."""
        if device_obs is None:
            self.transfer.copy(self.obs_buf, self._obs_host, 4 * self.obs_np.size)
        else:
            self.obs_buf.copy_(device_obs)

    def actions(self, on_device=False):
        """A copy of the latest tick's actions (its buffers are the next tick's), on the device
        or on the host (numpy's copy there: torch's wakes its thread pool for a fleet's)."""
        return self.act_buf.clone() if on_device else torch.from_numpy(self.act_np.copy())

    def stage(self, obs):
        """A fleet's host observations (shape-checked, as_observations(finite=False)) into
        obs_np and on to the device, checked for NaN / Inf while that copy is in flight: no
        state is touched before the replay. A refusal waits for the copy (obs_np is free)."""
        np.copyto(self.obs_np, obs)
        self.copy_in()
        try:
            return check_finite(obs)
        except InvalidObservation:
            self.transfer.sync()
            raise

    def issue(self, position, tagged, device_obs=None, copied_in=False):
        """Device side of a tick, asynchronous until the caller's sync: the observations in
        (copy_in, unless copied_in), control in, the step for `position`, the tag of a single
        session (tagged), the output back into finite_np and (unless device_obs) act_np."""
        copy, n = self.transfer.copy, self.sessions
        if not copied_in:
            self.copy_in(device_obs)
        if n > 1 and self._ctl_staged:
            copy(self._ctl_buf, self._ctl_host, 16 * n)
            self._ctl_staged = False
        self.graph_for(position).replay()
        if n == 1 and tagged:       # after the replay: the ring holds the previous tag
            copy(self._meta, self._ctl_host, 8, dst_offset=8 * META_TAG, src_offset=8)
        # back to the host: the actions and the flags, or the flags alone when the actions
        # stay on the device (a resident fleet's)
        skip = 0 if device_obs is None else 4 * self.act_buf.numel()
        copy(self._out_host, self.out_buf, 4 * self.out_buf.numel() - skip, skip, skip)

    # -- determinism ---------------------------------------------------------------------------

    def probe_determinism(self, replays):
        """graph.probe_determinism over this program's steps: every span's on CUDA
        (milliseconds); on CPU, whose kernels split no reduction by timing, the
        whole-capacity step only (eager steps cost more there). 'differing' names spans."""
        cuda = self.arena.device.type == 'cuda'
        which = list(range(len(self.graphs)))[0 if cuda else -1:]
        probe = probe_determinism([self.graphs[i] for i in which],
                                  lambda j: self._probe_state(which[j]), self.arena.storage,
                                  self.out_buf, replays)
        probe['differing'] = [self.spans[which[j]] for j in probe['differing']]
        return probe

    def _probe_state(self, i):
        """A state for probe_determinism: random finite floats everywhere, obs too, and the
        position at the end of graph i's span (every key of the span live)."""
        device = self.arena.device
        gen = torch.Generator(device).manual_seed(i)
        for views in self.arena.session_views:
            for v in views.values():
                if v.is_floating_point() and v.numel():
                    v.copy_(torch.randn(v.shape, generator=gen, device=device) * 0.5)
        self.obs_buf.copy_(torch.randn(self.obs_buf.shape, generator=gen, device=device))
        # policy.valid_probe(obs): makes them valid where some inputs are not free floats
        getattr(self.policy, 'valid_probe', lambda obs: None)(self.obs_buf)
        if self.advances:
            span = self.spans[i] or self.arena.capacity
            self.meta_all[:, META_POSITION] = span - 1
