"""``dpclip tune-cost`` below the CLI: the command's options -> the cost report it renders.

:func:`tune_cost_report` checks the options, reads the recipe, times the steps (measured,
or given with ``--no-measure``), prices the search (:func:`dpclip.tuning.cost.tune_cost`,
or :func:`dpclip.tuning.compare.tune_cost_compared` with ``--compare``) and, with
``--run``, performs it (:func:`dpclip.tuning.search.run_search`). The CLI draws the
progress bar (a :class:`ProgressObserver`) and renders the returned
:class:`~dpclip.tuning.cost.TuneCostReport` (docs/tuning.md).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from dpclip.data import load_data
from dpclip.errors import DpclipError
from dpclip.planning.plan import privacy_units
from dpclip.recipe import read_recipe_data, validate_recipe
from dpclip.tuning.compare import tune_cost_compared
from dpclip.tuning.cost import MeasureObserver, StepTimer, TuneCostReport, tune_cost
from dpclip.tuning.search import run_search


class ProgressObserver(MeasureObserver, Protocol):
    """A :class:`~dpclip.tuning.cost.MeasureObserver` that is stopped once the steps are measured."""

    def stop(self) -> None: ...


@dataclass(frozen=True)
class TuneCostOptions:
    """The options of `dpclip tune-cost` (see its --help)."""

    grid: Sequence[str] = ()
    random_draws: int | None = None
    calibration_steps: int = 10
    warmup_steps: int = 2
    measure: bool = True
    step_seconds: float | None = None   # with --no-measure: seconds per step
    run_seconds: float | None = None    # with --no-measure: a run's fixed seconds (None: 0)
    dataset_size: int | None = None
    compare: bool = False
    run: bool = False

    def check(self) -> None:
        """Refuse options that do not go together, naming the ones that do."""
        if self.measure and self.step_seconds is not None:
            raise DpclipError("--step-seconds is used only with --no-measure",
                              "pass --no-measure --step-seconds S, or drop --step-seconds to measure")
        if self.measure and self.run_seconds is not None:
            raise DpclipError("--run-seconds is used only with --no-measure",
                              "pass --no-measure --step-seconds S --run-seconds R, or drop --run-seconds to measure")
        if not self.measure and (self.step_seconds is None or not 0 < self.step_seconds < math.inf):
            raise DpclipError("--no-measure needs --step-seconds S (a positive number of seconds)",
                              "e.g. --no-measure --step-seconds 0.25")
        if self.run_seconds is not None and not self.run_seconds < math.inf:   # --run-seconds' min=0 lets inf by
            raise DpclipError(f"--run-seconds must be a finite number of seconds, got {self.run_seconds:g}",
                              "e.g. --run-seconds 5 (a run's data, model and checkpoint time)")
        if self.calibration_steps < 1 or self.warmup_steps < 0:
            raise DpclipError("--calibration-steps must be >= 1 and --warmup-steps >= 0",
                              "e.g. --calibration-steps 10")
        if self.run and self.dataset_size is not None:
            raise DpclipError("--run trains on the recipe's own data, so --dataset-size cannot be used with it",
                              "drop --dataset-size to run the search (a Hugging Face data set is loaded to "
                              "count it)")

    def timer(self, observer: MeasureObserver) -> StepTimer:
        """How the step times are obtained: measured, or the given --step-seconds and --run-seconds."""
        return StepTimer(self.calibration_steps, self.warmup_steps, None if self.measure else self.step_seconds,
                         observer, run_overhead=None if self.measure else (self.run_seconds or 0.0))


def tune_cost_report(recipe_path: Path, overrides: Sequence[str], options: TuneCostOptions,
                     observer: ProgressObserver,
                     on_trial: Callable[[int, str], None] | None = None) -> TuneCostReport:
    """The cost of the search over the recipe at ``recipe_path`` (with key=value ``overrides``),
    and with ``options.run`` the search performed (its summary in ``report.search``).

    ``observer`` is told of each measured step, and stopped before any search runs;
    ``on_trial`` is :func:`~dpclip.tuning.search.run_search`'s (the operator's console only).
    """
    options.check()
    base = read_recipe_data(recipe_path, list(overrides))  # paths resolved as load_recipe does
    recipe = validate_recipe(base, source=str(recipe_path))
    dataset_size = options.dataset_size
    if options.run and recipe.data.source == "hf":
        # A hub data set's size is known only once loaded; --run trains on it, so it is loaded here to count it.
        dataset_size = privacy_units(recipe, load_data(recipe.data, seed=recipe.seed))
    timer = options.timer(observer)
    try:
        # --compare: the comparison builds on the cost report (dpclip.tuning.compare uses cost, not the reverse).
        cost = tune_cost_compared if options.compare else tune_cost
        report = cost(base, recipe, grid=list(options.grid), random_draws=options.random_draws, timer=timer,
                      dataset_size=dataset_size, source=str(recipe_path))
    finally:
        observer.stop()
    if options.run:
        report.search = run_search(base, recipe, report, grid=list(options.grid), random_draws=options.random_draws,
                                   on_trial=on_trial)
    return report
