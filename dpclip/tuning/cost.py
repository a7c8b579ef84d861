"""``dpclip tune-cost``: what a hyperparameter search costs in compute and in privacy.

    report = tune_cost(base_data, recipe, grid=["training.optimizer.lr=0.1,1"], measure=True)

Compute = Σ over configurations of (steps per run × seconds per step + the run's fixed
cost), with the seconds per step measured once per distinct step cost and the fixed cost
(data, model, calibration, checkpoints, evaluation, plot) once with one whole two-step
run (:mod:`dpclip.tuning.timing`). Privacy = one run,
the whole search by naive composition, and the per-run σ that keeps the whole search
within the recipe's ε under naive composition, Liu–Talwar random stopping and
Papernot–Steinke repeat-and-select (:mod:`dpclip.tuning.privacy`). The same search for
each clipping method is :func:`dpclip.tuning.compare.tune_cost_compared`, which builds on
this module (never the other way round).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

from dpclip.errors import DpclipError, RecipeError
from dpclip.recipe.load import validate_recipe
from dpclip.recipe.schema import Recipe
from dpclip.planning.plan import privacy_plan, recipe_units, sampling_schedule, statistic_groups
from dpclip.tuning.privacy import SearchPrivacy, search_privacy
from dpclip.tuning.space import Configuration, reachable_configurations, search_space, space_checked
from dpclip.tuning.timing import measure_fixed_seconds, measure_step_seconds, step_cost_signature


PROCESS_WARMUP_STEPS = 5
#: What a measured time is: a function of the private data that no DpEvent accounts for (a run's
#: metrics.jsonl labels its step times so too). Times given with --no-measure carry no label.
NOT_COVERED_TIMES = ("not covered by ε: the measured seconds (per step, per run, the hours, the policy overhead "
                     "and --compare's s/step and speedup computed from them), measured on the private data: "
                     "private steps on Poisson batches drawn from it and one whole two-step run on it; a step's "
                     "time follows its realised batch size")


class MeasureObserver(Protocol):
    """What the CLI implements to draw a progress bar while steps are measured."""

    def start(self, total_steps: int) -> None: ...
    def advance(self, label: str) -> None: ...


class _Silent:
    def start(self, total_steps: int) -> None: pass
    def advance(self, label: str) -> None: pass


@dataclass
class StepTimer:
    """Seconds per step, measured once per step-cost signature (or given)."""

    calibration_steps: int = 3
    warmup_steps: int = 1
    fixed_seconds: float | None = None  # --no-measure --step-seconds S
    observer: MeasureObserver = field(default_factory=_Silent)
    measured: dict[str, float] = field(default_factory=dict)
    run_overhead: float | None = None   # a run's fixed seconds: --no-measure --run-seconds S, or measured

    @property
    def measuring(self) -> bool:
        return self.fixed_seconds is None

    def _warmup(self) -> int:
        # The process's first steps pay for torch's one-time initialisation: the first
        # measurement gets extra untimed steps so it is not slower than the others.
        return self.warmup_steps + (PROCESS_WARMUP_STEPS if not self.measured else 0)

    def plan(self, recipes: Sequence[Recipe], remeasured: int = 0) -> None:
        """Announce how many steps will be measured (for the progress bar).

        ``remeasured``: how many :meth:`remeasure` calls will follow.
        """
        if self.measuring:
            signatures = {step_cost_signature(r) for r in recipes} - set(self.measured)
            total = (len(signatures) + remeasured) * (self.calibration_steps + self.warmup_steps)
            self.observer.start(total + (PROCESS_WARMUP_STEPS if signatures and not self.measured else 0))

    def remeasure(self, recipe: Recipe, label: str) -> float:
        """Measure again and keep the faster median: the one least disturbed by other work."""
        if not self.measuring:
            return float(self.fixed_seconds)
        again = measure_step_seconds(recipe, self.calibration_steps, self.warmup_steps,
                                     on_step=lambda: self.observer.advance(label))
        signature = step_cost_signature(recipe)
        self.measured[signature] = min(self.measured.get(signature, again), again)
        return self.measured[signature]

    def overhead(self, recipe: Recipe) -> float:
        """Seconds of one run outside its steps (measured once, with the first recipe asked)."""
        if self.run_overhead is None:
            self.run_overhead = measure_fixed_seconds(recipe) if self.measuring else 0.0
        return self.run_overhead

    def seconds(self, recipe: Recipe, label: str) -> float:
        if not self.measuring:
            return float(self.fixed_seconds)
        signature = step_cost_signature(recipe)
        if signature not in self.measured:
            self.measured[signature] = measure_step_seconds(
                recipe, self.calibration_steps, self._warmup(), on_step=lambda: self.observer.advance(label))
        return self.measured[signature]


@dataclass(frozen=True)
class RunCost:
    """Compute of one configuration."""

    label: str
    values: dict[str, Any]
    steps: int
    step_seconds: float
    fixed_seconds: float = 0.0   # the run's cost outside its steps (see StepTimer.overhead)

    @property
    def hours(self) -> float:
        return (self.steps * self.step_seconds + self.fixed_seconds) / 3600.0


@dataclass
class TuneCostReport:
    recipe: str
    dataset_size: int
    measured: bool
    runs: list[RunCost]
    step_seconds: float                # the base recipe's
    fixed_step_seconds: float | None   # the same recipe with a fixed threshold (None: it is fixed)
    privacy: SearchPrivacy
    comparison: list[dict[str, Any]] | None = None
    search: dict[str, Any] | None = None   # filled by --run
    plan: Any = field(default=None, repr=False)  # the privacy plan of one run (not in to_dict)
    space_checked: str | None = None   # what of a random space too big to check whole was checked (None: all)

    @property
    def configurations(self) -> int:
        return len(self.runs)

    @property
    def hours_per_run(self) -> float:
        return sum(run.hours for run in self.runs) / len(self.runs)

    @property
    def search_hours(self) -> float:
        """Every configuration trained once (grid search, naive composition)."""
        return sum(run.hours for run in self.runs)

    @property
    def policy_overhead(self) -> float | None:
        """Per-step overhead of the recipe's threshold policy over a fixed threshold (0.05 = 5%)."""
        if self.fixed_step_seconds is None:
            return None
        return self.step_seconds / self.fixed_step_seconds - 1.0

    def to_dict(self) -> dict[str, Any]:
        repeat = self.privacy.strategy("repeat-and-select")
        return {
            "recipe": self.recipe,
            "dataset_size": self.dataset_size,
            "configurations": self.configurations,
            "compute": {
                "measured": self.measured,
                "step_seconds": self.step_seconds,
                "run_fixed_seconds": self.runs[0].fixed_seconds,
                "fixed_threshold_step_seconds": self.fixed_step_seconds,
                "policy_overhead": self.policy_overhead,
                "steps_per_run": self.runs[0].steps,
                "hours_per_run": self.hours_per_run,
                "search_hours": self.search_hours,
                "repeat_and_select_expected_hours": repeat.detail["mean"] * self.hours_per_run,
                "runs": [{**asdict(run), "hours": run.hours} for run in self.runs],
                "not_covered_by_epsilon": NOT_COVERED_TIMES if self.measured else None,
            },
            "privacy": self.privacy.to_dict(),
            "space_checked": self.space_checked,
            "comparison": self.comparison,
            "search": self.search,
        }


def check_same_privacy(configurations: Sequence[Configuration], dataset_size: int) -> None:
    """Every configuration must sample, step and release alike: the search's per-run σ is one number.

    Given every configuration the space can yield (:func:`reachable_configurations`), not one
    draw of it: ``tune-cost --run`` draws a random search's configurations again. The whole
    per-run plan is compared (with its private linear-probe steps and its mechanism), not only
    q and the steps of ``training``."""
    shapes, plans = {}, {}
    for config in configurations:
        training = config.recipe.training
        q, steps = sampling_schedule(dataset_size, training.batch_size, training.epochs, training.steps)
        shapes.setdefault((q, steps, training.sampling), config)
        plans.setdefault(_plan_key(config.recipe, dataset_size), config)
    if len(shapes) > 1:
        examples = "; ".join(f"q={q:.4g}, {steps} steps, {sampling} sampling for {c.label()}"
                             for (q, steps, sampling), c in list(shapes.items())[:2])
        raise RecipeError(f"the search space varies the privacy plan: its configurations differ in sampling rate, "
                          f"number of steps or sampling ({examples})",
                          "tune-cost gives every run the same per-run σ, which needs the same q, steps and "
                          "sampling: keep training.batch_size, training.epochs/steps and training.sampling out of "
                          "the search (tuning.grid, tuning.ranges and --grid)")
    if len(plans) > 1:
        one, other = list(plans.values())[:2]
        raise RecipeError(f"the search space varies the privacy plan: {one.label()} and {other.label()} are charged "
                          "differently (another number of private steps, e.g. linear-probe steps at the switch, or "
                          "another mechanism)",
                          "tune-cost gives every run the same per-run σ: keep the keys that change a run's private "
                          "steps or how they are noised (continual.at_switch.linear_probe_epochs, continual.schedule, "
                          "privacy.mechanism; with BLT, the momentum and the threshold statistic) out of the search")


def _plan_key(recipe: Recipe, dataset_size: int) -> str:
    """The per-run plan of ``recipe`` as comparable text, but for what moves no per-step event at a
    calibrated σ: the statistic's share of it (σ_eff is one Gaussian however it is split;
    docs/formulas.md) and what a run labels outside ε. Not so under BLT: each charge weighs the
    gradient by its sensitivity and the statistic by its participation, so the split moves ε, and
    the statistic (with its K) stays in the key."""
    plan = asdict(privacy_plan(recipe, dataset_size, groups=1))   # K sizes only the statistic, left out
    if plan["buffers"] and plan["aux"] is not None:
        plan = asdict(privacy_plan(recipe, dataset_size))
    else:
        plan.pop("aux")
    plan.pop("not_covered")
    return repr(sorted(plan.items()))


def fixed_threshold_variant(base: Mapping[str, Any]) -> Recipe:
    """The recipe with a fixed threshold in place of its adaptive policy (same C to start)."""
    data = copy.deepcopy(dict(base))
    clipping = data.setdefault("clipping", {})
    threshold = clipping.get("threshold") or {}
    initial = threshold.get("initial", threshold.get("small", 1.0))
    clipping["threshold"] = {"kind": "fixed", "value": initial}
    return validate_recipe(data, source="fixed-threshold variant")


def tune_cost(base: Mapping[str, Any], recipe: Recipe, *, grid: Sequence[str] = (), random_draws: int | None = None,
              timer: StepTimer | None = None, dataset_size: int | None = None,
              also_timed: Sequence[Recipe] = (), source: str = "recipe") -> TuneCostReport:
    """Compute and privacy of the search over ``recipe`` (see the module docstring).

    Args:
        base: the recipe as a plain mapping (YAML as written, overrides applied).
        recipe: ``base`` validated.
        grid, random_draws: ``--grid`` options and ``--random N`` (see :func:`search_space`).
        timer: how step times are obtained (measured by default).
        dataset_size: N for accounting and steps (default: the recipe's training set).
        also_timed: recipes the caller will time afterwards with the same ``timer`` (counted
            in the progress bar), e.g. :func:`dpclip.tuning.compare.tune_cost_compared`'s.
    """
    timer = timer or StepTimer()
    configurations = search_space(base, recipe, grid, random_draws)
    if dataset_size is None:
        dataset_size = recipe_units(recipe)   # people for a user-level recipe
    elif dataset_size < 1:
        raise DpclipError(f"--dataset-size must be positive, got {dataset_size}", "e.g. --dataset-size 60000")
    # The drawn configurations too: the first one prices the search, and a random space too big to check whole
    # (space_checked) may not have held it.
    check_same_privacy([*configurations, *reachable_configurations(base, recipe, grid, random_draws)], dataset_size)

    # All configurations sample alike (checked above); the first one stands for them all.
    first = configurations[0].recipe
    plan = privacy_plan(first, dataset_size, groups=statistic_groups(first))
    privacy = search_privacy(recipe, plan, len(configurations))

    fixed_variant = None if recipe.clipping.threshold.kind == "fixed" else fixed_threshold_variant(base)
    timer.plan([recipe] + [c.recipe for c in configurations] + ([fixed_variant] if fixed_variant else [])
               + list(also_timed), remeasured=2 if fixed_variant is not None else 0)

    step_seconds = timer.seconds(recipe, recipe.name)
    fixed_seconds = None
    if fixed_variant is not None:
        # The overhead is a ratio of two noisy medians: measure the pair twice, in both orders
        # (A B B A), and keep each one's faster measurement.
        fixed_seconds = timer.seconds(fixed_variant, "fixed threshold")
        fixed_seconds = timer.remeasure(fixed_variant, "fixed threshold")
        step_seconds = timer.remeasure(recipe, recipe.name)
    overhead = timer.overhead(recipe)
    runs = [RunCost(c.label(), c.values, plan.steps, timer.seconds(c.recipe, c.label()), overhead)
            for c in configurations]
    return TuneCostReport(source, dataset_size, timer.measuring, runs, step_seconds, fixed_seconds, privacy,
                          plan=plan, space_checked=space_checked(recipe, grid, random_draws))
