"""The three parts ``make_private`` wraps (docs/python-api.md): the Poisson-sampled loader,
the per-sample criterion and the noising optimizer."""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset, default_collate

from dpclip.accounting import check_same_release
from dpclip.data.sampler import PoissonSampler
from dpclip.engine import DPEngine
from dpclip.errors import DpclipError
from dpclip.integrations.setup import Account


# ----------------------------------------------------------------------------- the loader

class PoissonBatches(torch.utils.data.Sampler):
    """Batches of example indices, each example in each batch with probability q (``draws``: a
    :class:`~dpclip.data.sampler.PoissonSampler`, or a rank's sharded one).

    One pass (an "epoch") is ``steps_per_pass`` batches; the passes together make the planned
    steps. A pass started after the plan is spent is refused: ε covers the planned steps.
    """

    def __init__(self, draws: PoissonSampler, steps_per_pass: int):
        self.draws = draws
        self.steps_per_pass = steps_per_pass

    def __len__(self) -> int:
        return min(self.steps_per_pass, self.draws.steps - self.draws.step) or self.steps_per_pass

    def __iter__(self) -> Iterator[list[int]]:
        if self.draws.step >= self.draws.steps:
            raise DpclipError(f"the {self.draws.steps} planned steps are done",
                              "ε covers the steps make_private planned: ask for more epochs (or steps) there")
        draws = iter(self.draws)
        for _ in range(self.steps_per_pass):
            indices = next(draws, None)
            if indices is None:
                return
            yield indices.tolist()


def empty_batch_like(batch: Any) -> Any:
    """``batch`` with zero rows: the shapes and dtypes of a real batch, for an empty draw."""
    if isinstance(batch, Tensor):
        return batch[:0]
    if isinstance(batch, Mapping):
        return type(batch)({key: empty_batch_like(value) for key, value in batch.items()})
    if isinstance(batch, (list, tuple)):
        items = [empty_batch_like(value) for value in batch]
        return type(batch)(*items) if hasattr(batch, "_fields") else type(batch)(items)
    return batch


class EmptyDrawCollate:
    """The loader's collate function, and an empty Poisson draw as zero-row tensors (the step
    still happens: it releases noise and is charged)."""

    def __init__(self, dataset: Dataset, collate: Callable | None):
        self.dataset = dataset
        self.collate = collate or default_collate

    def __call__(self, rows: list) -> Any:
        if rows:
            return self.collate(rows)
        return empty_batch_like(self.collate([self.dataset[0]]))


def poisson_loader(loader: DataLoader, draws: PoissonSampler, steps_per_pass: int) -> DataLoader:
    """``loader``'s dataset and settings, with Poisson-sampled batches (:class:`PoissonBatches`)."""
    return DataLoader(loader.dataset, batch_sampler=PoissonBatches(draws, steps_per_pass),
                      collate_fn=EmptyDrawCollate(loader.dataset, loader.collate_fn), num_workers=loader.num_workers,
                      pin_memory=loader.pin_memory, worker_init_fn=loader.worker_init_fn,
                      prefetch_factor=loader.prefetch_factor, persistent_workers=loader.persistent_workers)


# ----------------------------------------------------------------------------- the loss

class PrivateLoss:
    """A batch's per-sample losses. ``backward()`` hands them to the engine (per-sample
    norms and clipped sums); ``item()`` is their mean over the drawn batch, for your own
    logs only: computed without noise from private data, it is not covered by ε."""

    def __init__(self, per_sample: Tensor, engine: DPEngine):
        self.per_sample = per_sample
        self.engine = engine

    def backward(self) -> None:
        if self.per_sample.numel():
            self.engine.backward(self.per_sample)
        else:  # an empty draw: nothing to clip, the step releases noise alone; across ranks, a
            self.engine.policy.empty_part()  # policy may exchange norms in the backward skipped here

    def item(self) -> float:
        return float(self.per_sample.detach().mean()) if self.per_sample.numel() else math.nan

    def __float__(self) -> float:
        return self.item()

    def detach(self) -> Tensor:
        return self.per_sample.detach().mean()


class PrivateCriterion:
    """``criterion`` returning a :class:`PrivateLoss`: the criterion with ``reduction="none"``
    (a module or function that has no ``reduction`` must return one loss per sample); a
    sample's loss over several positions is their mean."""

    def __init__(self, criterion: Callable, engine: DPEngine):
        self.criterion = criterion
        self.engine = engine
        if hasattr(criterion, "reduction"):
            self.unreduced = copy.copy(criterion)
            self.unreduced.reduction = "none"
        else:
            self.unreduced = criterion

    def __call__(self, outputs: Tensor, targets: Any) -> PrivateLoss:
        losses = self.unreduced(outputs, targets)
        rows = outputs.shape[0] if isinstance(outputs, Tensor) and outputs.dim() else None
        if not isinstance(losses, Tensor) or losses.dim() == 0 or (rows is not None and losses.shape[0] != rows):
            shape = tuple(losses.shape) if isinstance(losses, Tensor) else type(losses).__name__
            raise DpclipError(f"the criterion returned {shape}, not one loss per sample ({rows} rows)",
                              "pass a criterion with a `reduction` argument (nn.CrossEntropyLoss()) or one that "
                              "returns per-sample losses: a loss reduced over the batch cannot be clipped per sample")
        if losses.dim() > 1:
            losses = losses.flatten(1).mean(1)
        return PrivateLoss(losses, self.engine)


# ----------------------------------------------------------------------------- the optimizer

class PrivateOptimizer(torch.optim.Optimizer):
    """``optimizer`` whose ``step()`` is the private step: the engine clips, adds the noise and
    writes ``p.grad``; the ledger charges the step; then ``optimizer`` steps. Its param groups,
    state and defaults are the wrapped optimizer's (learning-rate schedulers work on it)."""

    def __init__(self, optimizer: torch.optim.Optimizer, engine: DPEngine, account: Account):
        # Not Optimizer.__init__: the param groups and state are the wrapped optimizer's own.
        self.original = optimizer
        self.engine = engine
        self.account = account
        self._optimizer_step_pre_hooks = {}
        self._optimizer_step_post_hooks = {}
        self._optimizer_state_dict_pre_hooks = {}
        self._optimizer_state_dict_post_hooks = {}
        self._optimizer_load_state_dict_pre_hooks = {}
        self._optimizer_load_state_dict_post_hooks = {}

    param_groups = property(lambda self: self.original.param_groups,
                            lambda self, value: setattr(self.original, "param_groups", value))
    state = property(lambda self: self.original.state, lambda self, value: setattr(self.original, "state", value))
    defaults = property(lambda self: self.original.defaults,
                        lambda self, value: setattr(self.original, "defaults", value))

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.original.zero_grad(set_to_none=set_to_none)

    def step(self, closure: Callable | None = None) -> None:
        if closure is not None:
            raise DpclipError("a private step takes no closure",
                              "a closure would evaluate the loss again: compute it once, call loss.backward(), "
                              "then optimizer.step()")
        report = self.engine.privatize()
        plan = self.account.plan
        check_same_release(report.dp_event, plan.step_event)   # before anything is charged or stepped
        self.account.ledger.record(plan.step_event, metadata=plan.step_metadata)
        self.original.step()

    def state_dict(self) -> dict[str, Any]:
        return self.original.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.original.load_state_dict(state_dict)

    def __repr__(self) -> str:
        return f"PrivateOptimizer({self.original!r})"

