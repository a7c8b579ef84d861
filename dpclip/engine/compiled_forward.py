"""The compiled micro-batch's forward: each book-kept module's call kept for one autograd.grad.

:class:`~dpclip.engine.compiled.CompiledMicroBatch` traces a micro-batch's forward, backward and
clip as one graph (docs/compiled.md). While it runs, each book-kept module's forward is
:func:`probed_forward`: its layer rule's ``call`` gets a :class:`ProbedSite` (the
:class:`~dpclip.engine.layers.Capture` of the compiled step), whose ``op`` computes
``rule.forward`` under ordinary autograd and keeps the call (input, rule state, output) in the
:class:`Recorder`; a module without a rule but shaped like an RMSNorm runs with its parameters
run by its own forward, its per-sample gradients later from :func:`per_sample_vjp`. Nothing here has a hook,
a lock or a Python decision on a tensor's value, so torch.compile traces it whole.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
from torch import Tensor, nn

from dpclip.engine.batch_axis.layout import Layout
from dpclip.engine.factors import Dense
from dpclip.engine.layers.functorch import FUNCTORCH_RULE
from dpclip.errors import EngineError

#: how to turn compile off, wherever it was turned on
COMPILE_OFF = ("turn compile off (a recipe's training.compile: false, make_private(compile=False), "
               "PrivacyArguments(compile=False))")
HINT = f"{COMPILE_OFF}: the engine trains it eagerly (docs/compiled.md)"


@dataclass(eq=False)
class ProbedCall:
    """One probed call of a unit in the compiled forward."""

    unit: object
    output: Tensor
    x: object = None         # the rule's activation, or the torch.func module's inputs
    info: object = None
    names: tuple[str, ...] = ()
    rule: object = None      # None: a torch.func module (its per-sample vjp)


class Recorder:
    """The calls of the forward being traced, and whether modules run plainly (a per-sample
    recomputation of a torch.func module)."""

    def __init__(self):
        self.calls: list[ProbedCall] = []
        self.batch = 0
        self.plain = False


class _OneLayout:
    """The one layout a compiled call has: its inputs carry the batch in dim 0 (or are shared
    over it, leading size 1), nothing is dead, nothing chained."""

    dead = False
    consumers = None
    outputs = None


class ProbedSite:
    """The :class:`~dpclip.engine.layers.Capture` of one unit's call in the compiled forward."""

    layout = _OneLayout()

    def __init__(self, recorder: Recorder, unit):
        self.recorder, self.unit = recorder, unit
        self.module, self.label, self.memo = unit.module, unit.label, unit.memo
        self.batch_size = self.batch_hint = recorder.batch
        self.params = [(name, p) for name, p, _ in unit.params]

    def layout_of(self, t: Tensor) -> Layout:
        """The batch in dim 0, or shared by every sample (size 1 there), as :meth:`batch_first` takes it."""
        batch = self.batch_size
        if t.dim() == 0:
            return Layout(0)
        if t.shape[0] == batch:
            return Layout(t.dim(), 0)
        if t.shape[0] == 1:
            return Layout(t.dim(), lead1=True)
        return Layout(t.dim(), error=f"no batch of {batch} in dim 0, which the compiled step needs")

    def note_expanded(self, t: Tensor) -> None:
        return None

    def batch_first(self, t: Tensor, feature_dims: int | None = None):
        batch = self.batch_size
        if t.dim() >= 1 and t.shape[0] == batch:
            return t, _identity
        if t.dim() >= 1 and t.shape[0] == 1:   # shared by every sample (position ids): one copy each
            return t.expand(batch, *t.shape[1:]), _identity
        raise EngineError(f"module {self.label}: an input of shape {tuple(t.shape)} has no batch of "
                          f"{batch} in dim 0, which the compiled step needs", HINT)

    def chained(self, rule, x: Tensor) -> Tensor:
        raise EngineError(f"module {self.label}: a shared input broadcast after a chain of modules is "
                          "not compiled", HINT)

    def children_batch_first(self):
        return nullcontext()

    def op(self, rule, x: Tensor, info=None, names: list[str] | None = None) -> Tensor:
        out = rule.forward(self.module, x, info)
        own = tuple(name for name, _ in self.params)
        self.recorder.calls.append(ProbedCall(self.unit, out, x.detach(), info,
                                         own if names is None else tuple(names), rule))
        return out.clone()

    def tap(self, outputs: list[Tensor], on_grads: Callable) -> tuple[Tensor, ...]:
        raise EngineError(f"module {self.label}: its rule taps output gradients, which the compiled "
                          "step does not trace", HINT)

    def bypass(self):
        return self.plain()

    @contextmanager
    def plain(self) -> Iterator[None]:
        kept, self.recorder.plain = self.recorder.plain, True
        try:
            yield
        finally:
            self.recorder.plain = kept


def _identity(t: Tensor) -> Tensor:
    return t


def probed_forward(recorder: Recorder, unit) -> Callable:
    """``unit``'s forward in the compiled step (:class:`ProbedSite`; torch.func modules: :func:`_functorch_call`)."""
    orig = unit.orig_forward

    def forward(*args, **kwargs):
        if recorder.plain or not torch.is_grad_enabled():
            return orig(*args, **kwargs)
        site = ProbedSite(recorder, unit)
        if unit.rule is FUNCTORCH_RULE:
            return _functorch_call(site, args, kwargs)
        return unit.rule.call(unit.module, site, args, kwargs)
    return forward


def _functorch_call(site: ProbedSite, args: tuple, kwargs: dict) -> Tensor:
    """A module without a layer rule (a custom RMSNorm, a scaled embedding): its own forward, its one
    output kept; its per-sample gradients come from :func:`per_sample_vjp`. Only a call of one tensor
    with the batch in dim 0, returning one such tensor, is taken."""
    batch = site.batch_size
    if len(args) != 1 or kwargs or not isinstance(args[0], Tensor) or args[0].dim() == 0 \
            or args[0].shape[0] != batch:
        raise EngineError(f"module {site.label} has no layer rule, and the compiled step takes such a module "
                          "only when it is called with one tensor holding the batch in dim 0", HINT)
    x = args[0]
    with site.plain():   # its parameters' gradients are never asked for: autograd forms none
        out = site.unit.orig_forward(x)
    if not isinstance(out, Tensor) or out.dim() == 0 or out.shape[0] != batch or not out.requires_grad:
        raise EngineError(f"module {site.label} has no layer rule, and the compiled step takes such a module "
                          "only when it returns one tensor holding the batch in dim 0, computed from its "
                          "trainable parameters", HINT)
    site.recorder.calls.append(ProbedCall(site.unit, out, x.detach(), None, tuple(n for n, _ in site.params)))
    return out.clone()


def per_sample_vjp(site_module: nn.Module, params: dict[str, Tensor], x: Tensor, grad: Tensor,
                    recorder: Recorder) -> dict[str, Dense]:
    """g_i = (∂f(θ; x_i)/∂θ)ᵀ b_i for every sample at once (torch.func's vmap of vjp)."""
    def one(x_i: Tensor, g_i: Tensor):
        def f(p):
            return torch.func.functional_call(site_module, p, (x_i.unsqueeze(0),)).squeeze(0)
        _, pull = torch.func.vjp(f, params)
        return pull(g_i)[0]

    kept, recorder.plain = recorder.plain, True
    try:
        grads = torch.func.vmap(one)(x, grad)
    finally:
        recorder.plain = kept
    return {name: Dense(g) for name, g in grads.items()}
