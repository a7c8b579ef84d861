"""The private step: the one place that says what one step of DP training is.

Training (:mod:`dpclip.train.trainer`), step timing (:mod:`dpclip.tuning.timing`), the
benchmark (:mod:`dpclip.bench`) and ``scripts/methods_evidence.py`` all step through
:class:`PrivateStep`, so what they time or compare is what a run does. Its end (privatize, the
caller's check, the update) and what it returns, :class:`StepOutcome`, are every parallel mode's:
:mod:`dpclip.engine.step_end` (a pipeline stage's step ends there too).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from dpclip.data import micro_batches, select
from dpclip.data.user_sampler import user_weights
from dpclip.engine import DPEngine, StepReport
from dpclip.engine.compiled import CompiledMicroBatch
from dpclip.engine.precision import Precision
from dpclip.engine.step_end import StepOutcome, end_private_step
from dpclip.errors import PRIVATE_BATCH_NOTE, DpclipError


class PrivateStep:
    """One private step on a logical batch of training rows:

    1. split the batch (``indices`` into ``train``) into micro-batches of at most
       ``micro_batch_size`` rows (``None``: the whole batch in one backward, which a
       policy that ranks the whole batch needs, see docs/methods.md);
    2. per micro-batch, per-example losses ``loss_fn(model, rows)`` (under ``precision``'s
       autocast, if any) go through ``engine.backward`` (per-sample norms and clipped sums,
       with float16's loss scale undone before clipping; docs/engine.md); an empty
       Poisson draw runs no backward at all and the step releases noise only;
    3. ``engine.privatize()`` clips, adds the Gaussian noise, updates the threshold policy
       and writes ``p.grad = (Σ clipped + noise) / B`` with B the EXPECTED batch size;
    4. ``before_update(report)`` (optional) may refuse the release before any weight moves;
    5. ``optimizer.step()`` and ``zero_grad`` (3-5: :func:`~dpclip.engine.step_end.end_private_step`).

    No IO and no ledger: the caller charges the step (the trainer records the engine's
    DpEvent in the ledger right after this returns, before anything of the step is shown).

    ``lockstep`` (a sharded model, whose every forward and backward is a collective): given
    this rank's number of micro-batches, the number every rank runs; the missing ones are one
    row of padding each, with loss weight 0 (docs/distributed.md, "Sharded training").

    ``compiled`` (``training.compile``): each micro-batch's forward, backward and clip run as one
    compiled graph (:class:`~dpclip.engine.compiled.CompiledMicroBatch`, docs/compiled.md);
    it needs ``fixed_rows``.

    ``fixed_rows`` (``training.fixed_shapes``): every micro-batch is padded to
    ``micro_batch_size`` rows, so the step sees one batch shape whatever the Poisson draw
    (docs/training.md, "Fixed shapes"). Padding rows repeat row 0 of ``train`` with loss
    weight 0: they add exactly nothing to the clipped sums, and the counts, the norm statistics
    and the threshold policy never see them.
    """

    def __init__(self, model: torch.nn.Module, loss_fn: Callable, engine: DPEngine,
                 optimizer: torch.optim.Optimizer, train: dict[str, torch.Tensor], *,
                 micro_batch_size: int | None, precision: Precision | None = None,
                 lockstep: Callable[[int], int] | None = None, users: torch.Tensor | None = None,
                 fixed_rows: bool = False, compiled: CompiledMicroBatch | None = None):
        self.precision = precision or Precision()
        # User-level privacy: the person of each training row; each row's clipped gradient is
        # weighted by 1/(rows of its person in the batch) (docs/users.md).
        self.users = users
        self.model = model
        self.loss_fn = loss_fn
        self.engine = engine
        self.optimizer = optimizer
        self.train = train
        self.micro_batch_size = micro_batch_size
        self.lockstep = lockstep
        if fixed_rows and micro_batch_size is None:
            raise ValueError("fixed_rows pads micro-batches to micro_batch_size: give one")
        if compiled is not None and not fixed_rows:
            raise ValueError("a compiled step needs fixed_rows: one batch shape, one graph")
        self.fixed_rows = fixed_rows
        self.compiled = compiled

    def __call__(self, indices: torch.Tensor,
                 before_update: Callable[[StepReport], None] | None = None) -> StepOutcome:
        started = time.perf_counter()
        chunk = self.micro_batch_size if self.micro_batch_size is not None else max(len(indices), 1)
        weights = None if self.users is None else user_weights(self.users[indices])
        parts = [(rows, len(rows)) for rows in micro_batches(indices, chunk)]
        if self.lockstep is not None:  # padding: any one row, weight 0 (it adds nothing, the policy never sees it)
            padding = torch.zeros(1, dtype=torch.long)
            parts += [(padding, 0)] * (self.lockstep(len(parts)) - len(parts))
        if self.fixed_rows:
            parts = [(_padded_rows(rows, chunk), samples) for rows, samples in parts]
        try:
            loss_sum = self._micro_batches(parts, weights)
        except DpclipError:
            raise
        except Exception as exc:   # the model's or torch's own error, type kept for its handlers
            exc.add_note(PRIVATE_BATCH_NOTE.strip(" []"))
            if self.precision.dtype is not None:
                exc.add_note(f"the forward ran under {self.precision.name} autocast: should a layer have no "
                             f"{self.precision.name} kernel on this device (some CPUs' LSTM), set "
                             "training.precision: fp32")
            raise
        if not parts:  # across ranks, the policy may exchange norms in the backward this rank skips
            self.engine.policy.empty_part()
        return end_private_step(self.engine, self.optimizer, before_update, loss_sum, len(indices), started)

    def _micro_batches(self, parts: list[tuple[torch.Tensor, int]], weights: torch.Tensor | None) -> float:
        """Forward, loss and engine backward of each micro-batch; the sum of its samples' losses."""
        loss_sum, done = 0.0, 0
        for rows, samples in parts:
            if self.compiled is not None:   # forward, backward and clip in one graph (engine/compiled.py)
                losses = self.compiled(select(self.train, rows), samples, None if weights is None
                                       else weights[done:done + samples])
                loss_sum += float(losses.sum())
                done += samples
                continue
            with self.precision.autocast():
                losses = self.loss_fn(self.model, select(self.train, rows))
            loss_sum += float(losses.detach()[:samples].sum())
            self.engine.backward(losses, loss_scale=self.precision.scale,
                                 samples=None if samples == len(rows) else samples,
                                 row_weights=None if weights is None or not samples
                                 else _padded_weights(weights[done:done + samples], len(rows)))
            done += samples
        return loss_sum


def _padded_rows(rows: torch.Tensor, size: int) -> torch.Tensor:
    """``rows`` and then row 0 until there are ``size`` (the padding's loss weight is 0)."""
    return torch.cat([rows, rows.new_zeros(size - len(rows))]) if len(rows) < size else rows


def _padded_weights(weights: torch.Tensor, size: int) -> torch.Tensor:
    """User-level row weights, 0 for the padding rows after them."""
    return torch.cat([weights, weights.new_zeros(size - len(weights))]) if len(weights) < size else weights


def step_micro_batch_size(recipe) -> int | None:
    """The micro-batch size a recipe's step uses; ``None``: the whole logical batch at once.

    A policy that ranks the whole logical batch (discriminative clipping's top-fraction tail
    rule) needs it in one backward, however large the Poisson draw is (docs/methods.md)."""
    if recipe.clipping.threshold.ranks_whole_batch():
        return None
    return recipe.training.micro_batch_size or recipe.training.batch_size


def step_precision(recipe, model: torch.nn.Module) -> Precision:
    """The recipe's ``training.precision`` on the device the model lives on; fp16 off CUDA is
    refused here, before a run directory exists (an EngineError with a hint)."""
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    return Precision(recipe.training.precision, device.type)
