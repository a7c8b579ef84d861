"""``make_private``: dpclip in an existing PyTorch loop, the way Opacus users write it
(docs/python-api.md).

    private = dpclip.make_private(model, optimizer, train_loader, criterion=nn.CrossEntropyLoss(),
                                  target_epsilon=8.0, delta=1e-5, epochs=3, max_grad_norm=1.0)
    model, optimizer, criterion, train_loader = private
    for epoch in range(3):
        for x, y in train_loader:            # Poisson-sampled logical batches
            optimizer.zero_grad()
            loss = criterion(model(x), y)     # per-sample losses, kept for the engine
            loss.backward()                   # one backward: per-sample norms, clipped sums
            optimizer.step()                  # noise, p.grad = (Σ clipped + noise) / B, charge
    private.epsilon(); private.save("out")   # ledger.json and privacy.json

What the pieces are:

- the data loader draws each example into each step with probability q = B/N from private
  randomness (OS entropy), an empty draw included, and refuses to run past the planned steps
  (ε covers those alone);
- the criterion returns a :class:`PrivateLoss` holding the per-sample losses (the criterion
  run with ``reduction="none"``; a loss already reduced over the batch is refused), whose
  ``backward()`` is :meth:`DPEngine.backward`;
- the optimizer's ``step()`` is :meth:`DPEngine.privatize` (clip, noise, normalise by the
  EXPECTED batch size B), then the ledger charges the step, then the wrapped optimizer steps.

The noise is calibrated as ``dpclip account`` does (the same (σ, q, steps) give the same ε),
with the budget split between the gradient and a threshold policy's statistic when the
clipping block asks for adaptive thresholds (docs/accounting.md, "Joint release").
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from pydantic import ValidationError
from torch import nn
from torch.utils.data import DataLoader, IterableDataset

from dpclip.accounting import Ledger, PlanResult, PrivacyPlan, solve, steps_for_epochs
from dpclip.engine import DPEngine
from dpclip.engine.groups import build_groups, trainable_params
from dpclip.errors import DpclipError
from dpclip.files import write_json_atomic
from dpclip.integrations.parts import PrivateCriterion, PrivateOptimizer, poisson_loader
from dpclip.recipe.schema import Clipping

PRIVACY_FORMAT = "dpclip-python-api-1"


# ----------------------------------------------------------------------------- make_private

@contextlib.contextmanager
def _quiet_rdp_orders() -> Iterator[None]:
    """dp_accounting logs (through absl) each RDP order its series skips, which only loosens
    the RDP ε shown alongside; ``dpclip`` silences it the same way (dpclip/cli/main.py)."""
    logger = logging.getLogger("absl")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


@dataclass
class PrivateTraining:
    """What :func:`make_private` returns. Unpacks as ``model, optimizer, criterion, data_loader``;
    ``engine``, ``ledger`` and ``plan`` are the parts behind them."""

    model: nn.Module
    optimizer: PrivateOptimizer
    criterion: PrivateCriterion
    data_loader: DataLoader
    engine: DPEngine
    ledger: Ledger
    plan: PlanResult

    def __iter__(self) -> Iterator[Any]:
        return iter((self.model, self.optimizer, self.criterion, self.data_loader))

    @property
    def noise_multiplier(self) -> float:
        """σ_eff, the total noise multiplier the accountant sees (``dpclip account --sigma``)."""
        return self.plan.split.sigma_total

    def epsilon(self) -> float:
        """ε of the steps taken so far, at the plan's δ (0 before the first step)."""
        with _quiet_rdp_orders():
            return self.ledger.epsilon() if self.ledger.steps else 0.0

    def statement(self) -> list[str]:
        """The privacy statement of the steps taken so far (the plan's before the first)."""
        if not self.ledger.steps:
            return self.plan.statement.lines()
        taken = replace(self.plan.plan, steps=self.ledger.steps, target_epsilon=None,
                        noise_multiplier=self.plan.split.sigma_total)
        with _quiet_rdp_orders():
            return solve(taken).statement.lines()

    def save(self, directory: str | Path) -> Path:
        """Write ``ledger.json`` (every charged step) and ``privacy.json`` (ε, δ, statement)."""
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        with _quiet_rdp_orders():
            write_json_atomic(out / "ledger.json", self.ledger.to_dict())
        plan = self.plan.plan
        write_json_atomic(out / "privacy.json", {
            "format": PRIVACY_FORMAT,
            "epsilon": self.epsilon(),
            "delta": plan.delta,
            "accountant": plan.accountant,
            "steps": self.ledger.steps,
            "steps_planned": plan.steps,
            "sample_rate": plan.sample_rate,
            "sampling": plan.sampling,
            "noise_multiplier": self.plan.split.sigma_total,
            "seeded_randomness": plan.seeded_randomness,
            "statement": self.statement(),
        })
        return out


def make_private(model: nn.Module, optimizer: torch.optim.Optimizer, data_loader: DataLoader, *,
                 criterion: Callable, delta: float, target_epsilon: float | None = None,
                 noise_multiplier: float | None = None, epochs: float | None = None, steps: int | None = None,
                 max_grad_norm: float | None = None, clipping: Mapping[str, Any] | None = None,
                 accountant: str = "pld", poisson_sampling: bool = True,
                 unsafe_seed: int | None = None) -> PrivateTraining:
    """Make ``model``, ``optimizer``, ``criterion`` and ``data_loader`` train with DP-SGD (or
    DP-Adam, with an Adam optimizer): see the module doc and docs/python-api.md.

    Args:
        delta: δ of the guarantee.
        target_epsilon / noise_multiplier: exactly one; the noise is calibrated to the target,
            or ε follows from the total noise multiplier σ_eff.
        epochs / steps: exactly one; the planned steps (epochs: ⌈epochs·N/B⌉).
        max_grad_norm: the clipping threshold C (a fixed threshold); or
        clipping: a recipe's ``clipping:`` block (docs/recipes.md): grouping, clip function,
            threshold policy (fixed, quantile, dcsgd-e/p, discriminative), noise allocation.
        accountant: "pld" (default) or "rdp".
        poisson_sampling: True (default): the loader is rebuilt with Poisson sampling, which the
            accountant assumes. False keeps your loader's batches; the statement then says that
            they were accounted as if Poisson-sampled.
        unsafe_seed: None (default): noise and batches come from OS entropy. An int makes them
            reproducible, and removable, by anyone who knows it: tests and experiments only.
    """
    dataset = data_loader.dataset
    if isinstance(dataset, IterableDataset) or not hasattr(dataset, "__len__"):
        raise DpclipError("make_private needs a dataset with a length and indexable rows",
                          "use a map-style Dataset (e.g. TensorDataset): Poisson sampling draws examples by index")
    if data_loader.batch_size is None:
        raise DpclipError("the data loader has no batch_size (it was built with a batch_sampler)",
                          "build it as DataLoader(dataset, batch_size=B): B is the expected batch size of the "
                          "Poisson draws")
    if (target_epsilon is None) == (noise_multiplier is None):
        raise DpclipError("give exactly one of target_epsilon and noise_multiplier",
                          "target_epsilon=8.0 calibrates the noise; noise_multiplier=1.1 gives the ε it costs")
    if (epochs is None) == (steps is None):
        raise DpclipError("give exactly one of epochs and steps", "e.g. epochs=3")
    spec = _clipping(clipping, max_grad_norm)
    _check_optimizer_params(model, optimizer)

    num_examples, batch_size = len(dataset), data_loader.batch_size
    if not 1 <= batch_size <= num_examples:
        raise DpclipError(f"batch size {batch_size} is not between 1 and the {num_examples} examples",
                          "the Poisson rate q = batch_size / N must be in (0, 1]")
    sample_rate = batch_size / num_examples
    planned_steps = steps_for_epochs(epochs, sample_rate) if steps is None else int(steps)
    if unsafe_seed is not None:
        warnings.warn("make_private(unsafe_seed=...): the noise and the batches can be regenerated by anyone who "
                      "knows the seed, which voids the guarantee; for tests and experiments only", stacklevel=3)
    groups = len(build_groups(model, spec.grouping, trainable_params(model)).names)
    with _quiet_rdp_orders():
        plan = solve(PrivacyPlan(
            sample_rate=sample_rate, steps=planned_steps, delta=delta, accountant=accountant,
            sampling="poisson" if poisson_sampling else "shuffle", target_epsilon=target_epsilon,
            noise_multiplier=noise_multiplier, seeded_randomness=unsafe_seed is not None,
            aux=spec.threshold.statistic(groups) if spec.threshold.releases_statistic() else None))
    engine_clipping = spec.model_dump(mode="python")
    engine_clipping["threshold"] = spec.threshold.engine_dict(plan.split.sigma_aux)
    engine = DPEngine(model, engine_clipping, noise_multiplier=plan.split.sigma_gradient,
                      expected_batch_size=batch_size, seed=unsafe_seed, sample_rate=sample_rate)
    loader = poisson_loader(data_loader, sample_rate, planned_steps, unsafe_seed) if poisson_sampling else data_loader
    ledger = Ledger(delta, accountant)
    return PrivateTraining(model, PrivateOptimizer(optimizer, engine, ledger, plan), PrivateCriterion(criterion, engine),
                           loader, engine, ledger, plan)


def _clipping(clipping: Mapping[str, Any] | None, max_grad_norm: float | None) -> Clipping:
    """The clipping block, validated as a recipe's; ``max_grad_norm`` is a fixed threshold."""
    block = dict(clipping or {})
    if max_grad_norm is not None:
        if "threshold" in block:
            raise DpclipError("give max_grad_norm or clipping['threshold'], not both",
                              "max_grad_norm=1.0 is clipping={'threshold': {'kind': 'fixed', 'value': 1.0}}")
        block["threshold"] = {"kind": "fixed", "value": float(max_grad_norm)}
    elif "threshold" not in block:
        raise DpclipError("no clipping threshold", "pass max_grad_norm=1.0, or clipping={'threshold': {...}}")
    try:
        return Clipping.model_validate(block)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first["loc"]) or "clipping"
        raise DpclipError(f"clipping.{where}: {first['msg']}",
                          "the clipping block takes a recipe's clipping: keys (docs/recipes.md)") from None


def _check_optimizer_params(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Every parameter the optimizer moves must be one the engine privatises."""
    trainable = {id(p) for p in model.parameters() if p.requires_grad}
    outside = [p for group in optimizer.param_groups for p in group["params"] if id(p) not in trainable]
    if outside:
        raise DpclipError(f"the optimizer holds {len(outside)} parameter(s) that are not trainable parameters of "
                          "the model", "build the optimizer on model.parameters() after freezing what stays frozen: "
                          "a parameter the engine does not see would be updated without noise")
