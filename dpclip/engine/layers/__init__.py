"""Layer rules: how each layer type hands its per-sample gradients to the engine.

A rule turns one call of a module into :mod:`dpclip.engine.factors` uses (a
:class:`~dpclip.engine.factors.Bilinear` pair of factors, or an instantiated
:class:`~dpclip.engine.factors.Dense` gradient) for each of the module's own parameters
(docs/layer-rules.md, "Adding a layer rule"). One file per layer family lives next to this
one; each registers its rules on import::

    @register_layer_rule(nn.Linear)
    class LinearRule(LayerRule):
        name = "linear"
        def forward(self, module, x, info): ...        # the output, without autograd
        def input_grad(self, module, x, grad_out, info): ...
        def uses(self, module, x, grad_out, info): ...  # {param name: Use}
        def examples(self): ...                       # for the contract tests

The one-tensor protocol above (``prepare`` / ``forward`` / ``input_grad`` / ``uses``) is
what :meth:`LayerRule.call` runs by default: the input arrives with the batch in dim 0
(the engine established where the batch is, :mod:`dpclip.engine.batch_axis`, and moved it
there, or expanded a shared input over it), the book-keeping saves the prepared input
``a``, its backward hands ``(a, grad_out)`` to ``uses``. A rule for a module with several
inputs or inner structure (``nn.MultiheadAttention``) overrides :meth:`LayerRule.call`
and composes book-kept sub-operations itself through the :class:`Capture` it receives.
Modules without a rule get :data:`dpclip.engine.layers.functorch.FUNCTORCH_RULE`.
"""

from __future__ import annotations

import importlib
import sys
from typing import Callable, ContextManager, NamedTuple, Protocol

import torch
from torch import Tensor, nn

from dpclip.errors import EngineError


class Example(NamedTuple):
    """A small module and a batch for the contract tests (tests/engine/layers).

    ``inputs`` has the batch in dim 0 of every tensor; ``run(module, *inputs)`` gives the
    output tensor (default: ``module(*inputs)``)."""

    module: nn.Module
    inputs: tuple[Tensor, ...]
    run: Callable | None = None


class Capture(Protocol):
    """What the book-keeping hands a rule's :meth:`LayerRule.call` (one module, one call).

    ``op(rule, x, info, names)`` runs ``rule.forward(module, x, info)`` as one book-kept
    operation (``x`` with the batch in dim 0): its backward returns ``rule.input_grad(...)``
    and delivers ``rule.uses(...)`` (one use for each parameter in ``names``; all of the
    module's trainable parameters by default). ``tap(outputs, on_grads)`` is the identity on
    ``outputs``; in the backward, ``on_grads(grads, batch)`` returns the uses.

    ``layout`` is the call's :class:`~dpclip.engine.batch_axis.CallLayout`;
    ``layout_of(t)`` the established :class:`~dpclip.engine.batch_axis.Layout` of one
    tensor the module was called with; ``batch_first(t, feature_dims)`` moves (or expands)
    its batch to dim 0 and returns the map that puts an output back.
    """

    module: nn.Module
    label: str
    batch_size: int
    batch_hint: int | None      # = batch_size (the former name)
    params: list[tuple[str, nn.Parameter]]
    memo: dict
    layout: object

    def layout_of(self, t: Tensor): ...
    def note_expanded(self, t: Tensor) -> None: ...
    def batch_first(self, t: Tensor, feature_dims: int | None = None): ...
    def chained(self, rule, x: Tensor) -> Tensor: ...
    def children_batch_first(self) -> ContextManager[None]: ...

    def op(self, rule, x: Tensor, info=None, names: list[str] | None = None) -> Tensor: ...
    def tap(self, outputs: list[Tensor], on_grads: Callable) -> tuple[Tensor, ...]: ...
    def bypass(self) -> ContextManager[None]: ...
    def plain(self) -> ContextManager[None]: ...


def example_tensor(*shape: int, seed: int, high: int | None = None) -> Tensor:
    """A float64 (or, with ``high``, integer in [0, high)) tensor for :class:`Example`s.

    Synthetic inputs of the contract tests only: no private data and no noise is drawn here,
    so a fixed seed is what makes the examples reproducible, not a leak."""
    g = torch.Generator().manual_seed(seed)
    if high is not None:
        return torch.randint(0, high, shape, generator=g)
    return torch.randn(*shape, generator=g, dtype=torch.float64)


def seeded(module: nn.Module, seed: int) -> nn.Module:
    """``module`` in float64 with every parameter redrawn from ``seed`` (no global RNG).

    For the contract tests' example modules only (public synthetic weights, never noise)."""
    module = module.double()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.5 + 0.1)
    return module


def expand_batch(x: Tensor, batch_hint: int | None) -> Tensor:
    """The identity, kept for rules written before the engine established the batch axis:
    it used to expand any input of leading size 1 over the batch, a guess from a size. The
    input a rule's ``prepare`` gets now has the batch in dim 0 already (a shared input was
    expanded by :meth:`Capture.batch_first` where its consumers were proven to broadcast it)."""
    return x


def flat3(t: Tensor) -> Tensor:
    """[B, *, k] -> [B, T, k] (T = product of the middle dims, 1 if none)."""
    return t.reshape(t.shape[0], -1, t.shape[-1])


class LayerRule:
    """How one layer type is book-kept (one entry of the rule registry).

    Subclass it and override the methods (module doc; docs/layer-rules.md, "Adding a layer rule").

    prepare(module, x, batch_size) -> (activation, info): runs under autograd before the
        book-kept op, on ``x`` with the batch in dim 0 (pads, normalises for norm layers).
    feature_dims(module): None, or the trailing feature axes of a position-wise rule.
    forward(module, activation, info) -> output: the layer's output, run without autograd.
    input_grad(module, activation, grad_out, info) -> grad of the activation.
    uses(module, activation, grad_out, info) -> {param name: Use}: per-sample gradients
        of the module's own parameters, as factors or instantiated.
    check(module, label): refuse at engine construction what the rule cannot make exact.
    examples() -> [Example]: modules of every registered type, for the contract tests.
    """

    name = "rule"
    #: counts as supported by strict mode (only the torch.func rule sets this False)
    exact_by_construction = True
    #: wrap the module even when it owns no trainable parameter (its forward must route
    #: a child's parameters through the child's call, as nn.MultiheadAttention's does not)
    wrap_frozen = False
    def feature_dims(self, module: nn.Module) -> int | None:
        """None: the rule needs the batch in axis 0 of its input. An int f: the rule is
        position-wise (every position of the leading axes is independent; f trailing
        feature axes), so the engine may move the batch to the front from any leading axis
        or unflatten it from a batch·position axis (docs/layer-rules.md, "The batch axis")."""
        return None

    @property
    def default_call(self) -> bool:
        """Whether :meth:`call` is the one-tensor default (not overridden)."""
        return type(self).call is LayerRule.call

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r}>"

    def check(self, module: nn.Module, label: str) -> None:
        """Raise :class:`EngineError` for configurations the rule cannot make exact."""

    def ragged_inputs(self, module: nn.Module, leaves: list[Tensor]) -> frozenset[int]:
        """Indices of the call's tensors (in tree order) that hold several samples' rows
        concatenated, which no axis separates and the rule splits itself (an EmbeddingBag's
        1-D input, cut into bags by its offsets): their layout is not checked. Default: none."""
        return frozenset()

    def prepare(self, module: nn.Module, x: Tensor, batch_hint: int | None):
        return expand_batch(x, batch_hint), None

    def forward(self, module: nn.Module, x: Tensor, info) -> Tensor:
        raise NotImplementedError

    def input_grad(self, module: nn.Module, x: Tensor, grad_out: Tensor, info) -> Tensor | None:
        raise NotImplementedError

    def uses(self, module: nn.Module, x: Tensor, grad_out: Tensor, info) -> dict:
        raise NotImplementedError

    def examples(self) -> list[Example]:
        return []

    def call(self, module: nn.Module, capture: Capture, args: tuple, kwargs: dict):
        """The module's forward while the engine is attached (default: one tensor in)."""
        inputs = list(args) + list(kwargs.values())
        if len(inputs) != 1:
            raise EngineError(f"module {capture.label} was called with {len(inputs)} arguments; "
                              "its rule takes the input tensor only", "call it as module(x)")
        if capture.layout.dead:   # its output is only detached: no gradient, nothing to book-keep
            with capture.bypass():
                return module(inputs[0])
        if capture.layout.consumers is not None:   # a shared input, broadcast after a chain
            return capture.chained(self, inputs[0])
        x, restore = capture.batch_first(inputs[0], self.feature_dims(module))
        x, info = self.prepare(module, x, capture.batch_size)
        return restore(capture.op(self, x, info))


_RULES: dict[type, LayerRule] = {}


def register_layer_rule(module_type: type, rule: LayerRule | type | None = None):
    """Register ``rule`` for ``module_type`` (and subclasses that keep its ``forward``).

    ``register_layer_rule(nn.Linear, rule)`` registers at once; ``@register_layer_rule(T)``
    decorates a :class:`LayerRule` subclass (registered as an instance) or an instance.
    Returns what it registered (the decorated object for the decorator form)."""
    def register(obj):
        instance = obj() if isinstance(obj, type) else obj
        if not isinstance(instance, LayerRule):
            raise TypeError(f"register_layer_rule needs a LayerRule, got {obj!r}")
        _RULES[module_type] = instance
        return obj

    return register if rule is None else register(rule)


_LAZY_RULES: dict[tuple[str, str], LayerRule] = {}


def register_lazy_layer_rule(module_name: str, class_name: str, rule: LayerRule) -> None:
    """Register ``rule`` for class ``class_name`` of module ``module_name`` once that module
    is imported (by whoever builds the model), without importing it here."""
    _LAZY_RULES[(module_name, class_name)] = rule


def _resolve_lazy(import_missing: bool) -> None:
    for (module_name, class_name), rule in list(_LAZY_RULES.items()):
        if module_name not in sys.modules and not import_missing:
            continue
        _LAZY_RULES.pop((module_name, class_name))
        try:
            module_type = getattr(importlib.import_module(module_name), class_name)
        except (ImportError, AttributeError):  # pragma: no cover - another transformers
            continue
        _RULES.setdefault(module_type, rule)


def unregister_layer_rule(module_type: type) -> LayerRule | None:
    """Remove the rule registered for exactly ``module_type``; return it (None if none)."""
    _resolve_lazy(import_missing=False)
    return _RULES.pop(module_type, None)


def registered_rules() -> dict[type, LayerRule]:
    """A copy of the registry: module type -> rule (lazily registered ones imported)."""
    _resolve_lazy(import_missing=True)
    return dict(_RULES)


def find_layer_rule(module: nn.Module) -> LayerRule | None:
    """The rule for ``module``: its class or the nearest base class with a rule whose
    ``forward`` the module did not override (a subclass with its own forward may compute
    something else, so it goes to the torch.func rule)."""
    if _LAZY_RULES:
        _resolve_lazy(import_missing=False)
    for cls in type(module).__mro__:
        rule = _RULES.get(cls)
        if rule is not None:
            return rule if type(module).forward is cls.forward else None
    return None


__all__ = ["Capture", "Example", "LayerRule", "example_tensor", "expand_batch", "seeded", "find_layer_rule", "flat3",
           "register_lazy_layer_rule", "register_layer_rule", "registered_rules", "unregister_layer_rule"]

# The layer families register their rules on import (after the registry exists).
from dpclip.engine.layers import linear as _linear  # noqa: E402,F401
from dpclip.engine.layers import embedding as _embedding  # noqa: E402,F401
from dpclip.engine.layers import conv as _conv  # noqa: E402,F401
from dpclip.engine.layers import norm as _norm  # noqa: E402,F401
from dpclip.engine.layers import attention as _attention  # noqa: E402,F401
from dpclip.engine.layers import embedding_bag as _embedding_bag  # noqa: E402,F401
