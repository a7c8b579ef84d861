"""Two of the three parts ``make_private`` wraps (docs/python-api.md): the per-sample criterion
and the noising optimizer; the loader is :mod:`dpclip.integrations.loaders`. They share a
:class:`~dpclip.integrations.rows.DrawTracker`, which holds the loop to one noisy step per drawn
batch, over that batch's own rows.

Length: a little over 400 lines: the loss's every way out of its values, and the optimizer's
refusals of a step that is not due, belong beside the parts they guard.
"""

from __future__ import annotations

import copy
import math
import numbers
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from dpclip.accounting import check_same_release
from dpclip.engine import DPEngine
from dpclip.engine.certificate import RTOL
from dpclip.engine.certificate.verdict import NOT_COVERED
from dpclip.errors import DpclipError
from dpclip.integrations.rows import DrawTracker
from dpclip.integrations.setup import Account
from dpclip.torch_compat import tree_flatten, tree_unflatten


# ----------------------------------------------------------------------------- the loss

WEIGHT_HINT = ("scale by a Python number fixed before the step (float(w)); per-sample weights come as a column of "
               "the dataset (loss * batch['weight']), or inside the criterion (it is checked on each sample alone)")


#: torch functions that would differentiate or reduce a private loss outside the engine
_GRADIENT_FUNCS = {torch.autograd.backward, torch.autograd.grad, Tensor.backward}
_REDUCTIONS = {torch.mean, torch.sum, Tensor.mean, Tensor.sum}


def _refuse_reduction() -> None:
    raise DpclipError("a private loss reduced (.mean(), .sum()) or differentiated by torch itself: its gradient would "
                      "leave the engine unclipped", "call loss.backward() on the loss the criterion returned (it is "
                      "already per sample); loss.item() is its mean, for your logs")


class PrivateLoss:
    """A batch's per-sample losses. ``backward()`` hands them to the engine (per-sample
    norms and clipped sums); ``item()`` is their mean over the drawn batch, for your own
    logs only: computed without noise from private data, it is not covered by ε. Every
    way out of their values (``item()``, ``float``, a format, a comparison, ``detach()``,
    ``per_sample``, a torch function) marks the read for the statement; pickling is refused."""

    __slots__ = ("_losses", "_engine", "_tracker")

    def __init__(self, per_sample: Tensor, engine: DPEngine, tracker: DrawTracker | None = None):
        object.__setattr__(self, "_losses", per_sample)
        object.__setattr__(self, "_engine", engine)
        object.__setattr__(self, "_tracker", tracker)

    def __setattr__(self, name: str, value: Any) -> None:
        # a loop that swapped the tracker (or cleared its mark) would backward unchecked, or unnamed
        raise DpclipError(f"loss.{name} set: a private loss is read-only (its rows, the engine and the loop's "
                          "checks are fixed when the criterion returns it)", "compute a new loss with the "
                          "criterion; loss * w, loss / k and loss + c return new private losses")

    @property
    def per_sample(self) -> Tensor:
        """The per-sample losses themselves [b]: a read of private values (the statement names it)."""
        self._read()
        return self._losses

    def backward(self, gradient: Any = None, retain_graph: bool | None = None, create_graph: bool = False,
                 inputs: Any = None) -> None:
        """The engine's one backward over the rows (``retain_graph`` is accepted and has no effect)."""
        if gradient is not None or create_graph or inputs is not None:
            raise DpclipError("loss.backward() of a private loss takes no gradient=, create_graph= or inputs=",
                              "call loss.backward(): the engine weighs, clips and sums each sample's gradient itself")
        if self._losses.numel() and not self._losses.requires_grad:   # torch's own error came from the engine
            raise DpclipError("loss.backward() of a loss computed without gradients (the forward under "
                              "torch.no_grad() or inference_mode, or its outputs detached)", "run the training "
                              "forward with gradients on; evaluate with the criterion you passed to make_private")
        weights = None
        if self._tracker is not None:   # before the engine sees anything: a refused backward clips nothing
            self._tracker.backward(self._losses.shape[0])
            weights = self._tracker.weights(self._losses.shape[0])
        if self._losses.numel():
            if self._tracker is None:
                self._engine.backward(self._losses, row_weights=weights)
            else:
                with self._tracker.engine_backward():
                    self._engine.backward(self._losses, row_weights=weights)
        else:  # an empty draw: nothing to clip, the step releases noise alone; across ranks, a
            self._engine.policy.empty_part()  # policy may exchange norms in the backward skipped here

    def item(self) -> float:
        self._read()
        return float(self._losses.detach().mean()) if self._losses.numel() else math.nan

    def _read(self) -> None:
        """The loop sees a value computed without noise: the statement names it (not covered by ε)."""
        if self._tracker is not None:
            self._tracker.losses_read = True

    def __float__(self) -> float:
        return self.item()

    def __format__(self, spec: str) -> str:
        return format(self.item(), spec)

    def detach(self) -> Tensor:
        self._read()
        return self._losses.detach().mean()

    def __iter__(self):
        # torch.amp.GradScaler.scale() takes anything iterable for a list of losses: refused here,
        # where it is still one call (its own error was a ValueError from inside torch)
        raise DpclipError("a private loss handed to torch.amp.GradScaler (or iterated): its scale() and step() would "
                          "multiply the loss by a batch-wide tensor and unscale the noisy gradients outside the "
                          "engine", "drop the GradScaler: call loss.backward() and optimizer.step() (bf16 autocast "
                          "needs no loss scale; make_private takes no static loss scale for float16: use bf16, or "
                          "the engine's engine.backward(losses, loss_scale=...), docs/engine.md, \"Mixed precision\")")

    def __copy__(self) -> PrivateLoss:
        return PrivateLoss(self._losses, self._engine, self._tracker)

    def __reduce_ex__(self, protocol: Any) -> Any:
        # torch.save, pickle and deepcopy would carry the per-sample losses out of the loop unmarked
        raise DpclipError("a private loss pickled, saved (torch.save) or deep-copied: it holds the batch's per-sample "
                          "losses and the engine", "save loss.item() (the batch's mean loss, named in the statement "
                          "as not covered by ε), or loss.per_sample.detach() if you need each sample's")

    @property
    def requires_grad(self) -> bool:
        return self._losses.requires_grad

    def mean(self, *args: Any, **kwargs: Any) -> None:
        _refuse_reduction()

    def sum(self, *args: Any, **kwargs: Any) -> None:
        _refuse_reduction()

    # Arithmetic keeps the per-sample rows (`loss / accumulation`, `loss * w`): each sample's loss is
    # transformed alone, so each sample's gradient is still clipped alone. A term that carries
    # gradients of its own (a regularizer on the parameters) would reach them outside the clip.
    def _with(self, other: Any, op: Callable[[Tensor, Any], Tensor]) -> PrivateLoss:
        if isinstance(other, PrivateLoss):
            raise DpclipError("two private losses combined: each is a batch's per-sample losses, and a step is one "
                              "batch's", "compute one loss per batch (its parts may be summed inside the criterion)")
        if isinstance(other, Tensor) and other.requires_grad:
            raise DpclipError("the private loss combined with a tensor that carries gradients (a regularizer?): its "
                              "gradient would reach the parameters outside the per-sample clipping",
                              "use the optimizer's weight_decay= (applied to the noisy gradient, a function of the "
                              "parameters alone), or put the term inside the criterion, per sample")
        if isinstance(other, Tensor) and other.numel() not in (1, self._losses.shape[0]):
            raise DpclipError(f"the private loss combined with a tensor of shape {tuple(other.shape)}",
                              "a number, or one value per sample from the data loader's batch")
        if isinstance(other, Tensor) and self._tracker is not None:
            # a weight computed from the batch (normalised over it, class counts, 1/len) lets one
            # example move every row's clipped gradient: only the drawn rows' own values are taken
            rows = self._losses.shape[0]
            if other.dim() == 0 or other.shape[0] != rows:
                raise DpclipError("the private loss combined with a tensor that is not one value per sample: it may "
                                  "be computed from the whole batch", WEIGHT_HINT)
            self._tracker.check_rows(other, rows, "a per-sample weight of the private loss", WEIGHT_HINT)
        return PrivateLoss(op(self._losses, other), self._engine, self._tracker)

    def __mul__(self, other): return self._with(other, lambda t, o: t * o)
    def __rmul__(self, other): return self._with(other, lambda t, o: o * t)
    def __truediv__(self, other): return self._with(other, lambda t, o: t / o)
    def __pow__(self, other): return self._with(other, lambda t, o: t ** o)
    def __add__(self, other): return self._with(other, lambda t, o: t + o)
    def __radd__(self, other): return self._with(other, lambda t, o: o + t)
    def __sub__(self, other): return self._with(other, lambda t, o: t - o)
    def __rsub__(self, other): return self._with(other, lambda t, o: o - t)
    def __neg__(self): return PrivateLoss(-self._losses, self._engine, self._tracker)
    # A tensor's comparisons compare values: so do these (the read is named); ``==`` by identity
    # would answer False for a loss equal to the number.
    def __eq__(self, other): return self._compare(other, lambda a, b: a == b)
    def __ne__(self, other): return self._compare(other, lambda a, b: a != b)
    __hash__ = object.__hash__   # kept hashable (a loss in a set or dict key is the object)

    def _compare(self, other: Any, op: Callable[[float, float], bool]) -> Any:
        if isinstance(other, PrivateLoss):
            return op(self.item(), other.item())
        if not isinstance(other, (numbers.Real, Tensor)) or (isinstance(other, Tensor) and other.numel() != 1):
            return NotImplemented
        return op(self.item(), float(other))

    def __lt__(self, other): return self.item() < float(other)
    def __le__(self, other): return self.item() <= float(other)
    def __gt__(self, other): return self.item() > float(other)
    def __ge__(self, other): return self.item() >= float(other)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        """Checks and logs (``torch.isnan(loss)``, ``torch.isfinite(loss)``) see the batch's mean loss,
        detached: for your own logs, not covered by ε."""
        if func in _GRADIENT_FUNCS or func in _REDUCTIONS:
            _refuse_reduction()

        leaves, spec = tree_flatten((args, kwargs or {}))   # torch.stack([loss]) too
        args, kwargs = tree_unflatten([a.detach() if isinstance(a, PrivateLoss) else a for a in leaves], spec)
        return func(*args, **kwargs)


class PrivateCriterion:
    """``criterion`` returning a :class:`PrivateLoss`: the criterion with ``reduction="none"``
    (a module or function that has no ``reduction`` must return one loss per sample); a
    sample's loss over several positions is their mean."""

    def __init__(self, criterion: Callable, engine: DPEngine, tracker: DrawTracker | None = None):
        self.criterion = criterion
        self.engine = engine
        self._tracker = tracker
        if hasattr(criterion, "reduction"):
            self.unreduced = copy.copy(criterion)
            self.unreduced.reduction = "none"
        else:
            self.unreduced = criterion
        self.refusal: str | None = None   # make_private(compile=True): the loop calls train_step instead

    #: the loop's checks, fixed at make_private (a tracker swapped for None would leave them off)
    tracker = property(lambda self: self._tracker)

    def __call__(self, outputs: Tensor, targets: Any) -> PrivateLoss:
        if self.refusal is not None:
            raise DpclipError("the criterion called in a make_private(compile=True) loop: the forward ran outside "
                              "dpclip's graph", self.refusal)
        losses = self.per_sample(outputs, targets)
        if self.tracker is not None:
            self.tracker.loss(losses.shape[0])
            self.tracker.check_rows(targets, losses.shape[0], "the criterion's target")
        return PrivateLoss(losses, self.engine, self.tracker)

    def per_sample(self, outputs: Tensor, targets: Any) -> Tensor:
        """One loss per sample [b]: the criterion unreduced, a sample's positions averaged; checked on
        the certificate's samples alone when it checks the model's forward."""
        losses = self._unreduced(outputs, targets)
        if not torch.compiler.is_compiling() and self.engine.certificate.checking():
            self._check_alone(outputs, targets, losses)
        return losses

    def _unreduced(self, outputs: Any, targets: Any) -> Tensor:
        losses = self.unreduced(outputs, targets)
        rows = outputs.shape[0] if isinstance(outputs, Tensor) and outputs.dim() else None
        if not isinstance(losses, Tensor) or losses.dim() == 0 or (rows is not None and losses.shape[0] != rows):
            shape = tuple(losses.shape) if isinstance(losses, Tensor) else type(losses).__name__
            raise DpclipError(f"the criterion returned {shape}, not one loss per sample of the batch",
                              "pass a criterion with a `reduction` argument (nn.CrossEntropyLoss()) or one that "
                              "returns per-sample losses: a loss reduced over the batch cannot be clipped per sample")
        return losses.flatten(1).mean(1) if losses.dim() > 1 else losses

    def _check_alone(self, outputs: Any, targets: Any, losses: Tensor) -> None:
        """Sample i's loss from its own outputs and targets alone is its loss in the batch. A loss
        scaled by a statistic of the batch (a batch-mean baseline) lets one example move every row;
        detached, it is a constant to the graph, which is all the certificate reads of a loss."""
        b = losses.shape[0]
        if b < 2:
            return
        rtol = RTOL.get(losses.dtype, 2.0 ** -5)
        floor = 1e-3 * float(losses.detach().abs().max())
        hint = ("compute each sample's loss from its own outputs and targets only (reduction='none'); a weight "
                "or baseline computed from the batch belongs in the dataset, as a column of each example")
        with torch.no_grad():
            for r in self.engine.certificate.rows(b):
                try:
                    alone = self._unreduced(rows_of(outputs, r, b), rows_of(targets, r, b))
                except Exception as exc:   # noqa: BLE001  (the user's criterion, on one sample)
                    raise DpclipError(f"the criterion fails on one sample alone ({type(exc).__name__}), so its "
                                      "losses cannot be checked to be each sample's own", hint) from exc
                a, b_r = float(alone.reshape(-1)[0]), float(losses[r])
                if not abs(a - b_r) <= rtol * max(abs(a), abs(b_r), floor, 1e-30) and not (a != a and b_r != b_r):
                    raise DpclipError("the criterion gives a sample another loss alone than in its batch: the "
                                      "losses mix samples (a loss normalised or weighted by the batch, even "
                                      "detached), so one example moves other samples' clipped gradients" + NOT_COVERED,
                                      hint)


def rows_of(tree: Any, r: int, rows: int) -> Any:
    """``tree`` with each tensor of ``rows`` rows cut to row ``r`` (kept as a batch of one)."""
    leaves, spec = tree_flatten(tree)
    return tree_unflatten([t[r:r + 1] if isinstance(t, Tensor) and t.dim() and t.shape[0] == rows else t
                           for t in leaves], spec)


# ----------------------------------------------------------------------------- the optimizer

class PrivateOptimizer(torch.optim.Optimizer):
    """``optimizer`` whose ``step()`` is the private step: the engine clips, adds the noise and
    writes ``p.grad``; the ledger charges the step; then ``optimizer`` steps. Its param groups,
    state and defaults are the wrapped optimizer's (learning-rate schedulers work on it)."""

    def __init__(self, optimizer: torch.optim.Optimizer, engine: DPEngine, account: Account,
                 tracker: DrawTracker | None = None):
        # Not Optimizer.__init__: the param groups and state are the wrapped optimizer's own.
        self.original = optimizer
        self.engine = engine
        self.account = account
        self._tracker = tracker
        self.record_grad_norm = False          # DPTrainer logs it (the noisy gradient's: covered by ε)
        # called with the step's number and its noisy gradients before it is charged or stepped
        # (DPTrainer: a redone step must release what it did before the resume)
        self.on_release: Callable[[int, list[Tensor]], None] | None = None
        self.last_grad_norm: float | None = None
        self.parts_taken = 0   # DPTrainer: the parts backwarded since the last noisy step (count_part)
        self.parts_per_step: int | None = None   # DPTrainer: the parts each noisy step takes (its draw's)
        self._optimizer_step_pre_hooks = {}
        self._optimizer_step_post_hooks = {}
        self._optimizer_state_dict_pre_hooks = {}
        self._optimizer_state_dict_post_hooks = {}
        self._optimizer_load_state_dict_pre_hooks = {}
        self._optimizer_load_state_dict_post_hooks = {}

    #: the loop's checks, fixed at make_private (a tracker swapped for None would leave them off)
    tracker = property(lambda self: self._tracker)
    param_groups = property(lambda self: self.original.param_groups,
                            lambda self, value: setattr(self.original, "param_groups", value))
    state = property(lambda self: self.original.state, lambda self, value: setattr(self.original, "state", value))
    defaults = property(lambda self: self.original.defaults,
                        lambda self, value: setattr(self.original, "defaults", value))

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.original.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Refused unless the engine privatises every parameter of ``param_group``."""
        params = param_group["params"]
        self._check_params([{"params": [params] if isinstance(params, Tensor) else list(params)}])
        self.original.add_param_group(param_group)

    def _check_params(self, groups: list[dict[str, Any]]) -> None:
        """A parameter the engine does not privatise (a layer unfrozen or replaced after make_private)
        would be stepped with its raw gradient: unclipped, without noise."""
        known = {id(info.param) for info in self.engine.groups.params}   # what the engine privatises
        outside = [p for group in groups for p in group["params"] if id(p) not in known]
        if outside:
            raise DpclipError(f"the optimizer holds {len(outside)} parameter(s) the engine does not privatise (added, "
                              "unfrozen or replaced after make_private): their raw gradients would be stepped "
                              "unclipped and without noise", "unfreeze, replace or add layers before make_private, "
                              "and build the optimizer on the parameters that train")

    def count_part(self, parts: int) -> None:
        """DPTrainer: one more part of the step's draw goes through the engine's backward. More than the
        draw's ``parts`` before the step (a training_step run twice) would add an example's clipped
        gradient to its step twice, twice the sensitivity the noise is calibrated for."""
        self.parts_taken += 1
        if self.parts_taken > parts:
            raise DpclipError(f"a training step over more parts than the draw has ({parts} per optimizer step): a "
                              "part backwarded twice puts each of its examples' clipped gradients into the step "
                              "twice, more than the noise is calibrated for", "call super().training_step once "
                              "per part (the Trainer's gradient_accumulation_steps parts make one noisy step)")

    def step(self, closure: Callable | None = None) -> None:
        if closure is not None:
            raise DpclipError("a private step takes no closure",
                              "a closure would evaluate the loss again: compute it once, call loss.backward(), "
                              "then optimizer.step()")
        # Param groups added since make_private: refused while the draw is still open, so that a
        # corrected loop's step releases that draw's sums and nothing else.
        self._check_params(self.param_groups)
        self._check_due()
        if self.tracker is not None and not self.tracker.step():
            return   # a part of the drawn batch: its noisy step comes after the last part
        plan, self.parts_taken = self.account.plan, 0
        try:
            if self.tracker is None:
                report = self.engine.privatize()
            else:
                with self.tracker.engine_release():
                    report = self.engine.privatize()
            check_same_release(report.participation_event, plan.step_event)   # before anything is charged or stepped
            if self.on_release is not None:
                self.on_release(self.account.ledger.steps + 1, [p.grad for group in self.param_groups
                                                                for p in group["params"] if p.grad is not None])
            self.account.ledger.record(plan.step_event, metadata=self.account.step_metadata)   # released iff charged
        except BaseException as exc:
            # Not charged, so not released: drop what the engine may have written, and refuse any
            # later step (its sums would be this failed step's or start from them).
            for group in self.param_groups:
                for p in group["params"]:
                    p.grad = None
            if self.tracker is not None:
                self.tracker.spoil("an optimizer.step()", exc)
            raise
        if self.record_grad_norm:   # of the noisy gradient the step applies: a post-processing of the release
            norms = [p.grad.detach().norm() for group in self.param_groups for p in group["params"]
                     if p.grad is not None]
            self.last_grad_norm = float(torch.stack(norms).norm()) if norms else 0.0
        self.original.step()

    def _check_due(self) -> None:
        """A step past the plan, or (DPTrainer) one whose draw's parts have not all gone through the
        engine (a callback's extra optimizer.step()), would release noise alone and charge a step
        the plan does not have: refused before anything is released or charged."""
        planned = self.account.plan.plan.steps
        if self.account.ledger.steps >= planned:
            raise DpclipError(f"optimizer.step() after the {planned} planned steps: ε covers the planned steps",
                              "ask for more steps (or epochs) when the run starts; step only where the loop "
                              "(or the Trainer) steps")
        if self.parts_per_step is not None and self.parts_taken < self.parts_per_step:
            raise DpclipError("optimizer.step() outside the Trainer's own step (a callback?): the draw's parts "
                              "have not gone through the engine, so it would release noise alone and charge a step "
                              "the plan does not have", "leave optimizer.step() to the Trainer; a callback may "
                              "change the learning rate or stop training (control.should_training_stop = True)")

    def signal_skip_step(self, do_skip: bool = True) -> None:
        """Opacus's BatchMemoryManager calls this: refused with its dpclip form."""
        raise DpclipError("Opacus's BatchMemoryManager does not drive dpclip's optimizer",
                          "pass max_physical_batch_size=M to make_private: its loader hands each drawn batch out "
                          "in parts of at most M rows, and the noisy step comes after the last part")

    # torch's hooks go on the wrapped optimizer: its step() (and state_dict) is the one that runs them,
    # after the noise (p.grad noisy, the step charged); a hook kept here would fail or never run
    def register_step_pre_hook(self, hook): return self.original.register_step_pre_hook(hook)
    def register_step_post_hook(self, hook): return self.original.register_step_post_hook(hook)
    def register_state_dict_pre_hook(self, hook, prepend=False):
        return self.original.register_state_dict_pre_hook(hook, prepend)
    def register_state_dict_post_hook(self, hook, prepend=False):
        return self.original.register_state_dict_post_hook(hook, prepend)
    def register_load_state_dict_pre_hook(self, hook, prepend=False):
        return self.original.register_load_state_dict_pre_hook(hook, prepend)
    def register_load_state_dict_post_hook(self, hook, prepend=False):
        return self.original.register_load_state_dict_post_hook(hook, prepend)

    def state_dict(self) -> dict[str, Any]:
        return self.original.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.original.load_state_dict(state_dict)

    def __repr__(self) -> str:
        return f"PrivateOptimizer({self.original!r})"

