'''The prefix kept where that is exact, for LeRobot's flow-matching VLAs (SmolVLA, Pi0, Pi0.5;
lerobot_chunk.py says how the chunk policies work). A chunk's computation is a prefix pass (the
cameras and the instruction, and SmolVLA's state, through the VLM into a KV cache of every
layer) and then the denoising steps of the action expert against that cache.

The arena keeps the cache of the session's last chunk, its pad mask, and the observation it
came from (prefix_obs, kind 'kv' with the cache). A chunk whose observation equals that one bit
for bit (-0.0 is not 0.0 here) runs the denoising steps alone against the kept cache, a second
captured graph: the same kernels on the same bytes as the whole chunk, so the same actions,
for one more read of the device per chunk. That happens when a robot stands still, and at an
episode start that looks like one before it (a simulator reset, whose first observation
repeats) once the 'kv' buffers of a capsule taken after that start's first chunk are restored:
the prefix pass is skipped.

Both paths denoise from static buffers (_cache), which the whole chunk fills from its prefix
pass and the denoising steps alone fill from the session's arena views. A subclass gives
_prefix(batch) -> ([(keys, values)] per layer, pad mask [1, S]) and _denoise(batch) -> the
chunk's outputs ({'queue': ...}) against self._cache.

denoise_kernels 'compiled' (opt-in; the default 'lerobot' runs LeRobot's modules as they are):
LeRobot's denoise_step, one flow-matching step of the action expert, compiled by
torch.compile (inductor) before the graphs are captured. The denoising steps are some thousand
small kernels a chunk, most of a chunk's time on a GPU; inductor fuses them (on the H200,
SmolVLA's chunk graph 37.9 -> 24.8 ms, README). Its deterministic mode is on: no benchmarking that
could pick other reduction orders in another process, so the actions stay a function of the
inputs, replay after replay and process after process (tested). They are no longer LeRobot's
bit for bit: off by float rounding (measured in the README; a trained checkpoint must be
measured, benchmarks/vla.py --denoise-kernels). The first chunk compiles (about a minute on
the H200, at configure on CUDA); inductor's cache makes the next configure faster.

prefix_kernels 'compiled' (opt-in, the same way): the prefix pass's two heavy parts compiled
alike, the VLM over the prefix (at this call site only: the denoising steps keep their own
kernels) and LeRobot's embed_image (the vision tower and its projection, which only the prefix
pass calls). LeRobot's embed_prefix embeds the cameras one at a time; here every camera's image
goes through the vision tower in one batch, one compiled call, and embed_prefix is handed each
camera's features in its order (checked): its own code does the rest. The vision tower's
matmuls are then a few large ones instead of a small one per camera (_embed_prefix). The kept
prefix (kind 'kv') is then no longer LeRobot's bit for bit either, and a capsule of the other
prefix kernels is refused (config()). With 'lerobot' the prefix pass keeps LeRobot's kernels
whatever the denoising steps run.
'''

import torch

from ..errors import InvalidConfig
from ..graph import StepGraph
from ..state import BufferSpec
from .lerobot_chunk import LanguageChunkPolicy

PREFIX = ('prefix_k', 'prefix_v', 'prefix_pad')     # the static buffers both graphs read
KERNELS = ('lerobot', 'compiled')
# denoise_kernels: the expert's steps on a computation of our own (pi05_expert.py,
# smolvla_expert.py; every kind here defines fused_expert)
FUSED = 'fused'


def check_kernels(kind, denoise='lerobot', prefix='lerobot', rtc_delay=-1, amp=False,
                  cast=None):
    '''InvalidConfig for denoise_kernels / prefix_kernels values that cannot work (before
    anything changes). amp: the checkpoint's use_amp, which only LeRobot's own kernels run as
    LeRobot's scripts do (autocast); cast: the option that casts a part to bfloat16, if set.'''
    other = [f'{o} {k}' for o, k in (('denoise_kernels', denoise), ('prefix_kernels', prefix))
             if k != 'lerobot'] + [cast] * bool(cast) + ['rtc_delay'] * (rtc_delay >= 0)
    if amp and other:
        raise InvalidConfig(f'{kind}: use_amp (LeRobot runs the checkpoint under float16 '
                            f'autocast on CUDA) with {", ".join(other)} is not supported yet '
                            '(not measured); or save it with use_amp false (its actions on '
                            'CUDA then differ from LeRobot\'s scripts\' by float16 rounding)')
    for option, kernels in (('denoise_kernels', denoise), ('prefix_kernels', prefix)):
        if kernels not in KERNELS and not (option == 'denoise_kernels' and kernels == FUSED):
            raise InvalidConfig(f'{kind}: {option} {kernels!r}: lerobot (LeRobot\'s own) or '
                                'compiled (torch.compile\'s fused kernels)' +
                                (', or fused (the expert\'s step of our own)'
                                 if option == 'denoise_kernels' else ''))
        if kernels in ('compiled', FUSED):
            import torch._inductor.config as inductor
            if not hasattr(inductor, 'deterministic'):
                raise InvalidConfig(f'{kind}: {option} {kernels} needs inductor\'s '
                                    f'deterministic mode (torch >= 2.10; this is '
                                    f'{torch.__version__})')
            if rtc_delay >= 0:      # RTC differentiates through the step: not measured yet
                raise InvalidConfig(f'{kind}: {option} {kernels} with real-time chunking '
                                    '(rtc_delay) is not supported yet')


def compiled(fn):
    '''fn compiled as denoise_kernels 'compiled' compiles LeRobot's denoise_step: static
    shapes, inductor's deterministic mode (no on-device benchmarking that could pick another
    reduction order in another process).'''
    return torch.compile(fn, dynamic=False, options={'deterministic': True})


class KeptPrefixPolicy(LanguageChunkPolicy):
    '''A language chunk policy whose prefix KV cache, pad mask and source observation are arena
    state (kind 'kv'), reused where the observation repeats bit for bit.'''

    kv_shape = None     # one layer's keys (and values); learn_layout() sets it
    _layout_on = None   # use_amp: the device whose autocast state_specs learnt it under
    checkpoint_options = ('denoise_kernels', 'prefix_kernels')
    denoise_kernels = prefix_kernels = 'lerobot'
    _compiled_vlm = None    # the VLM's forward for the prefix pass, when compiled
    _compiled_images = None     # the VLM's embed_image, when compiled
    _camera_features = ()   # (image, its features) for the embed_image calls of one pass

    def use_kernels(self, denoise, prefix):
        '''The kernels of the denoising steps and of the prefix pass (the module's note);
        checked before by check_kernels.'''
        self.denoise_kernels, self.prefix_kernels = denoise, prefix
        if denoise == 'compiled':
            model = self.lerobot.model
            model.denoise_step = compiled(model.denoise_step)
        if prefix == 'compiled':
            vlm = self._vlm()
            self._compiled_vlm = compiled(vlm.forward)
            self._compiled_images = compiled(vlm.embed_image)
            vlm.embed_image = self._embed_image

    def _embed_prefix(self, images, *args, **kwargs):
        '''LeRobot's embed_prefix(images, ...); with prefix_kernels 'compiled' every
        camera's image through the vision tower at once where they have one shape (the
        module's note).'''
        embed_prefix = self.lerobot.model.embed_prefix
        if self._compiled_images is None or len(images) < 2 or \
                len({image.shape for image in images}) > 1:
            return embed_prefix(images, *args, **kwargs)
        features = self._compiled_images(torch.cat(images))     # [cameras x B, tokens, dim]
        self._camera_features = list(zip(images, features.split(len(images[0]))))
        try:
            out = embed_prefix(images, *args, **kwargs)
            if self._camera_features:
                left = len(self._camera_features)
                raise RuntimeError(f'LeRobot\'s embed_prefix embedded {len(images) - left} '
                                   f'of {len(images)} cameras: not the prefix pass this policy '
                                   'knows')
            return out
        finally:
            self._camera_features = ()

    def _embed_image(self, image):
        '''The VLM's embed_image with prefix_kernels 'compiled': the features of this image
        from the batch _embed_prefix computed, each camera's in LeRobot's order; elsewhere (no
        such pass) the compiled call on this image alone.'''
        if not self._camera_features:
            return self._compiled_images(image)
        expected, features = self._camera_features.pop(0)
        if image is not expected:
            raise RuntimeError('LeRobot\'s embed_prefix embedded another image than the '
                               'cameras\' in their order: not the prefix pass this policy knows')
        return features

    def _run(self, graph):
        '''As LeRobotChunkPolicy._run; with compiled kernels, a graph run eagerly (the CPU)
        compiles at its first run and must never compile again: a recompile would run other
        kernels, and past dynamo's limit LeRobot's own, changing the actions without a word.
        So it is an error instead (torch._dynamo's error_on_recompile).'''
        if self.denoise_kernels == self.prefix_kernels == 'lerobot' or graph.captured:
            return super()._run(graph)
        if id(graph) not in self._compiled_ran:
            self._compiled_ran.add(id(graph))
            return super()._run(graph)
        import torch._dynamo
        with torch._dynamo.config.patch(error_on_recompile=True):
            return super()._run(graph)

    def _prefix_forward(self):
        '''The VLM's forward the prefix pass calls (prefix_kernels).'''
        return self._compiled_vlm or self._vlm().forward

    def config(self):
        # prefix_kernels only when compiled: the default's digest is the one capsules saved
        # before the option have
        return {**super().config(), 'denoise_kernels': self.denoise_kernels,
                **({'prefix_kernels': 'compiled'} if self.prefix_kernels != 'lerobot' else {})}

    def learn_layout(self, kv, pad):
        '''The cache's layout, from one prefix pass's output.'''
        first = kv[0][0]
        self.layers, self.kv_shape = len(kv), tuple(first.shape)
        self.kv_dtype, self.prefix_len = first.dtype, pad.shape[1]

    def state_specs(self):
        # from one prefix pass on zeros, on the policy's device (use_amp: the dtype its
        # autocast gives, float16 on CUDA; once a device: every bind reads these specs)
        if self.kv_shape is None or self.amp and self._layout_on != self.device:
            with torch.no_grad(), self.autocast():
                self.learn_layout(*self._prefix(self._inputs(
                    torch.zeros(self.obs_dim, device=self.device))))
            self._layout_on = self.device
        cache = (self.layers, *self.kv_shape)
        return super().state_specs() + [
            BufferSpec('prefix_k', cache, self.kv_dtype, 'kv'),
            BufferSpec('prefix_v', cache, self.kv_dtype, 'kv'),
            BufferSpec('prefix_pad', (1, self.prefix_len), torch.bool, 'kv'),
            # the key of the cache above: the observation it came from, and whether it holds one;
            # a copy of a checked observation, and a key only: a NaN there matches no
            # observation, so the finite flag leaves it out (11 MB for three VGA cameras)
            BufferSpec('prefix_obs', (self.obs_dim,), torch.float32, 'kv', finite_checked=False),
            BufferSpec('prefix_ready', (1,), torch.int64, 'kv'),
            self._rng_spec()]

    def capture(self, enabled):
        '''The whole chunk (LeRobotChunkPolicy.capture) and its denoising steps alone, each a
        CUDA graph when enabled; both denoise from the static prefix buffers (_cache).'''
        cache, dev = (self.layers, *self.kv_shape), self.device
        self._cache = {'prefix_k': torch.zeros(cache, dtype=self.kv_dtype, device=dev),
                       'prefix_v': torch.zeros(cache, dtype=self.kv_dtype, device=dev),
                       'prefix_pad': torch.zeros(1, self.prefix_len, dtype=torch.bool,
                                                 device=dev)}
        self.prefix_reused = 0      # chunks that skipped the prefix pass (benchmarks, tests)
        self._compiled_ran = set()  # new graphs (_run): each may compile at its first run
        if self.denoise_kernels == FUSED:   # built on the policy's device: what depends on
            self._fused = self.fused_expert()   # the step's time alone is computed there, once
        super().capture(enabled)
        self._denoise_graph = StepGraph(self._denoise_fn, dev, enabled, host_constants=True)

    def _chunk(self, batch):
        kv, pad = self._prefix(batch)
        c = self._cache
        if kv[0][0].dtype != c['prefix_k'].dtype:   # never a silent cast (checked at capture)
            raise RuntimeError(f'{self.kind}: the prefix pass gave {kv[0][0].dtype} keys, the '
                               f'kept prefix is {c["prefix_k"].dtype}')
        c['prefix_k'].copy_(torch.stack([k for k, _ in kv]))
        c['prefix_v'].copy_(torch.stack([v for _, v in kv]))
        c['prefix_pad'].copy_(pad)
        return {**self._denoise(batch), **c}

    def fused_expert(self):
        '''denoise_kernels 'fused': the expert's steps of our own, with a sample(noise,
        prefix_k, prefix_v, prefix_pad, **inputs) -> the chunk's actions (each kind defines
        it).'''
        raise NotImplementedError

    def _fused_chunk(self, **inputs):
        '''The chunk's outputs from the fused steps, from the session's noise (inputs: what
        else the kind's steps read, Pi0's state).'''
        c = self._cache
        return self._chunk_outputs(self._fused.sample(
            self.noise(self._chunk_rng), c['prefix_k'], c['prefix_v'], c['prefix_pad'],
            **inputs))

    @torch.no_grad()
    def _denoise_fn(self):
        with self.autocast():
            self._denoise_out = self._denoise(self._inputs(self._chunk_obs))

    def _dynamic_cache(self):
        '''The kept prefix as a transformers DynamicCache, filled as the prefix pass fills it
        (update() copies each layer in).'''
        from transformers import DynamicCache
        kv, c = DynamicCache(), self._cache
        for i in range(self.layers):
            kv.update(c['prefix_k'][i], c['prefix_v'][i], i)
        return kv

    def _prefix_is(self, obs):
        '''Whether the session's kept prefix came from obs (its bits): one read of the
        device.'''
        return bool(self._prefix_from(obs))

    def _prefix_from(self, obs):
        '''_prefix_is's verdict as a bool tensor on the device, not read (to be combined with
        other checks in one read).'''
        v = self.views
        same = (obs.view(torch.int32) == v['prefix_obs'].view(torch.int32)).all()
        return same & (v['prefix_ready'] == 1).all()

    def _use_kept_prefix(self, kept=None):
        '''The session's kept prefix (or `kept`, copies of it by name) into the static buffers
        the denoising steps read.'''
        kept = self.views if kept is None else kept
        for name in PREFIX:
            self._cache[name].copy_(kept[name])

    def _replay(self, obs):
        '''A chunk; the denoising steps alone when the session's prefix came from obs (its
        bits), one read of the device to know.'''
        if self._chunk_graph is None:
            self.capture(False)
        v = self.views
        if self._prefix_is(obs):
            self._use_kept_prefix()
            self._chunk_obs.copy_(obs)
            self._run(self._denoise_graph)
            self.prefix_reused += 1
            return self._denoise_out
        out = super()._replay(obs)
        v['prefix_obs'].copy_(obs)
        v['prefix_ready'].fill_(1)
        return out
