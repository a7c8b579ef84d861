"""The privacy side of a search: ε of a run, of the whole search, and the per-run σ
that keeps the whole search within the recipe's (ε, δ) under three accountings.

What one run releases ("the run event"): its training, ``steps`` Poisson-sampled Gaussian
steps at the joint noise multiplier σ (docs/accounting.md, joint release), and — when the recipe's
``tuning.score`` is ``private`` — the noisy count of correct predictions on the held-out
split, a Gaussian mechanism with sensitivity 1 and std ``tuning.score_noise``. Selecting
the best run by that noisy score is post-processing. With a ``public`` score the held-out
split is (by the user's claim) public data, its score is post-processing of the model,
and nothing is added. The math lives in :mod:`dpclip.accounting.tuning`.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

import dp_accounting

from dpclip.accounting import AuxSpec, PrivacyPlan, account, solve, split_noise, training_event
from dpclip.accounting.blt import blt_event, split_ratios
from dpclip.accounting.events import joint_noise_multiplier
from dpclip.accounting.split import NoiseSplit
from dpclip.accounting.plan import participations
from dpclip.accounting.calibrate import quiet_dp_accounting
from dpclip.accounting.statement import SHUFFLE_ASSUMPTION, SHUFFLE_CAVEAT, sampling_name
from dpclip.accounting.tuning import (
    calibrate_search_noise,
    liu_talwar_per_run_budget,
    naive_search_event,
    repeat_and_select_event,
    repeat_and_select_shape,
)
from dpclip.errors import AccountingError
from dpclip.recipe.schema import Recipe
from dpclip.rundir.searchdir import SCORE_MEANING

NAIVE, LIU_TALWAR, REPEAT_AND_SELECT = "naive", "liu-talwar", "repeat-and-select"


@dataclass(frozen=True)
class RunRelease:
    """Everything one run of the search releases, as a function of its noise multiplier σ:
    the one home of "the run event" (the search's ledger, its calibration and the check of
    each trial's own ledger all build it here)."""

    sample_rate: float
    steps: int
    score_noise: float | None  # None: public score, nothing released besides the model
    bands: int = 1                        # banded MF's b
    sensitivities: tuple[float, ...] = ()  # BLT's squared prefix sensitivities (PrivacyPlan)
    aux: AuxSpec | None = None             # the threshold statistic sharing σ (PrivacyPlan)

    def split(self, sigma: float) -> NoiseSplit:
        """σ_eff shared with the threshold statistic as the run's plan shares it (an AccountingError
        when a statistic of fixed noise std leaves the gradient nothing: σ_eff ≥ σ_a/Δ_a)."""
        if self.aux is None:
            return NoiseSplit.gradient_only(sigma)
        return split_noise(sigma, self.aux.sensitivity, aux_sigma=self.aux.sigma, aux_fraction=self.aux.fraction,
                           sigma_name=self.aux.sigma_name)

    def training(self, sigma: float) -> dp_accounting.DpEvent:
        """The run's training alone, as its ledger composes it: ``steps`` Poisson-sampled
        Gaussian steps at σ; banded MF's ⌈T/b⌉ participations at q·b; BLT's charges, each
        joint over the gradient and the statistic (docs/formulas.md)."""
        if self.sensitivities:
            gradient, aux_ratio_sq = split_ratios(self.split(sigma))
            return blt_event(gradient, self.sensitivities, aux_ratio_sq)
        if self.bands > 1:
            return training_event(min(1.0, self.sample_rate * self.bands), sigma, participations(self.steps, self.bands))
        return training_event(self.sample_rate, sigma, self.steps)

    def to_total(self, sigma: float) -> float:
        """σ_eff of the search variable: itself, but σ_g under BLT with a statistic of fixed std σ_a,
        which only σ_eff < σ_a/Δ_a can split (a search over σ_eff would probe past it):
        σ_eff = (σ_g⁻² + (Δ_a/σ_a)²)^(−1/2)."""
        if not self.sensitivities or self.aux is None or self.aux.sigma is None:
            return sigma
        return joint_noise_multiplier(sigma, [(self.aux.sensitivity, self.aux.sigma)])

    def calibrate(self, search_event_of, epsilon: float, delta: float, accountant: str) -> float:
        """The per-run σ_eff whose search meets ε (:func:`calibrate_search_noise` over :meth:`to_total`'s variable)."""
        found = calibrate_search_noise(lambda sigma: self.event(self.to_total(sigma)), search_event_of, epsilon, delta,
                                       accountant)
        return self.to_total(found)

    def event(self, sigma: float) -> dp_accounting.DpEvent:
        """The training, composed with the private score's Gaussian mechanism when there is one."""
        training = self.training(sigma)
        if self.score_noise is None:
            return training
        return dp_accounting.ComposedDpEvent([training, dp_accounting.GaussianDpEvent(self.score_noise)])


@dataclass(frozen=True)
class Strategy:
    """One way to account for the search, and the per-run noise it needs.

    Attributes:
        name: naive | liu-talwar | repeat-and-select.
        noise_multiplier: per-run joint noise multiplier σ_eff that keeps the search within ε.
        gradient_noise_multiplier: the gradient's share of it after the recipe's threshold statistic
            (equal to ``noise_multiplier`` for a fixed threshold): the noise a user feels.
        epsilon, delta: the search's guarantee at that σ.
        accountant: which accountant gave ``epsilon``.
        detail: strategy-specific numbers (runs, (ε₁, δ₁), T, mean and shape of K).
    """

    name: str
    noise_multiplier: float | None      # None: no σ meets the budget (detail['infeasible'] says why)
    gradient_noise_multiplier: float | None
    epsilon: float
    delta: float
    accountant: str
    detail: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class SearchPrivacy:
    """The privacy cost of a search of ``configurations`` runs of one recipe."""

    configurations: int
    target_epsilon: float
    delta: float
    accountant: str
    sample_rate: float
    steps: int
    score: str
    score_noise: float | None
    recipe_sigma: float
    epsilon_one_run: float
    epsilon_naive_at_recipe_sigma: float
    strategies: list[Strategy]
    bands: int = 1
    sensitivities: tuple[float, ...] = ()
    sampling: str = "poisson"   # how the loader forms batches; "shuffle" is accounted as if Poisson
    unit: str = "example"       # privacy.unit: what a private score's sensitivity 1 is over
    aux: AuxSpec | None = None  # the recipe's threshold statistic (not written: its plan states it)

    @property
    def score_meaning(self) -> str | None:
        """What a private selection score is (None: a public score), as the search's summary says it."""
        return SCORE_MEANING[self.unit] if self.score == "private" else None

    @property
    def caveats(self) -> list[str]:
        """What the search's ε does not prove, as the run statements say it (a shuffled loader)."""
        return [SHUFFLE_CAVEAT] if self.sampling == "shuffle" else []

    @property
    def sampling_assumption(self) -> str:
        """How the batches are drawn and what the accounting assumes of them (the statements' wording)."""
        if self.sensitivities:
            return ("cyclic sampling (BLT): one group of the data a step, in turn; no amplification by sampling is "
                    "claimed (each run is one Gaussian mechanism over all its steps)")
        if self.bands > 1:
            return (f"cyclic Poisson sampling over {self.bands} groups: step t samples group t mod {self.bands} at "
                    f"rate q·{self.bands}, as the accounting assumes")
        if self.sampling == "poisson":
            return "Poisson subsampling at rate q, as the accounting assumes"
        return SHUFFLE_ASSUMPTION

    @property
    def recipe_gradient_sigma(self) -> float:
        """The gradient's share of the recipe's σ_eff, split as its plan splits it (console only)."""
        return self.release.split(self.recipe_sigma).gradient_noise_multiplier

    @property
    def release(self) -> RunRelease:
        """What one run of this search releases (:class:`RunRelease`)."""
        return RunRelease(self.sample_rate, self.steps, self.score_noise, self.bands, self.sensitivities, self.aux)

    def strategy(self, name: str) -> Strategy:
        return next(s for s in self.strategies if s.name == name)

    def to_dict(self) -> dict[str, Any]:
        return {**{k: v for k, v in asdict(self).items() if k != "aux"}, "sampling": sampling_name(self.sampling, self.bands, bool(self.sensitivities)),
                "sampling_assumption": self.sampling_assumption, "caveats": self.caveats,
                "score_meaning": self.score_meaning}


def _infeasible(exc, release: RunRelease) -> str:
    why = exc.message
    if release.score_noise is not None and "unreachable" in why:
        why += f" (the private score alone has noise std {release.score_noise:g}: raise tuning.score_noise)"
    return why


def run_release(recipe: Recipe, plan: PrivacyPlan) -> RunRelease:
    score_noise = recipe.tuning.score_noise if recipe.tuning.score == "private" else None
    return RunRelease(plan.sample_rate, plan.steps, score_noise, plan.bands, tuple(plan.sensitivities), plan.aux)


def gradient_sigma(plan: PrivacyPlan, sigma_total: float) -> float:
    """σ of the gradient once the plan's threshold statistic has taken its share of σ_eff (an
    AccountingError when a statistic of fixed noise std leaves it none)."""
    return RunRelease(plan.sample_rate, plan.steps, None, aux=plan.aux).split(sigma_total).gradient_noise_multiplier


def trials_mean(recipe: Recipe, configurations: int) -> float:
    """E[K] of repeat-and-select: the recipe's, else the number of configurations."""
    return float(recipe.tuning.trials_mean or configurations)


def search_privacy(recipe: Recipe, plan: PrivacyPlan, configurations: int, *,
                   target_epsilon: float | None = None) -> SearchPrivacy:
    """ε of one run and of the search, and per-run σ under each accounting.

    ``plan`` is the recipe's privacy plan (:func:`dpclip.planning.plan.plan_for_recipe`);
    the search's budget is the recipe's ε (``target_epsilon`` overrides it).
    """
    tuning = recipe.tuning
    epsilon = target_epsilon if target_epsilon is not None else recipe.privacy.epsilon
    if epsilon is None:
        raise AccountingError("the recipe gives no ε, so there is no budget for the search to stay within",
                              "set privacy.epsilon (the whole search's budget), e.g. privacy.epsilon=8")
    delta, accountant = plan.delta, plan.accountant
    release = run_release(recipe, plan)

    # One run as the recipe trains it (σ calibrated to ε for ONE run, or given).
    solved = solve(plan)
    recipe_sigma = solved.split.noise_multiplier
    naive_at_recipe = account(naive_search_event(release.event(recipe_sigma), configurations),
                              delta, accountant).epsilon

    strategies = []
    # Naive composition: all G runs released.
    try:
        sigma = release.calibrate(lambda run: naive_search_event(run, configurations), epsilon, delta, accountant)
        gradient = gradient_sigma(plan, sigma)   # a statistic of fixed std may leave the gradient no share
    except AccountingError as exc:
        strategies.append(Strategy(NAIVE, None, None, epsilon, delta, accountant,
                                   {"runs": configurations, "infeasible": _infeasible(exc, release)}))
    else:
        result = account(naive_search_event(release.event(sigma), configurations), delta, accountant)
        strategies.append(Strategy(NAIVE, sigma, gradient, result.epsilon, delta,
                                   result.accountant, {"runs": configurations}))

    # Liu–Talwar random stopping: each run gets (ε₁, δ₁), the search (ε, δ) by the theorem.
    gamma = tuning.stop_probability or 1.0 / (2 * configurations)
    detail = {"gamma": gamma, "delta_stop": tuning.stop_delta}
    try:
        budget = liu_talwar_per_run_budget(epsilon, delta, gamma, tuning.stop_delta)
        detail.update(epsilon_run=budget.epsilon_run, delta_run=budget.delta_run, max_runs=budget.max_runs,
                      expected_runs=1.0 / gamma)
        sigma = release.calibrate(lambda run: run, budget.epsilon_run, budget.delta_run, accountant)
        gradient = gradient_sigma(plan, sigma)
    except AccountingError as exc:
        # No per-run budget at all (ε too small), or a fixed score noise that alone exceeds ε₁ at
        # δ₁ ~ 1e-17. Say so and keep the other strategies.
        strategies.append(Strategy(LIU_TALWAR, None, None, epsilon, delta, accountant,
                                   {**detail, "infeasible": _infeasible(exc, release)}))
    else:
        with quiet_dp_accounting():  # PLD routinely falls back to RDP at δ₁ ~ 1e-17; the result says so
            run_result = account(release.event(sigma), budget.delta_run, accountant)
        strategies.append(Strategy(LIU_TALWAR, sigma, gradient, budget.epsilon, budget.delta,
                                   run_result.accountant, {**detail, "epsilon_run_achieved": run_result.epsilon}))

    # Papernot–Steinke repeat-and-select: K random runs, RDP accountant only.
    mean = trials_mean(recipe, configurations)
    shape = repeat_and_select_shape(tuning.trials, tuning.trials_shape)
    detail = {"distribution": tuning.trials, "mean": mean, "shape": None if math.isinf(shape) else shape}
    try:
        sigma = release.calibrate(lambda run: repeat_and_select_event(run, mean, shape), epsilon, delta, "rdp")
        gradient = gradient_sigma(plan, sigma)
    except AccountingError as exc:
        strategies.append(Strategy(REPEAT_AND_SELECT, None, None, epsilon, delta, "rdp",
                                   {**detail, "infeasible": _infeasible(exc, release)}))
    else:
        result = account(repeat_and_select_event(release.event(sigma), mean, shape), delta, "rdp")
        strategies.append(Strategy(REPEAT_AND_SELECT, sigma, gradient, result.epsilon, delta,
                                   "rdp", detail))
    if all(s.noise_multiplier is None for s in strategies):
        reasons = strategies[0].detail["infeasible"]
        raise AccountingError(f"no per-run noise keeps this search within ε = {epsilon:g}: {reasons}",
                              "raise privacy.epsilon, search fewer configurations"
                              + (", or raise tuning.score_noise" if release.score_noise is not None else ""))

    return SearchPrivacy(configurations, float(epsilon), delta, accountant, plan.sample_rate, plan.steps,
                         tuning.score, release.score_noise, recipe_sigma, solved.epsilon, naive_at_recipe, strategies,
                         release.bands, release.sensitivities, plan.sampling, recipe.privacy.unit, plan.aux)


__all__ = ["NAIVE", "LIU_TALWAR", "REPEAT_AND_SELECT", "RunRelease", "Strategy", "SearchPrivacy",
           "run_release", "gradient_sigma", "trials_mean", "search_privacy"]
