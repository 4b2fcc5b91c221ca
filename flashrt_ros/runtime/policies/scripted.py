'''TorchScript exports run as they are, their recurrent state adopted into the arena.

Every exporter robot users meet (Isaac Lab / rsl_rl 3.x `_TorchPolicyExporter`, rsl_rl >= 4
`export_policy_to_jit`, legged_gym `PolicyExporterLSTM`) writes a scripted module whose
recurrent state lives in registered buffers that its forward overwrites. That is the rule
here, rather than a list of layouts: the buffers a forward changes are the state; each is
re-pointed at an arena view of the same shape and dtype, so the file's own code writes the
arena, runs captured, and a capsule holds everything that decides its next action. Running
the file itself (not a re-implementation) makes the actions those of the file, bit for bit.
'''

import hashlib

import torch

from ..enums import PolicyKind
from ..errors import InvalidConfig
from ..state import BufferSpec
from .base import ACTIVATIONS, Policy


def _get(module, dotted):
    for part in dotted.split('.'):
        module = getattr(module, part)
    return module


def _set(module, dotted, value):
    *path, last = dotted.split('.')
    for part in path:
        module = getattr(module, part)
    setattr(module, last, value)


def describe(module):
    '''What a scripted module holds: submodules with their types, buffers with shapes.'''
    subs = [f'{name or "<root>"}: {child.original_name}'
            for name, child in module.named_modules()]
    bufs = [f'{name} {list(b.shape)}' for name, b in module.named_buffers()]
    return f'submodules [{", ".join(subs)}], buffers [{", ".join(bufs) or "none"}]'


@torch.no_grad()
def _input_widths(module, dtype):
    '''The observation widths the module's forward runs on, found by running it: each width
    of its weights and buffers is tried as [1, width]. Reading a weight would name whichever
    layer was registered first (an Isaac Lab export registers the actor before the
    normalizer and the rnn that the observation enters). Buffers are restored after.'''
    saved = {name: b.detach().clone() for name, b in module.named_buffers()}
    tensors = [*module.parameters(), *module.buffers()]
    candidates = sorted({int(t.shape[-1]) for t in tensors if t.dim() >= 1} |
                        {int(t.shape[1]) for t in tensors if t.dim() == 2})
    widths = []
    try:
        for width in candidates:
            try:
                module(torch.zeros(1, width, dtype=dtype))
                widths.append(width)
            except Exception:  # noqa: B902 - any failure means "not this width"
                continue
    finally:
        for name, value in saved.items():
            _get(module, name).copy_(value)
    return widths


def activations_in(module):
    '''Activation module names found in a scripted module ('elu', 'tanh', ...).'''
    names = {child.original_name.lower() for child in module.modules()}
    return sorted(names & (set(ACTIVATIONS) - {'identity'}))   # nn.Identity: a no-op slot


class ScriptedPolicy(Policy):
    '''A TorchScript policy file, run by its own forward over adopted state buffers.

    kind: 'mlp' (the file keeps no state) or 'recurrent' (some buffers change in forward).
    State: each adopted buffer under its dotted module path (kind 'recurrent'), and 'rng'.
    '''

    def __init__(self, module, obs_dim, act_dim, *, kind, activation='', noise_std=0.0,
                 seed=0, source=''):
        super().__init__(obs_dim, act_dim, 0, noise_std, seed)
        self.kind, self.source = kind, source
        module.eval()
        self.module = module
        self.requires_grad_(False)
        params = [p for p in module.parameters() if p.is_floating_point()]
        if not params:
            raise InvalidConfig(f'{source}: the TorchScript module has no weights; found '
                                f'{describe(module)}')
        self._dtype = params[0].dtype
        found = activations_in(module)
        if activation and found and activation not in found:
            raise InvalidConfig(f"{source}: parameter 'activation' is {activation!r} but the "
                                f'file uses {found}; leave it empty or set it to the file\'s')
        self.activation = '/'.join(found)
        self.state_names = self._probe(source)
        if kind == PolicyKind.MLP and self.state_names:
            raise InvalidConfig(f'{source}: the file keeps recurrent state in buffers '
                                f'{self.state_names} (its forward overwrites them): set '
                                "policy_type 'recurrent'")
        if kind == PolicyKind.RECURRENT and not self.state_names:
            raise InvalidConfig(f'{source}: no buffer of the file changes in forward, so it '
                                "keeps no recurrent state: set policy_type 'mlp'; found "
                                f'{describe(module)}')
        # the values at load are the initial state (exporters save zeros): kept for resets
        for i, name in enumerate(self.state_names):
            self.register_buffer(f'initial_{i}', _get(module, name).detach().clone(),
                                 persistent=False)

    @torch.no_grad()
    def _probe(self, source):
        '''Run forward on seeded observations; the buffers it changes are the state.'''
        saved = {name: b.detach().clone() for name, b in self.module.named_buffers()}
        gen = torch.Generator().manual_seed(0)
        try:
            for _ in range(2):
                out = self.module(torch.randn(1, self.obs_dim, generator=gen).to(self._dtype))
        except Exception as exc:  # noqa: B902 - any failure means the layout is not understood
            widths = _input_widths(self.module, self._dtype)
            takes = (f'the file takes [1, {widths[0]}] (obs_dim x obs_history must be '
                     f'{widths[0]})' if len(widths) == 1 else
                     f'the file runs on observations of widths {widths}' if widths else
                     'the file runs on none of the widths its weights suggest')
            raise InvalidConfig(
                f'{source}: forward on one observation [1, {self.obs_dim}] failed '
                f'({str(exc).strip().splitlines()[-1][:200]}); {takes}. Expected a module '
                f'whose forward maps [1, obs_dim] to [1, act_dim]; found '
                f'{describe(self.module)}') from exc
        if not torch.is_tensor(out) or out.numel() != self.act_dim:
            got = tuple(out.shape) if torch.is_tensor(out) else type(out).__name__
            raise InvalidConfig(f'{source}: forward returns {got}, expected {self.act_dim} '
                                f'actions (act_dim); found {describe(self.module)}')
        changed = [name for name, b in self.module.named_buffers()
                   if not torch.equal(saved[name], b)]
        for name in changed:
            _set(self.module, name, saved[name])        # the probe leaves no trace
        bad = [n for n in changed if not saved[n].is_floating_point()]
        if bad:
            raise InvalidConfig(f'{source}: forward changes non-float buffers {bad}; only '
                                'float recurrent state can be adopted')
        return changed

    def config(self):
        return {**super().config(), 'format': 'torchscript', 'state': tuple(self.state_names),
                'activation': self.activation}

    def state_specs(self):
        specs = [BufferSpec(name, tuple(_get(self.module, name).shape),
                            _get(self.module, name).dtype, 'recurrent')
                 for name in self.state_names]
        return specs + [self._rng_spec()]

    def bind(self, views, sessions=None):
        super().bind(views, sessions)       # refuses a fleet: the file steps one session
        for name in self.state_names:
            _set(self.module, name, self.views[name])     # the file now writes the arena

    @torch.no_grad()
    def reset_state(self):
        super().reset_state()
        for i, name in enumerate(self.state_names):
            self.views[name].copy_(getattr(self, f'initial_{i}'))

    @torch.no_grad()
    def step(self, obs, action):
        out = self.module(obs.view(1, self.obs_dim).to(self._dtype))
        for name in self.state_names:
            view, current = self.views[name], _get(self.module, name)
            if current.data_ptr() != view.data_ptr():
                # forward re-bound the attribute instead of writing in place: copy it into the
                # arena and point the attribute back (under capture this runs once)
                view.copy_(current)
                _set(self.module, name, view)
        self._act(out.view(self.act_dim).float(), action)

    def model_digest(self):
        # weights and code, never the adopted state buffers (they alias the arena)
        digest = hashlib.sha256(repr(sorted(self.config().items())).encode())
        digest.update(self.module.code.encode())
        state = {f'module.{n}' for n in self.state_names}
        for name, tensor in self.state_dict().items():
            if name in state:
                continue
            t = tensor.detach().contiguous().cpu()
            digest.update(f'{name}|{t.dtype}|{tuple(t.shape)}|'.encode())
            digest.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
        return digest.hexdigest()
