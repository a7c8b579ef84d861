"""Capture (activation, output gradient) in ONE backward, without autograd's weight grads.

Book-keeping (Bu et al., ICML'23; groupwise-clipping paper §2.2 and Algorithm 1): the
forward keeps each layer's input ``a``; the backward hands over its output gradient ``b``;
per-sample norms and the clipped sum ``aᵀ diag(c) b`` are then computed from the pair.
Ordinary autograd would *also* compute the unweighted weight gradient ``aᵀ b`` of every
layer, one wasted matmul per layer. To avoid it, each supported module's forward is
routed through :class:`~dpclip.engine.bookkept_ops.BookkeptOp`, a custom autograd function whose backward returns
the input gradient only (``None`` for the parameters) and passes ``(a, b)`` to the
engine. How a module's call becomes such operations is its layer rule's business
(:mod:`dpclip.engine.layers`): the rule's ``call`` receives a :class:`~dpclip.engine.bookkept_ops.Site` (the
:class:`~dpclip.engine.layers.Capture` of one module) and uses its ``op`` (a book-kept
operation) or ``tap`` (output gradients tapped, for the torch.func rule that modules
without a rule get).

How a module's forward is re-routed: an instance attribute ``forward`` shadows the class
method (``nn.Module.__call__`` looks it up on the instance), and :meth:`Bookkeeper.remove`
deletes it again. Hooks registered by the user keep working.

The two autograd functions and the call they carry are in :mod:`dpclip.engine.bookkept_ops`.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch
from torch import Tensor, nn
from torch.nn.utils import parametrize

from dpclip.engine.adoption import adopt
from dpclip.engine.batch_axis import BatchAxes, check_batch
from dpclip.engine.bookkept_ops import AWAITING_RECOMPUTE, Call, Site, engine_failure, refuse_transform
from dpclip.engine.batch_axis.layout import call_leaves, tensor_leaves
from dpclip.engine.factors import Use
from dpclip.engine.containers import container_owner, is_container, owned_parameters, without_aliases_below
from dpclip.engine.layers import LayerRule, find_layer_rule
from dpclip.engine.layers.functorch import FUNCTORCH_RULE, is_rmsnorm_like
from dpclip.engine.parametrized import Derived, derived_tensors, is_parametrization, original_uses
from dpclip.engine.precision import engine_math
from dpclip.engine.refusals import refuse_unsupported
from dpclip.engine.stash import StashMeter  # noqa: F401  (imported from here by microbatch)
from dpclip.errors import DpclipError, EngineError, raised_on_private_batch


@dataclass(eq=False)
class Unit:
    """A module that owns trainable parameters directly, and how it is book-kept."""

    module: nn.Module
    name: str
    params: list[tuple[str, nn.Parameter, int]]   # (attribute name, parameter, index)
    rule: LayerRule                               # FUNCTORCH_RULE when none matched
    is_fallback: bool                             # no exact rule: refused when strict
    orig_forward: Callable | None = None
    bypass: bool = False
    memo: dict = field(default_factory=dict)      # the rule's per-module state
    derived: Derived = field(default_factory=list)   # parametrized tensors (dpclip.engine.parametrized)

    @property
    def label(self) -> str:
        return f"{self.name or '<root>'} ({type(self.module).__name__})"


def build_units(model: nn.Module, index_of: dict[int, int], strict: bool) -> tuple[list[Unit], dict[int, list[str]]]:
    """One unit per module owning trainable parameters (``index_of``: ``id(param)`` -> index);
    refuse what cannot be exact (modules that mix samples, or read a child's parameters without
    calling it). Also returns, per parameter index, the names of its aliases that do not deliver
    its uses (:meth:`Bookkeeper.alias_note`)."""
    units: list[Unit] = []
    aliases: dict[int, list[str]] = {}
    for name, module in model.named_modules():
        refuse_unsupported(module, name, index_of)
        if is_parametrization(module):   # its originals are delivered by the module it parametrizes
            continue
        rule = find_layer_rule(module) or FUNCTORCH_RULE
        if is_container(module) and container_owner(model, name) is not None:
            continue   # its parameters are its owner's (below)
        params = [(pname, p, index_of[id(p)])
                  for pname, p in owned_parameters(module, contained=rule is FUNCTORCH_RULE)
                  if id(p) in index_of]
        derived = derived_tensors(module, name, index_of)
        if rule is FUNCTORCH_RULE and params:
            params, notes = without_aliases_below(module, name, params)
            for idx, note in notes:
                aliases.setdefault(idx, []).append(note)
        if not params and not derived and not (rule.wrap_frozen and any(
                id(p) in index_of for p in module.parameters())):
            continue
        unit = Unit(module, name, params, rule,
                    not rule.exact_by_construction and not is_rmsnorm_like(module), derived=derived)
        if unit.is_fallback and strict:
            raise EngineError(
                f"module {unit.label} has trainable "
                "parameters and no book-keeping rule; strict mode refuses the torch.func "
                "fallback", "set clipping.strict: false, freeze it, or register a rule "
                "with dpclip.engine.register_layer_rule (docs/layer-rules.md)")
        rule.check(module, unit.label)
        units.append(unit)
    return units, aliases


@dataclass
class _Active:
    """State of the engine.backward call in progress."""

    batch_size: int
    sink: Callable[[int, Use, bool], None]   # (parameter index, use, from a recomputation)
    generation: int


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
        self._waiting: dict[int, list[int]] = {}  # forwards in flight before the latest (pipelines)
        self._active: _Active | None = None
        self._plain = 0
        self.recomputing = 0   # > 0 while gradient checkpointing recomputes a forward (_recompute)
        # True while the certificate reads the loss head's cotangents: the zeros its hooks pass
        # into the model reach book-kept operations, which then deliver nothing
        self.silent = False
        self._lock = threading.Lock()
        self._handles: list = []
        self.strict = strict
        # the units, and per parameter index the names that do not deliver it
        self.units, self.aliases = build_units(model, index_of, strict)
        # Where the model's parameters live, read at every forward and backward: from a list
        # taken once, not a walk of the module tree each time (a module's .to() moves these
        # same tensors; FSDP's replacements are taken up in adopt_current_parameters).
        self._all_params = list(model.parameters())
        self.adopted: list[str] = []   # "child -> owner" (adopt_read_parameters)
        self.axes = BatchAxes(model, self.units, self.plain, self.device_types,   # which axis is the batch
                              on_probed=self.adopt_read_parameters)

    def __getstate__(self) -> dict:   # copy.deepcopy(model), torch.save(model): reached through the hooks
        raise DpclipError("a model with dpclip's engine attached cannot be copied or pickled whole: the copy would "
                          "take the engine along, its noise state included", "copy before make_private or DPEngine, "
                          "then ema.load_state_dict(model.state_dict()); save model.state_dict(), not the model")

    # ------------------------------------------------------------------ setup

    def adopt_read_parameters(self, called: set[int], reads: dict[int, set[int]], at_start: bool = True,
                              feeders: frozenset[int] | set[int] = frozenset()) -> bool:
        """Parameters no unit of their own can book-keep, taken by an enclosing torch.func unit
        (:func:`dpclip.engine.adoption.adopt`); True: the units changed, probe again."""
        return adopt(self, called, reads, at_start, feeders)

    def new_unit(self, module: nn.Module, name: str) -> Unit:
        """A torch.func unit for ``module``, routed from now on."""
        unit = Unit(module, name, [], FUNCTORCH_RULE, True)
        unit.orig_forward = module.forward
        module.forward = self._routed_forward(unit)
        self.units.append(unit)
        self.axes.units[id(unit)] = unit
        return unit

    def drop_unit(self, unit: Unit, owner: Unit) -> None:
        """``unit``'s parameters went to ``owner``: its module runs its own forward again."""
        if "forward" in unit.module.__dict__:
            del unit.module.__dict__["forward"]
        self.units.remove(unit)
        self.axes.units.pop(id(unit), None)
        self.adopted.append(f"{unit.label} -> {owner.label}")

    def alias_note(self, idx: int) -> str:
        """Why parameter ``idx`` may reach ``p.grad``: the aliases not delivering its uses."""
        return "; ".join(self.aliases.get(idx, ()))

    def adopt_current_parameters(self, why_sealed: str) -> dict[int, nn.Parameter]:
        """Each unit's parameters as its module holds them now (FSDP replaced them by shards),
        by index; no probe may run after (``why_sealed`` says why, in its refusal)."""
        adopted = {}
        for unit in self.units:
            for k, (name, _, idx) in enumerate(unit.params):
                param = unit.module.get_parameter(name)
                unit.params[k] = (name, param, idx)
                adopted[idx] = param
        self._all_params = list(self.model.parameters())
        self.axes.sealed = why_sealed
        return adopted

    def device_types(self) -> set[str]:
        """The device types of the model's parameters ("cpu", "cuda")."""
        return {p.device.type for p in self._all_params}

    def install(self) -> None:
        wrapped = [u.label for u in self.units if "forward" in u.module.__dict__]
        if wrapped:
            raise EngineError(
                f"modules {', '.join(wrapped[:3])} already have an instance-level forward "
                "(another DPEngine on this model?)", "call engine.detach() on the old engine first")
        for unit in self.units:
            unit.orig_forward = unit.module.forward
            unit.module.forward = self._routed_forward(unit)
        self._handles.append(
            self.model.register_forward_pre_hook(self.axes.pre_hook, with_kwargs=True))
        self._handles.append(self.model.register_forward_hook(
            self.axes.post_hook, with_kwargs=True, always_call=True))

    def remove(self) -> None:
        for unit in self.units:
            if "forward" in unit.module.__dict__:
                del unit.module.__dict__["forward"]
        for h in self._handles:
            h.remove()
        self._handles.clear()

    # ---------------------------------------------------------------- forward

    def is_plain(self) -> bool:
        """Whether a :meth:`plain` context is open."""
        return self._plain > 0

    def _passthrough(self, unit: Unit) -> bool:
        return unit.bypass or self._plain > 0 or not torch.is_grad_enabled()

    def count(self, unit: Unit, names: tuple[str, ...]) -> None:
        """One more forward use of each named parameter of ``unit`` (of each original of a
        named parametrized tensor). A recomputation's calls are not uses: the first forward's are."""
        if self.recomputing:
            return
        for name, _, idx in unit.params:
            if name in names:
                self.forward_counts[idx] += 1
        for name, originals in unit.derived:
            if name in names:
                for _, _, idx in originals:
                    self.forward_counts[idx] += 1

    def _await_recomputation(self, unit: Unit) -> None:
        """A call without gradients inside a forward with them (reentrant checkpointing): its
        uses, if any, come from its recomputation's backward (:data:`AWAITING_RECOMPUTE`)."""
        self.axes.skip(unit)
        for _, _, idx in [*unit.params, *(o for _, originals in unit.derived for o in originals)]:
            self.forward_counts[idx] += AWAITING_RECOMPUTE

    @property
    def call_generation(self) -> int:
        """The generation a book-kept call belongs to: a recomputation's, the backward's in progress."""
        return self._active.generation if self.recomputing else self.generation

    def _routed_forward(self, unit: Unit):
        orig = unit.orig_forward
        site = Site(self, unit)

        axes = self.axes
        def forward(*args, **kwargs):
            try:
                return routed(*args, **kwargs)
            except DpclipError as exc:   # its shapes show the realised batch size
                raised_on_private_batch(exc)
                raise

        def routed(*args, **kwargs):
            if axes.probe is not None:    # a probing forward: record, book-keep nothing
                return axes.probe.call(unit, orig, args, kwargs)
            if self._passthrough(unit) or axes.batch == 0:
                if axes.in_grad_forward() and not torch.is_grad_enabled() and not unit.bypass and not self._plain:
                    self._await_recomputation(unit)
                return orig(*args, **kwargs)
            refuse_transform(unit.label, axes.transform_at_entry)
            recomputing = axes.depth == 0 and self._active is not None
            kept = site.current_call()
            if recomputing:
                leaves = call_leaves(args, kwargs)
                site.set_call(axes.recomputed_layout(unit, leaves, self._active.batch_size), leaves)
            else:
                axes.enter(unit, site, args, kwargs)   # the call's established batch layout
            operation = f"{'recomputed ' if recomputing else ''}forward ({unit.rule.name} rule)"
            try:
                with self._recomputation() if recomputing else nullcontext(), \
                        parametrize.cached() if unit.derived else nullcontext():   # P once per call
                    return unit.rule.call(unit.module, site, args, kwargs)
            except DpclipError:
                raise
            except Exception as exc:
                if type(exc).__module__ == "torch.utils.checkpoint":   # its early stop, once all is recomputed
                    raise
                raise engine_failure(unit.label, operation, tensor_leaves((args, kwargs)), exc) from exc
            finally:   # the call's tensors are not held past it (checkpointing would not free them)
                site.set_call(*kept)

        return forward

    @contextmanager
    def _recomputation(self) -> Iterator[None]:
        """A book-kept module called inside engine.backward, outside any forward of the model:
        gradient checkpointing recomputing a forward (docs/supported-models.md, "Gradient checkpointing").
        The call runs the same book-kept operations again, laid out as the forward laid out this
        module's calls (:meth:`BatchAxes.recomputed_layout`), and counts no use. Non-reentrant
        checkpointing gives the forward's calls the recomputed tensors: their backwards deliver
        the uses and the recomputation's never run. Reentrant checkpointing ran the forward
        without gradients and differentiates the recomputation: its calls deliver the uses
        (:data:`~dpclip.engine.bookkept_ops.AWAITING_RECOMPUTE`)."""
        axes = self.axes
        kept, self.recomputing, axes.batch = axes.batch, self.recomputing + 1, self._active.batch_size
        try:
            yield
        finally:
            self.recomputing, axes.batch = self.recomputing - 1, kept

    @contextmanager
    def plain(self) -> Iterator[None]:
        """Run forwards with the original modules (recomputation in the fallback)."""
        self._plain += 1
        try:
            yield
        finally:
            self._plain -= 1

    # --------------------------------------------------------------- backward

    def start_forward(self) -> int:
        """A new forward while earlier ones wait for their backward (pipelines): a new generation."""
        if any(self.forward_counts):
            self._waiting[self.generation] = self.forward_counts
        self.forward_counts = [0] * len(self.forward_counts)
        self.generation += 1
        return self.generation

    def take_forward_counts(self, generation: int | None = None) -> tuple[list[int], int]:
        """Uses per parameter recorded by the forward of ``generation`` (None: the latest), and
        its generation; after the latest's, later forwards belong to the next generation."""
        if generation is not None and generation != self.generation:
            if generation not in self._waiting:
                raise EngineError(f"no forward of generation {generation} waits for its backward",
                                  "call engine.start_forward() before each micro-batch's forward")
            return self._waiting.pop(generation), generation
        counts, self.forward_counts = self.forward_counts, [0] * len(self.forward_counts)
        self.generation += 1
        return counts, self.generation - 1

    @contextmanager
    def backward_scope(self, batch_size: int, generation: int,
                       sink: Callable[[int, Use, bool], None]) -> Iterator[None]:
        self._active = _Active(batch_size, sink, generation)
        try:
            # The backward inherits the caller's autocast state and TF32 flags; the rules'
            # and the engine's math must be neither cast down nor rounded to TF32 by them
            # (dpclip.engine.precision).
            with engine_math(self.device_types()):
                yield
        finally:
            self._active = None

    def _check(self, call: Call) -> _Active:
        active = self._active
        if active is None:
            raise EngineError(
                f"module {call.unit.label} ran its backward outside engine.backward",
                "call engine.backward(per_sample_losses) instead of loss.backward() (with make_private: "
                "loss.backward() on the loss of the criterion it returned)")
        if call.generation != active.generation:
            raise EngineError(
                f"module {call.unit.label} belongs to a forward pass from before the "
                "previous engine.backward", "call engine.backward once after each forward")
        return active

    def deliver_layer(self, call: Call, x: Tensor, grad_out: Tensor) -> None:
        active = self._check(call)
        check_batch(call.unit.label, call.batch, active.batch_size)
        if x.dim() == 0 or x.shape[0] != active.batch_size or grad_out.shape[0] != active.batch_size:
            raise EngineError(   # a rule broke its contract: the batch first in both
                f"module {call.unit.label}: its rule saved an input of shape {tuple(x.shape)} "
                f"and an output gradient of shape {tuple(grad_out.shape)}, but the batch has "
                f"{active.batch_size} samples", "a rule's book-kept operation takes the batch in dim 0")
        uses = call.rule.uses(call.unit.module, x, grad_out, call.info)
        self._sink(active, call, uses)

    def deliver_tap(self, call: Call, grads: tuple[Tensor, ...]) -> None:
        active = self._check(call)
        check_batch(call.unit.label, call.batch, active.batch_size)
        self._sink(active, call, call.on_grads(grads, active.batch_size))


    def _sink(self, active: _Active, call: Call, uses: dict) -> None:
        derived = [(idx, use) for name, originals in call.unit.derived if name in call.names
                   for (_, _, idx), use in zip(originals, original_uses(
                       call.weights[name], [p for _, p, _ in originals], uses[name]))]
        with self._lock:  # autograd runs one thread per device on multi-GPU models
            for name, _, idx in call.unit.params:
                if name in call.names:  # exactly the parameters its forward counted
                    active.sink(idx, uses[name], call.replica)
            for idx, use in derived:
                active.sink(idx, use, call.replica)
