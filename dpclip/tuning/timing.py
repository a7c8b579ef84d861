"""Seconds per private step of a recipe on this machine, measured with a few real steps.

A step here is the training loop's own: a Poisson batch through
:class:`dpclip.train.step.PrivateStep` with the engine and optimizer the run would build,
assembled by :func:`dpclip.train.parts.assemble_for_timing` (stand-in noise). The first ``warmup_steps`` are not timed (allocator,
kernel selection, lazy initialisation); the result is the median of the timed steps, so
one slow step (a page fault, another process) does not move it.

A run also costs time outside its steps (loading the data, building the model,
calibrating σ, the final evaluation, checkpoints, the plot): :func:`measure_fixed_seconds`
measures it once with one whole two-step run in a temporary directory.

Nothing measured here is released: timing steps use the private data but their gradients
are thrown away with the model, and the time of a step is not published per example.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dpclip.errors import DpclipError
from dpclip.recipe.schema import Recipe
from dpclip.train.parts import TIMING_STATISTIC_SIGMA, assemble_for_timing
from dpclip.planning.plan import timing_clipping as plan_timing_clipping
from dpclip.train.workflow import train

#: Steps of the whole run that measures a run's fixed cost (the steps' own time is subtracted).
FIXED_COST_STEPS = 2

# Keys whose value changes how long one step takes. Others (learning rate, C, epochs, ...)
# change what is learnt, not the cost of a step, so configurations differing only in them
# share one measurement.
STEP_COST_KEYS = ("data.", "model.", "training.batch_size", "training.micro_batch_size",
                  "training.optimizer.kind", "clipping.grouping", "clipping.fn", "clipping.norm_method",
                  "clipping.noise_allocation", "clipping.threshold.kind", "clipping.threshold.subspace_dim",
                  "clipping.threshold.bins")


def step_cost_signature(recipe: Recipe) -> str:
    """Text that is equal for two recipes whose steps cost the same (see STEP_COST_KEYS)."""
    flat = _flatten(recipe.model_dump(mode="json"))
    picked = {key: value for key, value in flat.items() if key.startswith(STEP_COST_KEYS)}
    return json.dumps(picked, sort_keys=True)


def _flatten(node: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(node, dict):
        out: dict[str, Any] = {}
        for key, value in node.items():
            out.update(_flatten(value, f"{prefix}{key}."))
        return out
    return {prefix[:-1]: node}


def timing_clipping(recipe: Recipe) -> dict[str, Any]:
    """The recipe's clipping dict for DPEngine, with a stand-in noise std for statistics.

    The training workflow derives a statistic's σ from its budget share; its value does
    not change the cost of a step, so timing uses a fixed one.
    """
    return plan_timing_clipping(recipe, TIMING_STATISTIC_SIGMA)


def measure_step_seconds(recipe: Recipe, steps: int, warmup_steps: int = 1,
                         on_step: Callable[[], None] | None = None) -> float:
    """Median seconds of ``steps`` private steps of ``recipe`` after ``warmup_steps``."""
    if steps < 1:
        raise DpclipError(f"--calibration-steps must be at least 1, got {steps}", "e.g. --calibration-steps 5")
    parts = assemble_for_timing(recipe, warmup_steps + steps)
    seconds: list[float] = []
    parts.learner.model.train()
    try:
        for index, indices in enumerate(parts.feed.sampler):
            outcome = parts.learner.private_step(indices)
            if index >= warmup_steps:
                seconds.append(outcome.seconds)
            if on_step is not None:
                on_step()
    finally:
        parts.learner.engine.detach()
    return statistics.median(seconds)


def measure_fixed_seconds(recipe: Recipe) -> float:
    """Seconds one run of ``recipe`` spends outside its steps, measured with one whole run
    of :data:`FIXED_COST_STEPS` steps (its steps' own seconds subtracted) in a temporary
    directory that is deleted afterwards. It holds data loading, model building, σ's
    calibration, the step-0 and final checkpoints, the final evaluation and the threshold
    plot; evaluations and checkpoints in between (``eval.every_steps``,
    ``checkpoint.every_steps``) are not counted (docs/tuning.md, "Compute")."""
    training = recipe.training.model_copy(update={"epochs": None, "steps": FIXED_COST_STEPS})
    checkpoint = recipe.checkpoint.model_copy(update={"every_steps": None, "every_minutes": None})
    evaluation = recipe.eval.model_copy(update={"every_steps": None})
    with tempfile.TemporaryDirectory(prefix="dpclip-fixed-cost-") as folder:
        tiny = recipe.model_copy(update={"training": training, "checkpoint": checkpoint, "eval": evaluation,
                                         "output_dir": folder})
        start = time.perf_counter()
        result = train(tiny, run_dir=Path(folder) / "run")
        wall = time.perf_counter() - start
    # From the result, not metrics.jsonl: with privacy.exact_diagnostics off no step time is written.
    return max(0.0, wall - result.step_seconds)
