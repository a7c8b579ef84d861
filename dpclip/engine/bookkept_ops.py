"""The two autograd functions a book-kept module's call goes through, the call they carry, and the
:class:`Site` a layer rule makes them with (:mod:`dpclip.engine.bookkeeping` routes the forwards
and delivers the uses).

:class:`BookkeptOp` is one layer operation whose backward returns the input gradient only and
hands (input, output gradient) to the keeper; :class:`OutputTap` is the identity on a module's
outputs, whose backward hands the output gradients to the torch.func rule. Neither lets autograd
form a parameter's unweighted gradient.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
from torch import Tensor

from dpclip.engine.batch_axis import SiteBatch
from dpclip.engine.parametrized import pinned
from dpclip.errors import DpclipError, EngineError
from dpclip.torch_compat import func_transform_active, is_view, own_parameters, unsafe_view


def engine_failure(label: str, operation: str, tensors, exc: Exception, module=None) -> EngineError:
    """An exception raised inside the engine's hooks, as an EngineError naming the module, the
    operation and the shapes it had (``dpclip --debug`` keeps the original traceback). With the
    ``module``, a tensor it keeps as a plain attribute with the batch's rows (state its previous call
    left, which its per-sample recomputation reads: RecurrentGemma's ``recurrent_states``) is named
    with the fix."""
    shapes = [tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__ for t in tensors][:6]
    message = f"module {label}: the engine's {operation} failed on tensors of shapes {shapes} ({type(exc).__name__}: {exc})"
    rows = next((t.shape[0] for t in tensors if isinstance(t, Tensor) and t.dim() > 0), None)   # the batch
    kept = {k: tuple(v.shape) for k, v in (vars(module) if module is not None else {}).items()
            if isinstance(v, Tensor) and not k.startswith("_") and v.dim() > 0 and v.shape[0] == rows}
    if kept:
        names = ", ".join(f"`{k}` {shape}" for k, shape in kept.items())
        return EngineError(
            f"{message}; the module is stateful: it keeps {names} as attribute(s), set by its previous call (the "
            "batch's rows), which its per-sample recomputation reads",
            f"when every sequence starts afresh (position 0), clear the state first thing in the module's own forward "
            f"(a subclass of {type(module).__name__} whose forward sets `self.{next(iter(kept))} = None` before "
            "calling super().forward; a forward hook would not do: the certificate replays the module without "
            "hooks), or freeze the module; a state carried from the previous batch would mix samples")
    return EngineError(message,
                       "the engine cannot follow this module's per-sample gradients: freeze it, replace it, "
                       "or report the model with `dpclip --debug` output (docs/supported-models.md, \"What is refused\")")


FREEZE_OR_OUTSIDE = ("freeze the modules that gradient passes through (requires_grad_(False)): a gradient inside "
                     "the forward through frozen modules only, or through none, is checked like any other forward")


#: the hint of a torch.func transform applied around the whole model (already running as its forward began)
AROUND_THE_MODEL = ("the engine's hooks stay on the model until it is detached: to transform the trained model "
                    "(per-sample gradients of your own, an input gradient, a Jacobian or Hessian), call "
                    "engine.detach() after the last private step (make_private: private.engine.detach(); DPTrainer: "
                    "trainer.engine.detach()) and transform it then; a vmap without gradients (under torch.no_grad()) "
                    "runs as it is. What a transform computes from private data is not covered by ε")


def refuse_transform(label: str, around_the_model: bool = False) -> None:
    """Refuse a book-kept call inside a torch.func transform of the model's own forward
    (``vmap(functional_call(layer, ...))`` over the batch, ``torch.func.grad`` of an energy): the
    engine's operations cannot run inside one, and what would run instead is not book-kept.
    ``around_the_model``: the transform was running already as the model's forward began (the
    user's ``torch.func.grad(lambda x: model(x).sum())``), so the refusal names the model."""
    transform = func_transform_active()
    if transform is None:
        return
    if around_the_model:
        raise EngineError(f"the model is called inside {transform} (its trained module {label} reached): the "
                          "engine's book-keeping of per-sample gradients cannot run inside a torch.func transform, "
                          "so no clip of a gradient could be vouched for", AROUND_THE_MODEL)
    vmapped = transform == "torch.vmap"
    raise EngineError(
        f"module {label} is called inside {transform} in the model's forward: the engine's book-keeping of "
        "its per-sample gradients cannot run inside a torch.func transform, so no clip of its gradient "
        "could be vouched for",
        ("call the module on the batch itself (self.layer(x): a layer computes each row from that row "
         "alone, no vmap over the batch needed); an ensemble vmapped over stacked weights: keep those "
         "weights as parameters of a module of your own whose forward calls the functional ops "
         "(F.linear, torch.func.functional_call on a base model kept outside the module tree), and "
         "the engine follows it per sample; or freeze the module (requires_grad_(False))") if vmapped else
        ("a gradient taken inside the forward through trained parameters (-dE/dx as a force, an input-"
         "gradient feature) has a second-order part in its per-sample gradient that the engine does not "
         "follow: " + FREEZE_OR_OUTSIDE))


def refuse_computed_parameter(label: str, name: str) -> None:
    """Refuse a book-kept call whose module reads, in place of its parameter, a tensor computed in
    the forward (``torch.func.functional_call(self.a, {"weight": self.a.weight * 2})``): the engine's
    factors are the gradient with respect to that tensor, not to the parameter it came from."""
    raise EngineError(
        f"module {label} is called with its parameter {name} replaced by a tensor computed in the forward "
        "(torch.func.functional_call with weights of your own): the engine clips the gradients of the "
        "module's own parameters, and this call does not use them as they are",
        "call the module with its own parameters; to transform a weight, register the transform as a "
        "parametrization (torch.nn.utils.parametrize.register_parametrization), which the engine follows "
        "per sample, or compute the weight in a module of your own that calls F.linear(x, W)")


def refuse_backward_in_forward(call: "Call") -> None:
    """Refuse a book-kept call's backward run while a forward of the model is in progress: a gradient
    taken inside the forward (``torch.autograd.grad(E, x, create_graph=True)``, a gradient
    penalty, a force -dE/dx). The loss then depends on the module's parameters through that
    gradient too, a second-order part the engine's per-sample factors do not contain."""
    if call.keeper.axes.depth > 0:
        raise EngineError(
            f"module {call.unit.label}: a gradient was taken inside the model's forward through this module "
            "(torch.autograd.grad or .backward() while the forward runs: a gradient penalty, -dE/dx as a "
            "force, an input-gradient feature); the per-sample gradient then has a second-order part the "
            "engine's book-keeping does not follow, so no clip of it could be vouched for",
            FREEZE_OR_OUTSIDE)


@dataclass(eq=False)
class Call:
    """One book-kept operation or tap of a unit, waiting for its backward."""

    keeper: Any                                       # the Bookkeeper
    unit: Any                                         # its Unit
    generation: int
    rule: object = None                              # forward / input_grad / uses
    info: object = None
    names: tuple[str, ...] = ()                      # parameters it delivers a use for
    on_grads: Callable | None = None                 # for a tap: (grads, batch) -> uses
    batch: int = 0                                   # B of the forward that made it
    weights: dict = field(default_factory=dict)      # parametrized tensors as this call computed them
    replica: bool = False                            # made by a recomputation (gradient checkpointing)


#: added to a parameter's forward count for each call made without gradients inside a forward
#: that has them: reentrant gradient checkpointing (``use_reentrant=True``) runs its block so and
#: differentiates a recomputation of it in the backward, whose calls then deliver the uses; how
#: many is known only when the backward ends (:meth:`dpclip.engine.microbatch.MicroBatch.deliver`)
AWAITING_RECOMPUTE = 1 << 40

#: why a recomputed call's backward is refused when its first call ran with gradients
TWICE = ("a backward through a recomputed forward whose first call had gradients (its uses would "
         "count twice)", "checkpoint with torch.utils.checkpoint (either use_reentrant setting) or "
         "transformers' gradient_checkpointing_enable(); do not differentiate a forward recomputed by hand")


def not_a_view(out: Tensor, inputs: tuple[Tensor, ...]) -> Tensor:
    """``out`` as a tensor autograd does not treat as a view, so that it may be modified in
    place (``h += x``, ``nn.ReLU(inplace=True)``).

    Autograd forbids in-place changes to a view made inside a custom Function, and
    ``F.linear`` on a [B, T, d] input returns a view of its [B·T, p] ``addmm`` result (as
    does ``addmm(...).view``). That buffer was made inside the op and nothing else holds or
    saved it (a rule never keeps its output), so the same memory is returned as a plain
    tensor (``aten._unsafe_view``: no copy, but a version counter of its own). A view of one
    of the op's inputs must stay tied to that input and is copied instead (no rule of
    dpclip's returns one)."""
    if not is_view(out):
        return out
    storage = out.untyped_storage().data_ptr()
    if any(t.untyped_storage().data_ptr() == storage for t in inputs):
        return out.clone()
    return unsafe_view(out, out.shape)


class BookkeptOp(torch.autograd.Function):
    """y = layer(a); backward returns dL/da only and hands (a, dL/dy) to the engine.

    The parameters are inputs so that autograd calls this backward even when ``a``
    needs no gradient (the first layer); their gradient is ``None``, so autograd never
    forms the unweighted ``aᵀb``.
    """

    @staticmethod
    def forward(ctx, call: Call, x: Tensor, *params: Tensor) -> Tensor:
        ctx.call = call
        ctx.n_params = len(params)
        ctx.save_for_backward(x)
        return not_a_view(call.rule.forward(call.unit.module, x, call.info), (x,) + params)

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        (x,) = ctx.saved_tensors
        call: Call = ctx.call
        rule, module = call.rule, call.unit.module
        if call.keeper.silent:   # the certificate reads the loss head's cotangents: zeros flow here
            return (None, torch.zeros_like(x) if ctx.needs_input_grad[1] else None) + (None,) * ctx.n_params
        refuse_backward_in_forward(call)
        try:
            with pinned(module, call.weights):
                grad_x = rule.input_grad(module, x, grad_out, call.info) if ctx.needs_input_grad[1] else None
                call.keeper.deliver_layer(call, x, grad_out)
        except DpclipError:
            raise
        except Exception as exc:
            raise engine_failure(call.unit.label, f"backward ({rule.name} rule)", (x, grad_out), exc) from exc
        return (None, grad_x) + (None,) * ctx.n_params


class OutputTap(torch.autograd.Function):
    """Identity on a module's outputs; its backward sees all output grads at once.

    The outputs are copies: a view would make an in-place change of the module's output
    (``out += y``) an autograd error, and the module's own backward may have saved the
    original. The copy is small beside the per-sample recomputation of the torch.func rule,
    the only user of a tap."""

    @staticmethod
    def forward(ctx, call: Call, n_out: int, *tensors: Tensor):
        ctx.call = call
        ctx.n_out = n_out
        ctx.n_params = len(tensors) - n_out
        return tuple(t.clone() for t in tensors[:n_out])

    @staticmethod
    def backward(ctx, *grads: Tensor):
        if ctx.call.keeper.silent:   # the certificate reads the loss head's cotangents (above)
            passed = tuple(torch.zeros_like(g) if ctx.needs_input_grad[2 + i] and g is not None else None
                           for i, g in enumerate(grads))
            return (None, None) + passed + (None,) * ctx.n_params
        refuse_backward_in_forward(ctx.call)
        try:
            with pinned(ctx.call.unit.module, ctx.call.weights):
                ctx.call.keeper.deliver_tap(ctx.call, grads)
        except DpclipError:
            raise
        except Exception as exc:
            raise engine_failure(ctx.call.unit.label, "per-sample backward (torch.func fallback)", grads, exc,
                                 ctx.call.unit.module) from exc
        passed = tuple(g if ctx.needs_input_grad[2 + i] else None for i, g in enumerate(grads))
        return (None, None) + passed + (None,) * ctx.n_params


class Site(SiteBatch):
    """The :class:`~dpclip.engine.layers.Capture` a rule's ``call`` gets for one unit (its
    batch-axis part: :class:`~dpclip.engine.batch_axis.site.SiteBatch`)."""

    def __init__(self, keeper: Any, unit: Any):   # the Bookkeeper, and its Unit for this module
        super().__init__(keeper.axes)
        self._keeper, self._unit = keeper, unit
        self.module = unit.module
        self.label = unit.label
        self.memo = unit.memo
        self._derived = {name: [p for _, p, _ in originals] for name, originals in unit.derived}

    @property
    def _names(self) -> list[str]:   # read at each call: a unit may adopt a child's parameters
        return [name for name, _, _ in self._unit.params]

    @property
    def _by_name(self) -> dict[str, Tensor]:
        # Read at each call, not kept: a sharded model (FSDP, docs/distributed.md) swaps the
        # module's parameters for whole ones around its forward and backward. A parametrized
        # tensor is evaluated (once per call: the call runs under parametrize.cached()).
        parameters = own_parameters(self.module)   # a contained one ("ia3_l.default") through its container
        by_name = {name: parameters[name] if name in parameters else self.module.get_parameter(name)
                   for name in self._names}
        for name, t in by_name.items():
            if t.grad_fn is not None:   # a parameter is a leaf; torch.func.functional_call swapped in a result
                refuse_computed_parameter(self.label, name)
        for name in self._derived:
            by_name[name] = getattr(self.module, name)
        return by_name

    def _op_inputs(self, by_name: dict[str, Tensor], names: tuple[str, ...]) -> list[Tensor]:
        """The tensors a book-kept call takes as inputs so that autograd runs its backward
        (returning None for them): the parameters, and for a parametrized tensor its originals
        (W itself is not an input: its graph to the originals is walked by the engine alone)."""
        leaves = []
        for n in names:
            leaves.extend(self._derived.get(n, (by_name[n],)))
        return leaves

    @property
    def params(self) -> list[tuple[str, Tensor]]:
        return list(self._by_name.items())

    def op(self, rule, x: Tensor, info=None, names=None) -> Tensor:
        by_name = self._by_name   # built once per call: the host's time bounds a small GPU step
        names = tuple(by_name) if names is None else tuple(names)
        if not names:  # nothing trainable: plain autograd through the frozen parameters
            return rule.forward(self.module, x, info)
        keeper, unit = self._keeper, self._unit
        call = Call(keeper, unit, keeper.call_generation, rule, info, names, batch=keeper.axes.batch,
                     weights={n: by_name[n] for n in names if n in self._derived}, replica=keeper.recomputing > 0)
        keeper.count(unit, names)
        return BookkeptOp.apply(call, x, *self._op_inputs(by_name, names))

    def tap(self, outputs: list[Tensor], on_grads: Callable) -> tuple[Tensor, ...]:
        keeper, unit = self._keeper, self._unit
        by_name = self._by_name
        names = tuple(by_name)
        call = Call(keeper, unit, keeper.call_generation, names=names, on_grads=on_grads,
                     batch=keeper.axes.batch, weights={n: by_name[n] for n in self._derived},
                     replica=keeper.recomputing > 0)
        keeper.count(unit, names)
        return OutputTap.apply(call, len(outputs), *outputs, *self._op_inputs(by_name, names))

    @contextmanager
    def bypass(self) -> Iterator[None]:
        """Calls of this module inside run its original forward."""
        self._unit.bypass = True
        try:
            yield
        finally:
            self._unit.bypass = False

    def plain(self):
        return self._keeper.plain()
