"""Capture (activation, output gradient) in ONE backward, without autograd's weight grads.

Book-keeping (Bu et al., ICML'23; groupwise-clipping paper §2.2 and Algorithm 1): the
forward keeps each layer's input ``a``; the backward hands over its output gradient ``b``;
per-sample norms and the clipped sum ``aᵀ diag(c) b`` are then computed from the pair.
Ordinary autograd would *also* compute the unweighted weight gradient ``aᵀ b`` of every
layer, one wasted matmul per layer. To avoid it, each supported module's forward is
routed through :class:`_BookkeptOp`, a custom autograd function whose backward returns
the input gradient only (``None`` for the parameters) and passes ``(a, b)`` to the
engine. Modules without a rule go through the torch.func fallback
(:mod:`dpclip.engine.fallback`) the same way: parameters detached in the forward, output
gradients tapped in the backward.

How a module's forward is re-routed: an instance attribute ``forward`` shadows the class
method (``nn.Module.__call__`` looks it up on the instance), and :meth:`Bookkeeper.remove`
deletes it again. Hooks registered by the user keep working.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from dpclip.engine import fallback
from dpclip.engine.norms import LayerRule, Use, find_layer_rule, is_rmsnorm_like
from dpclip.errors import EngineError

_BATCHNORM_HINT = "replace it with GroupNorm (e.g. nn.GroupNorm(8, C)) or LayerNorm"


@dataclass(eq=False)
class Unit:
    """A module that owns trainable parameters directly, and how it is book-kept."""

    module: nn.Module
    name: str
    params: list[tuple[str, nn.Parameter, int]]   # (attribute name, parameter, index)
    rule: LayerRule | None                        # None: torch.func rule
    is_fallback: bool                             # no rule: refused when strict
    orig_forward: Callable | None = None
    bypass: bool = False
    vmap_ok: bool | None = None                   # learnt on first fallback call

    @property
    def label(self) -> str:
        return f"{self.name or '<root>'} ({type(self.module).__name__})"


class StashMeter:
    """Deterministic count of bytes held by the engine's stash (current and peak).

    Tensors are keyed by (device, data pointer, numel, dtype), so views of one tensor
    (and one activation feeding several layers) count once. This counts what the
    engine keeps alive, not process memory.
    """

    def __init__(self) -> None:
        self._refs: dict[tuple, list[int]] = {}
        self.current = 0
        self.peak = 0

    @staticmethod
    def _key(t: Tensor) -> tuple:
        return (t.device, t.data_ptr(), t.numel(), t.dtype)

    def add(self, tensors) -> None:
        for t in tensors:
            key = self._key(t)
            ref = self._refs.get(key)
            if ref is None:
                nbytes = t.numel() * t.element_size()
                self._refs[key] = [1, nbytes]
                self.current += nbytes
                self.peak = max(self.peak, self.current)
            else:
                ref[0] += 1

    def remove(self, tensors) -> None:
        for t in tensors:
            key = self._key(t)
            ref = self._refs[key]
            ref[0] -= 1
            if ref[0] == 0:
                self.current -= ref[1]
                del self._refs[key]

    def reset_peak(self) -> None:
        self.peak = self.current


@dataclass
class _Active:
    """State of the engine.backward call in progress."""

    batch_size: int
    sink: Callable[[int, Use], None]
    generation: int


@dataclass(eq=False)
class _Call:
    """One forward call of a unit, waiting for its backward."""

    keeper: "Bookkeeper"
    unit: Unit
    generation: int
    info: object = None
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)
    out_index: list[int] = field(default_factory=list)
    out_spec: object = None


class _BookkeptOp(torch.autograd.Function):
    """y = layer(a); backward returns dL/da only and hands (a, dL/dy) to the engine.

    The parameters are inputs so that autograd calls this backward even when ``a``
    needs no gradient (the first layer); their gradient is ``None``, so autograd never
    forms the unweighted ``aᵀb``.
    """

    @staticmethod
    def forward(ctx, call: _Call, x: Tensor, *params: Tensor) -> Tensor:
        ctx.call = call
        ctx.n_params = len(params)
        ctx.save_for_backward(x)
        return call.unit.rule.forward(call.unit.module, x, call.info)

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        (x,) = ctx.saved_tensors
        call: _Call = ctx.call
        rule, module = call.unit.rule, call.unit.module
        grad_x = rule.input_grad(module, x, grad_out, call.info) if ctx.needs_input_grad[1] else None
        call.keeper.deliver_layer(call, x, grad_out)
        return (None, grad_x) + (None,) * ctx.n_params


class _OutputTap(torch.autograd.Function):
    """Identity on a fallback module's outputs; its backward sees all output grads at once."""

    @staticmethod
    def forward(ctx, call: _Call, n_out: int, *tensors: Tensor):
        ctx.call = call
        ctx.n_out = n_out
        ctx.n_params = len(tensors) - n_out
        return tuple(t.view_as(t) for t in tensors[:n_out])

    @staticmethod
    def backward(ctx, *grads: Tensor):
        ctx.call.keeper.deliver_fallback(ctx.call, grads)
        passed = tuple(g if ctx.needs_input_grad[2 + i] else None for i, g in enumerate(grads))
        return (None, None) + passed + (None,) * ctx.n_params


class Bookkeeper:
    """Installs the forward re-routing on a model and delivers per-sample gradient uses.

    ``index_of`` maps ``id(param)`` to the engine's parameter index for every trainable
    parameter. During :meth:`backward_scope`, every use of parameter ``k`` is passed to
    ``sink(k, use)``.
    """

    def __init__(self, model: nn.Module, index_of: dict[int, int], *, strict: bool = False):
        self.model = model
        self.index_of = index_of
        self.stash = StashMeter()
        self.forward_counts = [0] * len(index_of)
        self.generation = 0
        self.batch_hint: int | None = None
        self._active: _Active | None = None
        self._plain = 0
        self._lock = threading.Lock()
        self._handles: list = []
        self.units = self._build_units(model, strict)

    # ------------------------------------------------------------------ setup

    def _build_units(self, model: nn.Module, strict: bool) -> list[Unit]:
        """One unit per module owning trainable parameters; refuse what cannot be exact
        (modules that mix samples, or read a child's parameters without calling it)."""
        units: list[Unit] = []
        for name, module in model.named_modules():
            if isinstance(module, nn.modules.batchnorm._BatchNorm):
                raise EngineError(
                    f"module {name or '<root>'} ({type(module).__name__}) normalises with "
                    "batch statistics, which mixes samples: per-sample gradients and the "
                    "privacy guarantee would not hold", _BATCHNORM_HINT)
            if (isinstance(module, nn.modules.instancenorm._InstanceNorm)
                    and module.track_running_stats):
                raise EngineError(
                    f"module {name} ({type(module).__name__}) tracks running statistics "
                    "of the private data, released with the model", "set track_running_stats=False")
            if (isinstance(module, (nn.Embedding, nn.EmbeddingBag))
                    and module.max_norm is not None):
                # Checked for frozen tables too: the renormalisation writes the weight anyway.
                raise EngineError(
                    f"module {name or '<root>'} ({type(module).__name__}) has max_norm="
                    f"{module.max_norm}: its forward renormalises the looked-up rows in place, "
                    "so the weights reveal which tokens were in the private batch",
                    "set max_norm=None (clip the gradient instead)")
            if isinstance(module, nn.MultiheadAttention):
                raise EngineError(
                    f"module {name} (nn.MultiheadAttention) reads its out_proj weights "
                    "without calling out_proj, so they cannot be book-kept",
                    "build attention from nn.Linear projections (as transformers models do)")
            params = [(pname, p, self.index_of[id(p)])
                      for pname, p in module.named_parameters(recurse=False)
                      if id(p) in self.index_of]
            if not params:
                continue
            rule = find_layer_rule(module)
            is_fallback = rule is None and not is_rmsnorm_like(module)
            if is_fallback and strict:
                raise EngineError(
                    f"module {name or '<root>'} ({type(module).__name__}) has trainable "
                    "parameters and no book-keeping rule; strict mode refuses the torch.func "
                    "fallback", "set clipping.strict: false, freeze it, or register a rule "
                    "with dpclip.engine.norms.register_layer_rule")
            if rule is None and isinstance(module, nn.RNNBase) and module.dropout > 0 and module.training:
                raise EngineError(f"module {name} ({type(module).__name__}) uses dropout between "
                                  "layers; the per-sample fallback cannot replay it",
                                  "set dropout=0 on the RNN")
            units.append(Unit(module, name, params, rule, is_fallback))
        return units

    def install(self) -> None:
        wrapped = [u.label for u in self.units if "forward" in u.module.__dict__]
        if wrapped:
            raise EngineError(
                f"modules {', '.join(wrapped[:3])} already have an instance-level forward "
                "(another DPEngine on this model?)", "call engine.detach() on the old engine first")
        for unit in self.units:
            unit.orig_forward = unit.module.forward
            if unit.rule is not None:
                unit.module.forward = self._rule_forward(unit)
            else:
                unit.module.forward = self._fallback_forward(unit)
        self._handles.append(
            self.model.register_forward_pre_hook(self._note_batch, with_kwargs=True))

    def remove(self) -> None:
        for unit in self.units:
            if "forward" in unit.module.__dict__:
                del unit.module.__dict__["forward"]
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _note_batch(self, module, args, kwargs):
        # The batch size of a forward = the largest leading dimension among the model's
        # tensor inputs; inputs of leading size 1 inside it are broadcast over the batch.
        dims = [t.shape[0] for t in tree_flatten((args, kwargs))[0]
                if isinstance(t, Tensor) and t.dim() > 0]
        self.batch_hint = max(dims) if dims else None

    # ---------------------------------------------------------------- forward

    def _passthrough(self, unit: Unit) -> bool:
        return unit.bypass or self._plain > 0 or not torch.is_grad_enabled()

    def _count(self, unit: Unit) -> None:
        for _, _, idx in unit.params:
            self.forward_counts[idx] += 1

    def _rule_forward(self, unit: Unit):
        orig = unit.orig_forward
        params = [p for _, p, _ in unit.params]

        def forward(*args, **kwargs):
            if self._passthrough(unit):
                return orig(*args, **kwargs)
            inputs = list(args) + list(kwargs.values())
            if len(inputs) != 1:
                raise EngineError(f"module {unit.label} was called with {len(inputs)} arguments; "
                                  "its rule takes the input tensor only", "call it as module(x)")
            x, info = unit.rule.prepare(unit.module, inputs[0], self.batch_hint)
            call = _Call(self, unit, self.generation, info)
            self._count(unit)
            return _BookkeptOp.apply(call, x, *params)

        return forward

    def _fallback_forward(self, unit: Unit):
        orig = unit.orig_forward
        params = [p for _, p, _ in unit.params]

        def forward(*args, **kwargs):
            if self._passthrough(unit):
                return orig(*args, **kwargs)
            detached = {name: p.detach() for name, p, _ in unit.params}
            unit.bypass = True
            try:  # the module's own parameters are constants here: no autograd weight grads
                out = torch.func.functional_call(unit.module, detached, args, kwargs)
            finally:
                unit.bypass = False
            leaves, spec = tree_flatten(out)
            index = [i for i, t in enumerate(leaves) if isinstance(t, Tensor) and t.is_floating_point()]
            if not index:
                return out
            call = _Call(self, unit, self.generation, None, args, kwargs, index, spec)
            self._count(unit)
            tapped = _OutputTap.apply(call, len(index), *[leaves[i] for i in index], *params)
            for j, i in enumerate(index):
                leaves[i] = tapped[j]
            return tree_unflatten(leaves, spec)

        return forward

    @contextmanager
    def plain(self) -> Iterator[None]:
        """Run forwards with the original modules (recomputation in the fallback)."""
        self._plain += 1
        try:
            yield
        finally:
            self._plain -= 1

    # --------------------------------------------------------------- backward

    def take_forward_counts(self) -> tuple[list[int], int]:
        """Uses per parameter recorded since the last call, and the generation they
        belong to; later forwards belong to the next generation."""
        counts, self.forward_counts = self.forward_counts, [0] * len(self.forward_counts)
        self.generation += 1
        return counts, self.generation - 1

    @contextmanager
    def backward_scope(self, batch_size: int, generation: int,
                       sink: Callable[[int, Use], None]) -> Iterator[None]:
        self._active = _Active(batch_size, sink, generation)
        try:
            yield
        finally:
            self._active = None

    def _check(self, call: _Call) -> _Active:
        active = self._active
        if active is None:
            raise EngineError(
                f"module {call.unit.label} ran its backward outside engine.backward",
                "call engine.backward(per_sample_losses) instead of loss.backward()")
        if call.generation != active.generation:
            raise EngineError(
                f"module {call.unit.label} belongs to a forward pass from before the "
                "previous engine.backward", "call engine.backward once after each forward")
        return active

    def deliver_layer(self, call: _Call, x: Tensor, grad_out: Tensor) -> None:
        active = self._check(call)
        if x.dim() == 0 or x.shape[0] != active.batch_size or grad_out.shape[0] != active.batch_size:
            raise EngineError(
                f"module {call.unit.label} saw an input with leading dimension "
                f"{x.shape[0] if x.dim() else 'none'}, but engine.backward got "
                f"{active.batch_size} per-sample losses",
                "the engine needs the batch in dim 0 of every layer input (batch_first=True) "
                "and one loss per sample (reduction='none')")
        uses = call.unit.rule.uses(call.unit.module, x, grad_out, call.info)
        self._sink(active, call.unit, uses)

    def deliver_fallback(self, call: _Call, grads: tuple[Tensor, ...]) -> None:
        active = self._check(call)
        grads_by_name = fallback.per_sample_grads(self, call, grads, active.batch_size)
        self._sink(active, call.unit, grads_by_name)

    def _sink(self, active: _Active, unit: Unit, uses: dict) -> None:
        with self._lock:  # autograd runs one thread per device on multi-GPU models
            for name, _, idx in unit.params:
                active.sink(idx, uses[name])
