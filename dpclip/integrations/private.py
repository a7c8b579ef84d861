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

Length: a little over 400 lines, because the checkpoint's save and load (with the release log of
the steps after it) belong to the run they continue.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader

from dpclip.accounting import Ledger, PlanResult
from dpclip.data.sampler import PoissonSampler
from dpclip.data.user_sampler import UserPoissonSampler, number_people
from dpclip.distributed import ShardedPoissonSampler, World
from dpclip.engine import DPEngine
from dpclip.errors import DpclipError
from dpclip.files import made_private, write_with_atomic
from dpclip.integrations.loaders import poisson_loader, tracked_loader
from dpclip.integrations.parts import PrivateCriterion, PrivateOptimizer
from dpclip.integrations.releases import ReleaseLog
from dpclip.integrations.rows import DrawTracker, ModelRowsWatch
from dpclip.integrations.seal import seal_engine
from dpclip.integrations.setup import (LOOP_OUTPUTS, Account, check_loop_parts, check_optimizer_params, check_whole_draws,
                                      clipping_spec, private_engine, running_world, sampling_world, unit_key)
from dpclip.integrations.train_step import TrainStep, check_compile, train_step_for


#: the format of :meth:`PrivateTraining.save_checkpoint`'s file
CHECKPOINT_FORMAT = "dpclip-make-private/2"


@dataclass
class PrivateTraining:
    """What :func:`make_private` returns. Unpacks as ``model, optimizer, criterion, data_loader``;
    ``engine`` and ``account`` (the ledger and the plan) are the parts behind them."""

    model: nn.Module
    optimizer: PrivateOptimizer
    criterion: PrivateCriterion
    data_loader: DataLoader
    engine: DPEngine
    account: Account
    draws: PoissonSampler | None = None   # the Poisson sampler (None: your own loader's batches)
    stepper: TrainStep | None = None
    # from the first save_checkpoint on: each step's fingerprint beside the checkpoints (releases.py)
    releases: ReleaseLog | None = None

    def __iter__(self) -> Iterator[Any]:
        return iter((self.model, self.optimizer, self.criterion, self.data_loader))

    def train_step(self, inputs: Any, targets: Any) -> Tensor:
        """One private step on a batch of the returned data loader (or one part of it): the model on
        ``inputs`` (``model(**inputs)`` for a dict, ``model(*inputs)`` for a tuple), the criterion on
        its output and ``targets``, the engine's backward, then ``optimizer.step()``: the classic
        loop's calls in one, and with ``make_private(compile=True)`` forward, backward and clip as one
        compiled graph (docs/python-api.md). Returns the rows' mean loss, detached: not covered by ε."""
        return self.stepper(inputs, targets)

    @property
    def ledger(self) -> Ledger:
        return self.account.ledger

    @property
    def plan(self) -> PlanResult:
        return self.account.plan

    @property
    def noise_multiplier(self) -> float:
        """σ_eff, the total noise multiplier the accountant sees (``dpclip account --sigma``)."""
        return self.account.noise_multiplier

    def epsilon(self, delta: float | None = None) -> float:
        """ε of the steps taken so far, at the plan's δ or at ``delta`` (0 before the first step)."""
        return self.account.epsilon(delta)

    def get_epsilon(self, delta: float) -> float:
        """Opacus's name: ε of the steps taken so far at ``delta``."""
        return self.account.epsilon(delta)

    def statement(self) -> list[str]:
        """The privacy statement of the steps taken so far (the plan's before the first)."""
        return self.account.statement()

    def save(self, directory: str | Path) -> Path:
        """Write ``ledger.json`` (every charged step) and ``privacy.json`` (ε, δ, statement)."""
        return self.account.save(directory)

    def save_checkpoint(self, path: str | Path) -> Path:
        """Everything a continued run needs, in one file readable by its owner only: the model's and
        the optimizer's state, the sampler's and the noise's generator states, the draws taken and
        the ledger. It is as secret as the data: with the generators' states the noise can be
        regenerated and subtracted (docs/python-api.md, "Checkpoints"). Taken between steps."""
        if self.optimizer.tracker is not None and self.optimizer.tracker.rows is not None:
            raise DpclipError("save_checkpoint in the middle of a step (a batch drawn, its optimizer.step() not "
                              "taken)", "save after optimizer.step() (with max_physical_batch_size, after the draw's "
                              "last part: a loop that broke out between parts gets the others first from the "
                              "loader's next iterator)")
        if running_world() is not None:
            raise DpclipError("save_checkpoint across several processes is not built yet",
                              "checkpoint a one-process run, or use dpclip train --nproc N (docs/distributed.md)")
        path = Path(path)
        made_private(path.parent)
        releases = self._release_log(path.parent)
        state = {"format": CHECKPOINT_FORMAT, "plan": self._plan_key(), "run": releases.run,
                 "torch_rng": torch.get_rng_state(), "cuda_rng": cuda_rng_states(), "model": self.model.state_dict(),
                 "optimizer": self.optimizer.original.state_dict(), "engine": self.engine.state_dict(),
                 "sampler": None if self.draws is None else self.data_loader.batch_sampler.state_at(
                     self.optimizer.tracker.draws),   # the draws the loop took, not those fetched ahead
                 "draws": self.optimizer.tracker.draws, "losses_read": self.optimizer.tracker.losses_read,
                 "ledger": self.ledger.to_dict(with_epsilon=False)}
        # A save cut short (a kill, a full disk) leaves the checkpoint it overwrites whole.
        write_with_atomic(path, lambda tmp: torch.save(state, tmp))
        return path

    def _release_log(self, folder: Path) -> ReleaseLog:
        """The run's release log, in ``folder``: begun by the first checkpoint (a new run id), after
        which every step logs its fingerprint before it is applied; one folder for all checkpoints."""
        if self.releases is None:
            self.releases = ReleaseLog.new_run(folder)
            self.releases.batches = None if self.draws is None else self.data_loader.batch_sampler
            self.optimizer.on_release = self.releases.check
        elif self.releases.path.parent.resolve() != folder.resolve():
            raise DpclipError(f"this run's checkpoints are in {self.releases.path.parent}, beside the log of its "
                              f"released steps ({self.releases.path.name}); a checkpoint in {folder} would resume "
                              "without it", f"save every checkpoint of a run in {self.releases.path.parent} "
                              "(another file name for each, or one overwritten)")
        self.releases.begin()
        return self.releases

    def load_checkpoint(self, path: str | Path) -> None:
        """Continue the run ``save_checkpoint`` wrote: weights, optimizer and the ledger, so that ε
        counts the earlier steps too. The run must be planned as it was (σ, q, steps, δ). The steps
        its run released after it (its release log, beside it) are redone with the checkpoint's
        streams and torch's global generator, each checked against the fingerprint it released
        (refused if another); after them the sampler's and the noise's streams start afresh from OS
        entropy (the checkpoint's, with ``unsafe_seed``)."""
        if running_world() is not None:
            # Every rank would start from the one process's sampler state: the same rows redrawn
            # on each rank, and later draws correlated across ranks.
            raise DpclipError("load_checkpoint across several processes is not built yet (the checkpoint holds one "
                              "process's sampler)", "continue a one-process checkpoint in one process, or use "
                              "dpclip train --nproc N, whose checkpoints resume on their ranks (docs/distributed.md)")
        try:
            state = torch.load(Path(path), map_location="cpu", weights_only=True)
        except (OSError, RuntimeError, EOFError) as exc:
            raise DpclipError(f"cannot read the checkpoint {path}: {exc}",
                              "pass a file private.save_checkpoint wrote") from None
        if not isinstance(state, dict) or state.get("format") != CHECKPOINT_FORMAT:
            raise DpclipError(f"{path} is not a make_private checkpoint of this dpclip (format {CHECKPOINT_FORMAT})",
                              "pass a file private.save_checkpoint wrote")
        if state["plan"] != self._plan_key():
            raise DpclipError(f"the checkpoint was planned as {state['plan']}, this make_private as "
                              f"{self._plan_key()}", "call make_private with the arguments of the run you continue")
        if self.ledger.steps or self.optimizer.tracker.draws:
            raise DpclipError(f"this run has already drawn batches ({self.ledger.steps} steps released): loading a "
                              "checkpoint would replace its ledger, dropping steps already released",
                              "load a checkpoint into a fresh make_private (a new process), before its first step")
        ledger = Ledger.from_dict(state["ledger"])
        releases = ReleaseLog(Path(path).parent)
        releases.resume_after(ledger.steps, Path(path).parent, state["run"])   # refused without the log beside it
        self.model.load_state_dict(state["model"])
        self.optimizer.original.load_state_dict(state["optimizer"])
        self.engine.load_state_dict(state["engine"])
        if self.draws is not None and state["sampler"] is not None:
            self.draws.load_state_dict(state["sampler"])
        self.optimizer.tracker.draws = int(state["draws"])
        self.optimizer.tracker.losses_read = bool(state["losses_read"])   # the statement covers the earlier steps
        self.account.ledger = ledger
        self.account.restored = True
        self.account.released_steps = max(releases.redo, default=ledger.steps)   # ε counts them until redone
        torch.set_rng_state(state["torch_rng"])   # dropout's: a redone step must release what it did
        if state["cuda_rng"] is not None and len(state["cuda_rng"]) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(state["cuda_rng"])
        # The steps released after the checkpoint replay its streams (checked); a second load of this
        # checkpoint must not draw their noise and batches for new steps (dpclip.rng).
        releases.fork_after_redone(self.engine.noise, None if self.draws is None else self.data_loader.batch_sampler,
                                   ledger.steps)
        self.releases = releases
        self.optimizer.on_release = releases.check

    def _plan_key(self) -> dict[str, Any]:
        plan = self.account.plan.plan
        spec = self.engine.clipping
        threshold = spec.threshold.model_dump(mode="json") if hasattr(spec.threshold, "model_dump") else spec.threshold
        return {"sample_rate": plan.sample_rate, "steps": plan.steps, "delta": plan.delta,
                "noise_multiplier": self.account.noise_multiplier, "accountant": plan.accountant,
                "sampling": plan.sampling, "clipping": {"grouping": spec.grouping, "fn": spec.fn, "gamma": spec.gamma,
                                                        "noise_allocation": spec.noise_allocation,
                                                        "threshold": threshold},
                **unit_key(plan, getattr(self.draws, "users", None), getattr(self.draws, "max_per_user", None))}


def make_private(model: nn.Module | None = None, optimizer: torch.optim.Optimizer | None = None,
                 data_loader: DataLoader | None = None, *, criterion: Callable, delta: float | None = None,
                 target_epsilon: float | None = None, noise_multiplier: float | None = None,
                 epochs: float | None = None, steps: int | None = None,
                 max_grad_norm: float | list[float] | None = None, clipping: Mapping[str, Any] | str | None = None,
                 accountant: str = "pld", poisson_sampling: bool = True, unsafe_seed: int | None = None,
                 verify_every: int = 0, max_physical_batch_size: int | None = None, module: nn.Module | None = None,
                 target_delta: float | None = None, loss_reduction: str = "mean",
                 grad_sample_mode: str | None = None, secure_mode: bool | None = None,
                 users: Any = None, max_records_per_user: int | None = None, compile: bool = False,
                 compile_backend: str | None = "inductor") -> PrivateTraining:
    """Make ``model``, ``optimizer``, ``criterion`` and ``data_loader`` train with DP-SGD (or
    DP-Adam, with an Adam optimizer): see the module doc and docs/python-api.md.

    Args:
        delta: δ of the guarantee.
        target_epsilon / noise_multiplier: exactly one; the noise is calibrated to the target,
            or ε follows from the total noise multiplier σ_eff.
        epochs / steps: exactly one; the planned steps (epochs E: E passes of ⌈N/B⌉ draws each).
        max_grad_norm: the clipping threshold C (a fixed threshold); or
        clipping: a recipe's ``clipping:`` block (docs/recipes.md): grouping, clip function,
            threshold policy (fixed, quantile, dcsgd-e/p, discriminative), noise allocation.
        accountant: "pld" (default) or "rdp".
        poisson_sampling: True (default): the loader is rebuilt with Poisson sampling, as the accountant
            assumes. False keeps your loader's batches, and the statement says so.
        unsafe_seed: None (default): noise and batches come from OS entropy. An int makes them
            reproducible, and removable, by anyone who knows it: tests and experiments only.
        verify_every: the certificate also checks the clipping every ``verify_every`` steps if > 0
            (it always checks the first step and each new batch shape; docs/certificate.md).
        max_physical_batch_size: the loader hands each drawn batch out in parts of at most this many
            rows; ``loss.backward()`` on each, ``optimizer.step()`` after each (Opacus's BatchMemoryManager
            loop) or after the last: the noisy step is taken once, after the last part. None: whole batches.
        users, max_records_per_user: user-level privacy (docs/users.md): ``users[i]`` is the person of
            example i; each step samples people with probability q = batch_size / people, and takes
            at most ``max_records_per_user`` = k records of each; every row weighs 1/k, so that one
            person moves a step by at most C whatever rows the loop backwards together.
        compile, compile_backend: ``private.train_step`` as one checked ``torch.compile`` graph
            (:mod:`dpclip.integrations.train_step`); the classic loop's criterion is then refused.
        module, target_delta, loss_reduction, grad_sample_mode, secure_mode, ``clipping="flat" |
            "per_layer"``: Opacus's names, with Opacus's meaning (docs/python-api.md, "For Opacus
            users"); what has none in dpclip is refused with its translation.

    The loop is held to one noisy step per drawn batch (docs/python-api.md, "What the loop must
    do"): a loss, backward or step over anything else is refused before it is released or charged.
    """
    model, delta, clipping, max_grad_norm = opacus_arguments(
        model, module, delta, target_delta, clipping, max_grad_norm, loss_reduction, grad_sample_mode, secure_mode)
    check_loop_parts(optimizer, data_loader, epochs, steps, max_physical_batch_size)
    check_compile(model, compile, compile_backend)
    spec = check_whole_draws(clipping_spec(clipping, max_grad_norm), max_physical_batch_size)
    check_optimizer_params(model, optimizer)
    world = sampling_world(poisson_sampling)
    # Each rank's loader holds its own share of the logical batch: B = batch_size × ranks.
    num_examples, batch_size = len(data_loader.dataset), data_loader.batch_size * (1 if world is None else world.size)
    people = person_ids(users, max_records_per_user, num_examples, poisson_sampling, world)
    if people is not None:   # user-level: the sampled unit is a person, N counts people
        num_examples = int(people.max()) + 1
    steps_per_pass = math.ceil(num_examples / batch_size)
    planned_steps = count_planned_steps(epochs, steps, steps_per_pass)
    engine, account = private_engine(model, spec, num_examples=num_examples, batch_size=batch_size, steps=planned_steps,
        delta=delta, target_epsilon=target_epsilon, noise_multiplier=noise_multiplier, accountant=accountant,
        sampling="poisson" if poisson_sampling else "shuffle", unsafe_seed=unsafe_seed, world=world,
        dataset=data_loader.dataset, verify_every=verify_every,
        records_per_user=None if people is None else max_records_per_user)
    tracker = seal_engine(engine, DrawTracker(None if people is None else 1.0 / max_records_per_user))
    account.losses_read, account.loop_lines = (lambda: tracker.losses_read), (LOOP_OUTPUTS,)
    tracker.on_first_read = account.restate   # a privacy.json saved before the first read gains its line
    loader, draws = tracked_loader(data_loader, tracker, max_physical_batch_size, planned_steps), None
    if poisson_sampling:
        draws = poisson_draws(model, account.plan.plan.sample_rate, planned_steps, num_examples=num_examples,
                              people=people, max_records_per_user=max_records_per_user, world=world,
                              unsafe_seed=unsafe_seed)
        loader = poisson_loader(data_loader, draws, steps_per_pass, tracker, max_physical_batch_size)
    private_optimizer, private_criterion = PrivateOptimizer(optimizer, engine, account, tracker), \
        PrivateCriterion(criterion, engine, tracker)
    stepper = train_step_for(engine, model, private_criterion, private_optimizer, tracker, compile=compile,
                             backend=compile_backend, piece_rows=max_physical_batch_size or data_loader.batch_size)
    if not compile:   # a compiled train_step checks its rows itself, outside the graph
        ModelRowsWatch(model, tracker)
    return PrivateTraining(model, private_optimizer, private_criterion, loader, engine, account, draws, stepper)


def cuda_rng_states() -> list[Tensor] | None:
    """torch's CUDA generators' states, where CUDA is in use (for a checkpoint)."""
    return torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None


def count_planned_steps(epochs: float | None, steps: int | None, steps_per_pass: int) -> int:
    """The planned steps: ``steps``, or for ``epochs`` = E, E passes of the loader, ⌈N/B⌉ draws
    each (``steps_per_pass``)."""
    # As Opacus and your `for epoch in range(E)` count them, not ⌈E·N/B⌉ steps, which would stop
    # inside the last pass.
    if steps is None and (isinstance(epochs, bool) or not isinstance(epochs, (int, float)) or not 0 < epochs < math.inf):
        raise DpclipError(f"epochs must be a finite number > 0, got {epochs!r}", "e.g. epochs=3")
    if steps is not None and (isinstance(steps, bool) or not isinstance(steps, numbers.Integral) or steps < 1):
        raise DpclipError(f"steps must be a whole number > 0, got {steps!r}", "e.g. steps=1000, or epochs=3")
    return max(1, math.ceil(round(epochs * steps_per_pass, 9))) if steps is None else int(steps)


def poisson_draws(model: nn.Module, sample_rate: float, planned_steps: int, *, num_examples: int,
                  people: Tensor | None, max_records_per_user: int | None, world: World | None,
                  unsafe_seed: int | None) -> PoissonSampler:
    """The Poisson sampler of the rebuilt loader: of people (user-level), of examples, or of this
    rank's examples' part of each batch (after every rank takes rank 0's weights)."""
    if people is not None:
        return UserPoissonSampler(people, sample_rate, planned_steps, max_records_per_user, seed=unsafe_seed)
    if world is None:
        return PoissonSampler(num_examples, sample_rate, planned_steps, seed=unsafe_seed)
    # every rank starts from rank 0's weights and draws its own examples' part
    world.broadcast_([p.data for p in model.parameters()])
    return ShardedPoissonSampler(num_examples, sample_rate, planned_steps, rank=world.rank,
                                 world_size=world.size, seed=unsafe_seed)


def person_ids(users: Any, k: int | None, records: int, poisson_sampling: bool, world) -> Tensor | None:
    """``users`` (one person per example, any hashable ids) numbered 0..U-1 in order of first
    appearance, or None for example-level privacy; refused with a hint where it cannot hold."""
    if users is None and k is None:
        return None
    if users is None or k is None:
        raise DpclipError("user-level privacy needs both users= and max_records_per_user=",
                          "users=[person of each example], max_records_per_user=k (e.g. 4)")
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise DpclipError(f"max_records_per_user must be a whole number >= 1, got {k!r}", "e.g. 4")
    ids = users.tolist() if isinstance(users, Tensor) else list(users)
    if len(ids) != records:
        raise DpclipError(f"users= names {len(ids)} people's records, the dataset has {records} examples",
                          "one person id per example, in the dataset's order")
    if not poisson_sampling or world is not None:
        raise DpclipError("user-level privacy samples people by Poisson sampling in one process",
                          "keep poisson_sampling=True; across processes, use dpclip train (docs/users.md)")
    return number_people(ids)


def opacus_arguments(model, module, delta, target_delta, clipping, max_grad_norm, loss_reduction: str,
                     grad_sample_mode: str | None, secure_mode: bool | None):
    """(model, delta, clipping, max_grad_norm) from dpclip's names or Opacus's (the same meaning);
    what means something else in dpclip is refused with the translation."""
    def one(name, value, alias, other):
        if value is not None and other is not None:
            raise DpclipError(f"give {name}= or {alias}= (Opacus's name), not both", f"{name}=... alone")
        return value if value is not None else other
    model, delta = one("model", model, "module", module), one("delta", delta, "target_delta", target_delta)
    if model is None or delta is None:
        raise DpclipError(f"make_private needs {'the model' if model is None else 'delta'}",
                          "make_private(model, optimizer, data_loader, criterion=..., delta=1e-5, ...)")
    if loss_reduction != "mean":
        raise DpclipError(f"loss_reduction={loss_reduction!r}: dpclip divides the noisy clipped sum by the expected "
                          "batch size B, which is Opacus's loss_reduction='mean'",
                          "leave loss_reduction out (or 'mean'); for a sum, multiply the learning rate by B")
    if grad_sample_mode is not None and not isinstance(grad_sample_mode, str):
        raise DpclipError("grad_sample_mode must be a string", "leave it out: dpclip has one mode")
    if secure_mode is not None and not isinstance(secure_mode, bool):
        raise DpclipError("secure_mode must be True or False", "leave it out: noise and batches come from OS entropy")
    # grad_sample_mode (hooks, functorch, ew, ghost) and secure_mode have nothing to choose in dpclip: per-sample
    # norms always come from one backward, and noise and batches always from OS entropy (unsafe_seed aside)
    if isinstance(clipping, str):
        return model, delta, opacus_clipping(clipping, max_grad_norm, model), None
    if isinstance(max_grad_norm, (list, tuple)):
        raise DpclipError("a list of thresholds needs per-layer clipping",
                          "clipping='per_layer' (Opacus: one threshold per parameter tensor), or "
                          "clipping={'grouping': ..., 'threshold': {'kind': 'fixed', 'value': [...]}}")
    return model, delta, clipping, max_grad_norm


def opacus_clipping(kind: str, max_grad_norm, model: nn.Module) -> dict[str, Any]:
    """Opacus's ``clipping=`` names as dpclip's clipping block: "flat" one threshold on the whole
    gradient; "per_layer" one per parameter tensor (a list, or one C for every tensor)."""
    if max_grad_norm is None:
        raise DpclipError(f"clipping={kind!r} needs max_grad_norm", "e.g. max_grad_norm=1.0")
    if kind == "flat":
        if isinstance(max_grad_norm, (list, tuple)):
            raise DpclipError("clipping='flat' takes one max_grad_norm", "a list of thresholds is clipping='per_layer'")
        return {"grouping": "all-layer", "threshold": {"kind": "fixed", "value": float(max_grad_norm)}}
    if kind == "per_layer":
        count = sum(1 for p in model.parameters() if p.requires_grad)
        values = list(max_grad_norm) if isinstance(max_grad_norm, (list, tuple)) else [float(max_grad_norm)] * count
        if len(values) != count:
            raise DpclipError(f"clipping='per_layer' with {len(values)} thresholds, and the model trains {count} "
                              "parameter tensors", "one threshold per trainable parameter tensor, in model.parameters() "
                              "order (or one number for all)")
        return {"grouping": "param", "threshold": {"kind": "fixed", "value": [float(v) for v in values]}}
    if kind == "adaptive":
        raise DpclipError("clipping='adaptive' is dpclip's quantile threshold policy",
                          "clipping={'threshold': {'kind': 'quantile', 'target': 0.5}} (docs/methods.md); its "
                          "statistic's noise is charged jointly with the gradient's")
    raise DpclipError(f"unknown clipping {kind!r}", "'flat', 'per_layer', or a clipping block (docs/recipes.md)")


def make_private_with_epsilon(module: nn.Module, optimizer: torch.optim.Optimizer, data_loader: DataLoader, *,
                              target_epsilon: float, target_delta: float, epochs: float, max_grad_norm,
                              criterion: Callable, **options) -> PrivateTraining:
    """Opacus's name for :func:`make_private` with a target ε (``target_delta`` is its δ)."""
    return make_private(module=module, optimizer=optimizer, data_loader=data_loader, target_epsilon=target_epsilon,
                        target_delta=target_delta, epochs=epochs, max_grad_norm=max_grad_norm, criterion=criterion,
                        **options)
