"""`dpclip account` below the CLI: its flags or a recipe -> the solved plan it reports.

The command parses its flags into :class:`AccountFlags`; :func:`account_report` checks
them, builds the privacy plan (from a recipe through :func:`dpclip.planning.plan.plan_for_recipe`,
or from command-line sizes through :func:`dpclip.planning.plan.plan_from_flags`), calibrates
σ and splits the budget (:func:`dpclip.planning.plan.solve_plan`, docs/accounting.md) and
returns an :class:`AccountReport`, which the CLI only renders. What a run directory spent is
read by the CLI from the run-directory layers above this one (docs/design.md).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dpclip.accounting import AuxSpec, PlanResult, PrivacyPlan
from dpclip.accounting.group import group_privacy
from dpclip.engine.policies import statistic_aliases, statistic_spec
from dpclip.errors import AccountingError
# The module, not its names: looked up at call time, so that a test can stand in for solve_plan.
from dpclip.planning import plan as planning

#: Said (on stderr, by the CLI) when --bins is given: it is accepted, and changes nothing.
BINS_DEPRECATED = ("--bins is deprecated and changes nothing: the histogram's sensitivity, so σ and ε, do not "
                   "depend on the number of bins")
#: Said when --groups is given without --aux: K only sizes a statistic's sensitivity.
GROUPS_WITHOUT_AUX = ("--groups changes nothing without --aux: the gradient's sensitivity is the total threshold C "
                      "whatever the grouping; K sizes only a histogram's or quantile's sensitivity")


@dataclass(frozen=True)
class AccountFlags:
    """The command-line sizes of `dpclip account` (None: not given); see its --help."""

    eps: float | None = None
    delta: float | None = None
    sigma: float | None = None
    sample_rate: float | None = None
    steps: int | None = None
    dataset_size: int | None = None
    batch_size: int | None = None
    epochs: float | None = None
    aux: str | None = None
    aux_sigma: float | None = None
    aux_fraction: float | None = None
    bins: int | None = None
    groups: int | None = None
    accountant: str = "pld"          # pld, rdp or both
    sampling: str = "poisson"        # poisson or shuffle
    mechanism: str = "dp-sgd"        # dp-sgd, banded-mf or blt
    bands: int | None = None
    buffers: int | None = None
    unit: str = "example"            # example or user
    users: int | None = None
    users_per_batch: int | None = None
    max_examples_per_user: int | None = None
    group_size: int | None = None

    def given_with_a_recipe(self) -> list[str]:
        """The flags given that a recipe's plan fixes itself (it takes key=value overrides instead)."""
        flags = {"--eps": self.eps, "--delta": self.delta, "--sigma": self.sigma, "--sample-rate": self.sample_rate,
                 "--steps": self.steps, "--batch-size": self.batch_size, "--epochs": self.epochs, "--aux": self.aux,
                 "--aux-sigma": self.aux_sigma, "--aux-fraction": self.aux_fraction, "--bins": self.bins,
                 "--groups": self.groups}
        return [name for name, value in flags.items() if value is not None]


@dataclass(frozen=True)
class AccountReport:
    """What `dpclip account` reports: the plan, its solution, and how it was asked for.

    ``accountant`` is the one asked for (a recipe's own when --accountant is left at pld; --json adds
    ``accountant_used``, the one whose ε is reported, as ledger.json does);
    ``title`` names the recipe (None: flags); ``bins`` is the DC-SGD histogram's b, shown
    only; ``group`` is :func:`group_guarantee`'s, with --group-size.
    """

    plan: PrivacyPlan
    result: PlanResult
    accountant: str
    title: str | None = None
    bins: int | None = None
    group: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        """The report as `dpclip account --json` prints it."""
        plan, result, split = self.plan, self.result, self.result.split
        out = {
            "source": self.title or "flags",
            "accountant": self.accountant,
            "accountant_used": result.accountant,   # the text's first row: RDP where PLD fell back
            "sample_rate": plan.sample_rate,
            "steps": plan.steps,
            "bands": plan.bands,
            "mechanism": plan.mechanism,
            "buffers": plan.buffers,
            "groups": plan.groups,
            "delta": plan.delta,
            "target_epsilon": plan.target_epsilon,
            "epsilon": result.epsilon,
            "epsilon_rdp": result.epsilon_rdp,
            "noise": {
                "noise_multiplier": split.noise_multiplier,
                "gradient_noise_multiplier": split.gradient_noise_multiplier,
                "sigma_aux": split.sigma_aux,
                "aux_sensitivity": split.aux_sensitivity,
                "aux_fraction": split.aux_fraction,
                "inflation": split.inflation,
                "bins": self.bins,
            },
            "fallback_reason": result.fallback_reason,
            "statement": result.statement.to_dict(),
        }
        return out | ({"group": self.group} if self.group else {})


def account_report(flags: AccountFlags, recipe: Path | None = None, overrides: Sequence[str] = (),
                   note: Callable[[str], None] = lambda text: None) -> AccountReport:
    """The plan of ``recipe`` (with key=value ``overrides``) or, without one, of ``flags``,
    solved with the accountant asked for. ``note`` is told of accepted flags that change
    nothing (:data:`BINS_DEPRECATED`)."""
    if recipe is not None:
        plan, accountant, title, bins = recipe_plan(recipe, overrides, flags)
    else:
        plan, accountant, title, bins = flags_plan(flags, overrides, note), flags.accountant, None, flags.bins
    result = planning.solve_plan(plan, accountant)
    group = None if flags.group_size is None else group_guarantee(result.epsilon, plan.delta, flags.group_size,
                                                                 plan.unit)
    return AccountReport(plan, result, accountant, title, bins, group)


def recipe_plan(path: Path, overrides: Sequence[str], flags: AccountFlags):
    """(plan, accountant, title, bins) of the recipe at ``path``: its own accountant unless
    --accountant asks for rdp or both; N from --dataset-size, else its data."""
    given = flags.given_with_a_recipe()
    if given:
        raise AccountingError(f"{', '.join(given)} cannot be combined with a recipe",
                              "change the recipe with key=value overrides, e.g. privacy.epsilon=4 (its "
                              "clipping groups K are counted on its model)")
    from dpclip.recipe import load_recipe  # looked up at call time: tests stand in for it

    recipe = load_recipe(path, list(overrides))
    if planning.only_public(recipe):
        raise AccountingError("continual.schedule only-public takes no private step: its run spends ε = 0, and "
                              "there is no private phase to account",
                              "to see the plan of the private phase a switch run adds: dpclip account RECIPE "
                              "continual.schedule=switch")
    _check_threshold_lists(recipe)
    plan = planning.plan_for_recipe(recipe, dataset_size=flags.dataset_size)
    accountant = recipe.privacy.accountant if flags.accountant == "pld" else flags.accountant
    return plan, accountant, f"recipe {recipe.name}", getattr(recipe.clipping.threshold, "bins", None)


def _check_threshold_lists(recipe) -> None:
    """A threshold list must have one value per clipping group, as training checks (cli.md: account and
    train cannot disagree on a recipe)."""
    threshold = recipe.clipping.threshold
    lists = {name: value for name in ("value", "small", "large")
             if isinstance(value := getattr(threshold, name, None), (list, tuple))}
    if lists:
        groups = planning.count_groups(recipe)
        for name, value in lists.items():
            if len(value) != groups:
                raise AccountingError(f"clipping.threshold.{name} lists {len(value)} thresholds but there are "
                                      f"{groups} groups", "give one threshold per group, or a single float")


def flags_plan(flags: AccountFlags, overrides: Sequence[str], note: Callable[[str], None]) -> PrivacyPlan:
    """The plan of the command-line sizes, after the checks that name the flags that belong together."""
    if overrides:
        raise AccountingError(f"unexpected arguments: {' '.join(overrides)}",
                              "key=value overrides need a recipe: dpclip account RECIPE.yaml key=value")
    aux_spec = flags_statistic(flags, note)
    if (flags.mechanism == "banded-mf") != (flags.bands is not None):
        raise AccountingError("--bands goes with --mechanism banded-mf, and banded-mf needs --bands",
                              "e.g. --mechanism banded-mf --bands 8")
    dataset_size, batch_size = flags.dataset_size, flags.batch_size
    if flags.unit == "user":
        dataset_size, batch_size = user_sizes(flags)
    elif flags.users is not None or flags.users_per_batch is not None or flags.max_examples_per_user is not None:
        raise AccountingError("--users, --users-per-batch and --max-examples-per-user go with --unit user",
                              "e.g. --unit user --users 10000 --users-per-batch 256 --max-examples-per-user 8")
    if (flags.mechanism == "blt") != (flags.buffers is not None):
        raise AccountingError("--buffers goes with --mechanism blt, and blt needs --buffers",
                              "e.g. --mechanism blt --buffers 2")
    if flags.buffers is not None and flags.buffers < 1:   # 0 read as "no BLT" printed DP-SGD's smaller σ
        raise AccountingError(f"--buffers must be at least 1, got {flags.buffers}", "e.g. --mechanism blt --buffers 2")
    return planning.plan_from_flags(delta=flags.delta, epsilon=flags.eps, noise_multiplier=flags.sigma,
                                    sample_rate=flags.sample_rate, steps=flags.steps, dataset_size=dataset_size,
                                    batch_size=batch_size, epochs=flags.epochs, accountant="pld",
                                    sampling=flags.sampling, aux=aux_spec,
                                    bands=1 if flags.bands is None else flags.bands, buffers=flags.buffers or 0,
                                    unit=flags.unit, max_examples_per_user=flags.max_examples_per_user)


def flags_statistic(flags: AccountFlags, note: Callable[[str], None]) -> AuxSpec | None:
    """What the planner charges for --aux's statistic (None without --aux), after the checks of
    --bins, --aux-sigma and --aux-fraction."""
    if flags.bins is not None:
        if flags.aux != "histogram":
            raise AccountingError("--bins belongs to the DC-SGD histogram preset",
                                  "use it with --aux histogram, e.g. --aux histogram --aux-sigma 5")
        if flags.bins < 2:
            raise AccountingError(f"--bins must be at least 2, got {flags.bins}", "the DC-SGD paper uses 20 bins")
        note(BINS_DEPRECATED)
    if flags.groups is not None and flags.aux is None:
        if flags.groups < 1:   # with --aux, statistic() refuses it in the same words
            raise AccountingError(f"groups must be an integer >= 1, got {flags.groups}", "e.g. --groups 4")
        note(GROUPS_WITHOUT_AUX)
    if flags.aux is not None:
        return statistic(flags.aux, 1 if flags.groups is None else flags.groups, flags.aux_sigma, flags.aux_fraction)
    if flags.aux_sigma is not None or flags.aux_fraction is not None:
        raise AccountingError("--aux-sigma / --aux-fraction need --aux histogram|quantile",
                              "e.g. --aux quantile --aux-fraction 0.01")
    return None


def user_sizes(flags: AccountFlags) -> tuple[int | None, int | None]:
    """(N, B) of a user-level plan from its flags: people and expected people per batch (docs/users.md)."""
    if flags.dataset_size is not None or flags.batch_size is not None:
        raise AccountingError("--unit user counts people: give --users and --users-per-batch, not --dataset-size "
                              "and --batch-size", "e.g. --unit user --users 10000 --users-per-batch 256")
    if flags.max_examples_per_user is None:
        raise AccountingError("--unit user needs --max-examples-per-user (k, the most records of a person in a step)",
                              "e.g. --max-examples-per-user 8")
    if flags.sample_rate is None and (flags.users is None or flags.users_per_batch is None):
        raise AccountingError("--unit user needs --users and --users-per-batch (or --sample-rate, people per batch / "
                              "people)", "e.g. --unit user --users 10000 --users-per-batch 256")
    return flags.users, flags.users_per_batch


def statistic(alias: str, groups: int, sigma: float | None, fraction: float | None) -> AuxSpec:
    """What the planner charges for the statistic ``alias`` of a registered threshold policy."""
    spec = statistic_spec(alias)
    if spec is None:
        raise AccountingError(f"unknown --aux statistic {alias!r}", "use one of: " + ", ".join(statistic_aliases()))
    return spec.aux_spec(groups, sigma, fraction)


def group_guarantee(epsilon: float, delta: float, group_size: int, unit: str = "example") -> dict[str, Any]:
    """The guarantee of a group of ``group_size`` units at once: (kε, k·e^((k−1)ε)·δ) (docs/users.md)."""
    group_epsilon, group_delta = group_privacy(epsilon, delta, group_size)
    return {"group_size": group_size, "of": "people" if unit == "user" else "records", "epsilon": group_epsilon,
            "delta": group_delta}
