"""The end of every private step, whatever its parallel mode: release, the caller's check, update.

The one private step (:class:`dpclip.train.step.PrivateStep`; a pipeline stage's
:class:`dpclip.distributed.pipeline.PipelineStep` runs its backward in rounds of a schedule) ends
here once its micro-batches are done, so what every parallel mode returns to the trainer, and
in what order it privatizes, lets the caller refuse the release and moves the weights, is said
once. It lives below both (docs/design.md, the layers).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from dpclip.engine.report import StepReport


@dataclass
class StepOutcome:
    """What one private step returns to its caller.

    ``loss_sum`` and ``batch_size`` are read from the private batch WITHOUT noise: they
    are diagnostics for the caller's own logs and are not covered by ε (docs/training.md,
    "metrics.jsonl"); ``report`` is the engine's (its releasable part is the thresholds and
    the noise std, see docs/engine.md).
    """

    report: StepReport
    loss_sum: float
    batch_size: int
    seconds: float


def end_private_step(engine, optimizer: torch.optim.Optimizer, before_update: Callable[[StepReport], None] | None,
                     loss_sum: float, batch_size: int, started: float) -> StepOutcome:
    """``engine.privatize()`` (clipped sums plus noise into ``p.grad``, the policy's release);
    ``before_update(report)``, which may refuse the release before any weight moves; the
    optimizer's step and ``zero_grad``. ``started``: the step's ``time.perf_counter()`` at its start."""
    report = engine.privatize()
    if before_update is not None:
        before_update(report)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return StepOutcome(report, loss_sum, batch_size, time.perf_counter() - started)
