'''Real-time chunking (RTC: Black, Galliker and Levine 2025, as LeRobot implements it) for the
flow-matching VLAs on the engine: SmolVLA, Pi0 and Pi0.5 (lerobot_chunk.py says how the chunk
policies work, lerobot_prefix.py how their prefix is kept).

Without it a chunk is computed when the queue runs empty, and the robot waits for it. With it
(rtc_delay d >= 0), once rtc_queue_threshold actions are left the step launches the next
chunk's computation from its observation and goes on playing the queue; d steps later the new
chunk lands and replaces the queue, its first d actions dropped (the robot played the old
queue's meanwhile). The new chunk is guided toward what was left of the old one (LeRobot's
RTCProcessor.denoise_step, called as sample_actions calls it), so the two join smoothly. This
is LeRobot's real-robot RTC loop (examples/rtc/eval_with_real_robot.py: an ActionQueue in RTC
mode, the whole chunk queued) with the delay fixed instead of measured, so that the actions
are a function of the observations alone and replay exactly. Choose d of at least the chunk's
latency in control periods (the README's figures, or a benchmark on the robot's computer).

On CUDA the computation is a captured graph replayed on a side stream, so the steps in between
return at once; on the CPU it runs at the launch. The actions are the same either way. A
fleet's sessions share the graphs and the side stream: their flights queue there one behind
another, each with its own copy of its inputs and outputs. A launch waits for none of them; a
landing waits for its own flight, and so for those queued before it (a fleet's rtc_delay must
cover them); an episode's first chunk, computed at once in the graphs, waits for them all.

State, all in the arena (capsules, rollback and restarts hold it): the queue holds the whole
chunk, unnormalised and as the model gave it ('original', whose rest guides the next chunk);
'left' is [actions left, steps until the in-flight chunk lands (-1: none), 1 if this step
landed one]; the in-flight chunk's inputs are its observation and rng counter (flight_obs,
flight_rng; what is left of 'original' does not change until it lands). A capsule taken while a
chunk is in flight holds those inputs, not the chunk: at landing the inputs the computation ran
on are compared with the state's, bit for bit, and where they differ (the state was restored,
rolled back or loaded since the launch) the chunk is computed again from the state's,
synchronously. So a chunk lands at the same step with the same bits whatever happened in
between.

The first chunk of an episode (nothing queued) is computed at once, unguided, and nothing of
it is dropped: the robot has nothing to play meanwhile.
'''

import contextlib
from typing import NamedTuple

import torch

from ..config import RTC_SCHEDULES
from ..errors import InvalidConfig
from ..graph import StepGraph
from ..state import BufferSpec
from .lerobot_chunk import copied
from .lerobot_prefix import KeptPrefixPolicy, PREFIX

RTC_OPTIONS = ('rtc_delay', 'rtc_queue_threshold', 'rtc_execution_horizon', 'rtc_schedule',
               'rtc_max_guidance_weight')


class Flight(NamedTuple):
    '''A guided chunk launched for a session: whether it kept the prefix, the inputs it ran
    on (observation, rng counter, what was left of the old chunk), its outputs, and the event
    after them on the side stream (None on the CPU).'''
    kept: bool
    inputs: tuple
    out: dict
    done: object


class RealTimeChunkPolicy(KeptPrefixPolicy):
    '''A kept-prefix VLA that can compute its next chunk while the queue plays (setup_rtc).'''

    rtc = None              # LeRobot's RTCProcessor when real-time chunking is on
    checkpoint_options = KeptPrefixPolicy.checkpoint_options + RTC_OPTIONS
    _guidance = {}          # the RTC arguments while a guided graph is built (_denoise reads)

    def setup_rtc(self, rtc_delay=-1, rtc_queue_threshold=0, rtc_execution_horizon=10,
                  rtc_schedule='linear', rtc_max_guidance_weight=10.0):
        '''Real-time chunking with these settings (the node's rtc_* parameters); rtc_delay -1:
        off. Called by the subclass's constructor; InvalidConfig for settings that cannot
        work, before anything changes.'''
        own = getattr(self.lerobot.config, 'rtc_config', None)
        if own is not None and own.enabled:
            raise InvalidConfig(f'{self.kind}: the checkpoint enables real-time chunking in '
                                'its config; the node sets it (rtc_delay, rtc_queue_threshold, '
                                '...): save the checkpoint with rtc_config null')
        if rtc_delay < 0:
            given = {k: v for k, v, off in (('rtc_queue_threshold', rtc_queue_threshold, 0),
                                            ('rtc_execution_horizon', rtc_execution_horizon, 10),
                                            ('rtc_schedule', rtc_schedule, 'linear'),
                                            ('rtc_max_guidance_weight', rtc_max_guidance_weight,
                                             10.0)) if v != off}
            if given:       # (ignored, they would leave the robot waiting at every chunk)
                raise InvalidConfig(f'{self.kind}: {given} set, but real-time chunking is off '
                                    '(rtc_delay -1): set rtc_delay to turn it on')
            return
        d, threshold, chunk = int(rtc_delay), int(rtc_queue_threshold), self.chunk
        if not (1 <= threshold and d <= threshold < chunk - d):
            # the old queue must last the d steps of the computation, and a landed chunk must
            # hold more than the threshold (else it would launch the next at once)
            raise InvalidConfig(
                f'{self.kind}: real-time chunking needs rtc_delay <= rtc_queue_threshold < '
                f'chunk_size - rtc_delay and a threshold >= 1; got delay {d}, threshold '
                f'{threshold}, chunk_size {chunk}')
        if rtc_schedule not in RTC_SCHEDULES or not rtc_execution_horizon >= 1 or \
                not rtc_max_guidance_weight > 0:
            raise InvalidConfig(f'{self.kind}: rtc_schedule {rtc_schedule!r} (one of '
                                f'{RTC_SCHEDULES}), rtc_execution_horizon '
                                f'{rtc_execution_horizon} (>= 1), rtc_max_guidance_weight '
                                f'{rtc_max_guidance_weight} (> 0)')
        from lerobot.configs.types import RTCAttentionSchedule
        from lerobot.policies.rtc.configuration_rtc import RTCConfig
        from lerobot.policies.rtc.modeling_rtc import RTCProcessor
        self.rtc = RTCProcessor(RTCConfig(
            enabled=True, prefix_attention_schedule=RTCAttentionSchedule(rtc_schedule.upper()),
            max_guidance_weight=float(rtc_max_guidance_weight),
            execution_horizon=int(rtc_execution_horizon)))
        self.delay, self.threshold = d, threshold
        self.steps = chunk          # the whole chunk is queued (LeRobot's ActionQueue)
        # inference only: no autograd graph through the weights (RTC's guidance takes the
        # gradient with respect to x_t alone, which does not go through them)
        self.lerobot.requires_grad_(False)

    def config(self):
        cfg, rtc = super().config(), self.rtc
        if rtc is not None:
            c = rtc.rtc_config
            cfg['rtc'] = (self.delay, self.threshold, c.execution_horizon,
                          c.prefix_attention_schedule.value, c.max_guidance_weight)
        return cfg

    def state_specs(self):
        specs = super().state_specs()
        if self.rtc is None:
            return specs
        chunk = (self.chunk, self.act_dim)
        return [s for s in specs if s.name != 'left'] + [
            BufferSpec('left', (3,), torch.int64, 'chunk'),
            BufferSpec('original', chunk, torch.float32, 'chunk'),
            BufferSpec('flight_obs', (self.obs_dim,), torch.float32, 'chunk'),
            BufferSpec('flight_rng', (2,), torch.int64, 'chunk')]

    @torch.no_grad()
    def reset_state(self):
        super().reset_state()
        if self.rtc is not None:
            self.views['left'][1] = -1          # no chunk in flight

    def capture(self, enabled):
        '''The unguided graphs (KeptPrefixPolicy.capture) and, for real-time chunking, the
        guided ones (the whole chunk, and the denoising steps alone), which read what is left
        of the old chunk from a static buffer.'''
        if getattr(self, '_side', None) is not None:     # flights may still use the old
            self._wait()                                    # graphs' buffers
        super().capture(enabled)
        if self.rtc is None:
            return
        dev = self.device
        self._leftover = torch.zeros(self.threshold, self.act_dim, device=dev)
        self._guided_out = {}
        self._guided = {
            False: StepGraph(lambda: self._guided_fn(False), dev, enabled, host_constants=True),
            True: StepGraph(lambda: self._guided_fn(True), dev, enabled, host_constants=True)}
        on_gpu = self._guided[False].captured
        self._side = torch.cuda.Stream(dev) if on_gpu else None
        self._flights = {}      # session (_session) -> its chunk launched and not landed

    def _chunk_outputs(self, actions):
        '''With real-time chunking also the whole chunk as the model gave it ('original': the
        next chunk is guided toward what is left of it).'''
        out = super()._chunk_outputs(actions)
        if self.rtc is not None:
            out['original'] = actions[0, :, :self.act_dim]
        return out

    @torch.no_grad()
    def _guided_fn(self, kept):
        '''A guided chunk (kept: its denoising steps alone, against the static prefix); its
        outputs stay in self._guided_out[kept] until the next replay.'''
        self._guidance = {'rtc_processor': self.rtc, 'rtc_enabled': True,
                          'inference_delay': self.delay, 'prev_chunk_left_over': self._leftover}
        try:
            batch = self._inputs(self._chunk_obs)
            out = self._denoise(batch) if kept else self._chunk(batch)
        finally:
            self._guidance = {}
        self._guided_out[kept] = out

    @torch.no_grad()
    def step(self, obs, action):
        if self.rtc is None:
            return super().step(obs, action)
        v, chunk = self.views, self.chunk
        left, landing, _ = v['left'].tolist()       # one read of the device
        landed = 0
        if landing == 0:
            self._land()
            left, landing, landed = chunk - self.delay, -1, 1
        if landing < 0 and left <= self.threshold:
            if left == 0:       # nothing queued (an episode's start): at once, unguided
                self._wait()        # the graphs are free of every flight
                self._flights.pop(self._session(), None)
                self._store(self._replay(obs), None)
                left, landed = chunk, 1
            else:
                v['flight_obs'].copy_(obs)
                v['flight_rng'].copy_(v['rng'])
                self._flights[self._session()] = self._launch(obs, v['rng'])
                v['rng'][1:2].add_(1)           # the next chunk's noise
                landing = self.delay
                if landing == 0:
                    self._land()
                    left, landing, landed = chunk, -1, 1
        action.copy_(v['queue'][chunk - left])
        v['left'].copy_(torch.tensor([left - 1, landing - 1 if landing > 0 else landing,
                                      landed]))

    def _wait(self, flight=None):
        '''The current stream waits for a flight's work on the side stream (None: all of it,
        every session's).'''
        if self._side is None:
            return
        current = torch.cuda.current_stream(self.device)
        if flight is None:
            current.wait_stream(self._side)
        else:
            current.wait_event(flight.done)

    def _launch(self, obs, rng):
        '''The guided chunk of obs and rng (the session's counter), as a Flight. On CUDA it is
        queued on the side stream behind the other sessions' flights (the graphs are shared,
        so they run one after another) and the host does not wait: the flight's inputs are
        copied here (the session's buffers may change before the side stream reads them) and
        its outputs copied there, after its replay, for its landing alone to wait on. On the
        CPU it runs here. The prefix is kept where lerobot_prefix.py says.'''
        v, side = self.views, self._side
        kept = self._prefix_is(obs)
        inputs = (obs.clone(), rng.clone(), v['original'][self.chunk - self.threshold:].clone())
        prefix = {name: v[name].clone() for name in PREFIX} if kept else {}
        if side is not None:
            side.wait_stream(torch.cuda.current_stream(self.device))
            for t in (*inputs, *prefix.values()):   # read there: not reused before it has
                t.record_stream(side)
        with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
            if kept:
                self._use_kept_prefix(prefix)
            for graph_input, t in zip((self._chunk_obs, self._chunk_rng, self._leftover),
                                      inputs):
                graph_input.copy_(t)
            self._guided[kept].replay()
            out = {n: t.clone() for n, t in self._guided_out[kept].items()}
            done = torch.cuda.Event() if side is not None else None
            if done is not None:
                done.record(side)
        return Flight(kept, inputs, out, done)

    def _session(self):
        '''Which session the policy is bound to (its 'left' buffer's address).'''
        return self.views['left'].data_ptr()

    def _land(self):
        '''Put the session's in-flight chunk into the queue if it ran on the state's inputs
        bit for bit (waiting for it and the flights queued before it, no later one), else
        the chunk computed again from them, here.'''
        v = self.views
        flight = self._flights.pop(self._session(), None)
        # its inputs are copies on this stream: checked without waiting for it, and a stale
        # one (the state restored since) is not waited for
        if flight is None or not self._ran_on(flight.kept, *flight.inputs):
            flight = self._launch(v['flight_obs'], v['flight_rng'])
        self._wait(flight)
        if self._side is not None:          # read here: not reused before it has
            for t in flight.out.values():
                t.record_stream(torch.cuda.current_stream(self.device))
        self._store(flight.out, None if flight.kept else v['flight_obs'])
        self.prefix_reused += flight.kept

    def _ran_on(self, kept, obs, rng, leftover):
        '''Whether a chunk ran on the session's in-flight inputs, bit for bit; one that kept
        the prefix, also whether the state's prefix is still the flight's (a restore of kinds
        [kv] meanwhile replaced it: computed again, the state ends as a fresh engine's would).'''
        v, bits = self.views, (lambda t: t.view(torch.int32))
        same = (bits(obs) == bits(v['flight_obs'])).all() & (rng == v['flight_rng']).all() \
            & (bits(leftover) == bits(v['original'][self.chunk - self.threshold:])).all()
        if kept:
            same &= self._prefix_from(v['flight_obs'])
        return bool(same)

    def _store(self, out, prefix_obs):
        '''A chunk's outputs into the session's state; prefix_obs: the observation whose
        prefix they hold (None: the prefix was kept, or _replay keeps it).'''
        v = self.views
        for name, value in out.items():
            v[name].copy_(value)
        if prefix_obs is not None:
            v['prefix_obs'].copy_(prefix_obs)
            v['prefix_ready'].fill_(1)

    def fresh_chunk(self, views):
        '''The actions from this step's on (numpy [n, act_dim]) when this step landed a chunk,
        else None (real-time chunking; else as LeRobotChunkPolicy gives it).'''
        if self.rtc is None:
            return super().fresh_chunk(views)
        left, _, landed = views['left'].tolist()    # one read of the device, not two
        return self._from(views, left) if landed else None

    def chunk_left(self, views):
        if self.rtc is None:
            return super().chunk_left(views)
        return self._from(views, int(views['left'][0]))

    def _from(self, views, left):
        '''The queue's actions from the latest step's on, `left` of them still to come.'''
        return copied(views['queue'][self.chunk - left - 1:])
