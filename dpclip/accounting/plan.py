"""The one event builder shared by ``dpclip account`` and the training loop (docs/accounting-api.md).

A :class:`PrivacyPlan` says how a run will sample and for how long, and either the
target ε or the noise. :func:`solve` turns it into the noise multipliers, the per-step
event, the ε and the statement. The training loop records ``PlanResult.step_event`` in
its ledger every step (with ``PlanResult.step_metadata``), so what ``dpclip account``
predicts and what a run spends are built by the same code and cannot disagree.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import dp_accounting

from dpclip.accounting.accountants import check_accountant, check_delta_value, account, note_slow_pld
from dpclip.accounting.blt import (blt_event, blt_groups, calibrate_blt, check_sensitivities, increment_events,
                                  split_ratios)
from dpclip.accounting.calibrate import check_steps, check_target, calibrate_noise_multiplier
from dpclip.accounting.events import check_sample_rate, gradient_step_event, is_number
from dpclip.accounting.split import NoiseSplit, split_noise
from dpclip.accounting.statement import GRADIENT_RELEASE, SAMPLINGS, SHUFFLE_CAVEAT, PrivacyStatement
from dpclip.errors import AccountingError

__all__ = ["AuxSpec", "PrivacyPlan", "PlanResult", "solve", "steps_for_epochs"]

def steps_for_epochs(epochs: float, sample_rate: float) -> int:
    """Number of Poisson-sampled steps in ``epochs`` epochs: ceil(epochs / q).

    Each step sees q·N examples in expectation, so one epoch is 1/q steps. The ratio is
    rounded to 9 decimals first so floating-point noise (90 / 0.04 = 2250.0000000000005)
    does not add a step.
    """
    check_sample_rate(sample_rate)
    if not isinstance(epochs, (int, float)) or not 0 < epochs < math.inf:
        raise AccountingError(f"epochs must be a finite number > 0, got {epochs!r}", "e.g. --epochs 10")
    if not math.isfinite(epochs / sample_rate):   # 1e308 epochs: ceil() of inf would overflow
        raise AccountingError(f"{epochs:g} epochs at q = {sample_rate:g} are too many steps to count", "give fewer")
    return max(1, math.ceil(round(epochs / sample_rate, 9)))


@dataclass(frozen=True)
class AuxSpec:
    """An auxiliary statistic released with every gradient step (adaptive thresholds).

    The threshold policy that releases it says what it is (``statistic(K)``); accounting needs the numbers.

    Attributes:
        name: how the privacy statement names it, e.g. "quantile counts".
        sensitivity: its L2 sensitivity Δ under adding or removing one example (with K groups).
        groups: number of clipping groups K it was computed for (named in the statement).
        sigma: its Gaussian noise std σ_a, or
        fraction: its share r of the privacy budget (exactly one of sigma / fraction).
    """

    name: str
    sensitivity: float
    groups: int = 1
    sigma: float | None = None
    fraction: float | None = None
    sigma_name: str = field(default="aux_sigma", compare=False)   # how sigma was given, named in messages

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise AccountingError(f"an auxiliary statistic needs a name, got {self.name!r}",
                                  "e.g. AuxSpec('quantile counts', sensitivity=1.0, groups=4, fraction=0.05)")
        if isinstance(self.sensitivity, bool) or not isinstance(self.sensitivity, (int, float)) \
                or not 0 < self.sensitivity < math.inf:
            raise AccountingError(
                f"auxiliary sensitivity must be a finite number > 0, got {self.sensitivity!r}",
                "it is the statistic's L2 sensitivity; the threshold policy's spec declares it",
            )
        if isinstance(self.groups, bool) or not isinstance(self.groups, int) or self.groups < 1:
            raise AccountingError(
                f"groups must be an integer >= 1, got {self.groups!r}",
                "groups is the number of clipping groups K (1 for flat clipping)",
            )
        if (self.sigma is None) == (self.fraction is None):
            raise AccountingError(
                "give exactly one of the auxiliary statistic's sigma and fraction",
                "fraction=0.05 spends 5% of the budget on it; sigma=S fixes its noise std",
            )

    def release(self) -> str:
        """How this release is named in the privacy statement."""
        return f"{self.name} (K={self.groups}, sensitivity {round(self.sensitivity, 6)})"


def check_bands(bands: int, steps: int, sample_rate: float) -> None:
    """b of banded MF: a whole number in [1, steps], with q·b <= 1 (a group of N/b examples
    must be able to give an expected batch of q·N)."""
    if isinstance(bands, bool) or not isinstance(bands, int) or not 1 <= bands <= steps:
        raise AccountingError(f"bands must be a whole number from 1 to the {steps} steps, got {bands!r}",
                              "bands: 1 is DP-SGD; a few to a few dozen bands, well below the steps, suit most runs")
    if sample_rate * bands > 1.0 + 1e-12:
        raise AccountingError(
            f"{bands} bands at sample rate q = {sample_rate:g}: each of the {bands} groups holds N/{bands} examples, "
            f"fewer than the expected batch q·N (q·b = {sample_rate * bands:g} > 1)",
            "use fewer bands (at most 1/q) or a smaller batch")


def participations(steps: int, bands: int) -> int:
    """⌈T/b⌉: the most steps one example takes part in under b-cyclic sampling (and the
    number of compositions the accountant charges)."""
    return -(-steps // bands)


@dataclass(frozen=True)
class PrivacyPlan:
    """What a run will do, for accounting purposes.

    Attributes:
        sample_rate: Poisson sampling rate q = expected batch size / data set size.
        steps: number of steps.
        delta: the δ of the guarantee.
        accountant: "pld" (default) or "rdp".
        sampling: how the loader forms batches, "poisson" or "shuffle" (caveat).
        target_epsilon: calibrate the noise to this ε, or
        noise_multiplier: the total (joint) noise multiplier σ_eff — exactly one of the two.
        aux: an auxiliary statistic sharing the budget, if any.
        seeded_randomness: noise and batches derived from the recipe's seed (statement warns).
        not_covered: what the run releases outside ε (listed in the statement).
        bands: b of banded matrix factorization (correlated noise; docs/formulas.md, "Banded
            matrix factorization"); 1 is DP-SGD. With b > 1 the data are cut into b groups
            (each example's drawn privately: "Cyclic groups"), step t Poisson-samples group t mod b at rate
            q·b, and each example takes part in at most ⌈T/b⌉ steps, b apart; with the
            strategy's columns of norm at most 1 and disjoint b apart, the run is accounted as
            ⌈T/b⌉ compositions of PoissonSampled(q·b, Gaussian(σ)) (Choquette-Choo et al.,
            "Amplified banded matrix factorization", NeurIPS 2023, Thm. 4).
        buffers: k of the BLT mechanism (docs/formulas.md, "BLT"); 0: not BLT. The data are
            cut into G = ⌊1/q⌋ groups sampled in turn at rate q·G, and the run is one Gaussian
            mechanism, charged one participation at a time (:mod:`dpclip.accounting.blt`).
        unit: "example" (a record) or "user" (all records of one person: ``sample_rate`` is
            then expected people per batch / ``users``, and at most ``max_examples_per_user``
            records of a person go into a step; docs/users.md). The events are the same; the
            statement says which unit they protect.
        sensitivities: with ``buffers``, the squared sensitivity of the run's first j + 1
            cycles of G steps, one per participation (the engine computes them from the
            strategy: :func:`dpclip.engine.blt.participation_sensitivities`).
    """

    sample_rate: float
    steps: int
    delta: float
    accountant: str = "pld"
    sampling: str = "poisson"
    target_epsilon: float | None = None
    noise_multiplier: float | None = None
    aux: AuxSpec | None = None
    seeded_randomness: bool = False
    not_covered: tuple[str, ...] = ()
    bands: int = 1
    buffers: int = 0
    sensitivities: tuple[float, ...] = ()
    unit: str = "example"
    users: int | None = None
    max_examples_per_user: int | None = None

    def __post_init__(self) -> None:
        if self.unit not in ("example", "user"):
            raise AccountingError(f"unknown privacy unit {self.unit!r}", "use 'example' or 'user'")
        if self.unit == "user" and (not isinstance(self.max_examples_per_user, int) or self.max_examples_per_user < 1):
            raise AccountingError(f"user-level privacy needs k >= 1 records per person, got "
                                  f"{self.max_examples_per_user!r}", "e.g. --max-examples-per-user 8")
        check_sample_rate(self.sample_rate)
        check_steps(self.steps)
        check_bands(self.bands, self.steps, self.sample_rate)
        if self.groups > 1 and self.sampling != "poisson":
            raise AccountingError(
                f"{self.mechanism} needs cyclic Poisson sampling, not {self.sampling}",
                "use sampling: poisson: the min-separation of participations is what the accounting assumes")
        if self.buffers:
            if self.bands > 1:
                raise AccountingError("a plan is banded MF or BLT, not both", "give bands or buffers")
            check_sensitivities(self.sensitivities, participations(self.steps, self.groups))
        check_delta_value(self.delta)
        check_accountant(self.accountant)
        if self.sampling not in SAMPLINGS:
            raise AccountingError(
                f"unknown sampling {self.sampling!r}",
                "use 'poisson' (what the accountant assumes) or 'shuffle' (fixed-size shuffled batches)",
            )
        if (self.target_epsilon is None) == (self.noise_multiplier is None):
            raise AccountingError(
                "give exactly one of target ε and noise multiplier",
                "--eps 8 calibrates the noise; --noise-multiplier 1.1 computes the ε it gives",
            )
        if self.target_epsilon is not None:
            check_target(self.target_epsilon)
        if self.noise_multiplier is not None and (
            not is_number(self.noise_multiplier) or not 0 < self.noise_multiplier < math.inf
        ):
            raise AccountingError(
                f"noise multiplier must be a finite number > 0, got {self.noise_multiplier!r}",
                "give σ itself (a bool is not a number), e.g. noise_multiplier=1.0: without noise there is no "
                "privacy guarantee; typical values are 0.5 to 5",
            )
        if self.aux is not None and not isinstance(self.aux, AuxSpec):
            raise AccountingError(f"aux must be an AuxSpec, got {type(self.aux).__name__}", "AuxSpec('quantile counts', sensitivity=1.0, groups=4, fraction=0.05)")

    @property
    def mechanism(self) -> str:
        return "blt" if self.buffers else "banded-mf" if self.bands > 1 else "dp-sgd"

    @property
    def groups(self) -> int:
        """G: the groups sampled in turn (an example's participations are at least G steps
        apart): b for banded MF, ⌊1/q⌋ for BLT, 1 for DP-SGD."""
        return blt_groups(self.sample_rate) if self.buffers else self.bands

    @property
    def group_rate(self) -> float:
        """q·G, the rate at which a step samples its group (never above 1 by rounding)."""
        return min(1.0, self.sample_rate * self.groups)


@dataclass(frozen=True)
class PlanResult:
    """The solved plan.

    Attributes:
        split: how σ_eff is shared between gradient and auxiliary statistic.
        epsilon: ε of the whole run with the plan's accountant (after any fallback).
        epsilon_rdp: ε with RDP, alongside.
        step_event: the per-step joint event PoissonSampled(q, Gaussian(σ_eff)) (docs/accounting.md, joint
            release); with banded MF, the event of one participation, PoissonSampled(q·b, Gaussian(σ_eff)),
            charged at the steps :meth:`charged_at` names.
        total_event: SelfComposed(step_event, steps), or SelfComposed(step_event, ⌈T/b⌉).
        statement: the privacy statement for ``epsilon``.
        fallback_reason: why PLD fell back to RDP, if it did.
        accountant: the accountant that produced ``epsilon``.
        plan: the plan that was solved.
        participation_events: BLT's charges, one per participation (:mod:`dpclip.accounting.blt`).
    """

    split: NoiseSplit
    epsilon: float
    epsilon_rdp: float
    step_event: dp_accounting.DpEvent
    total_event: dp_accounting.DpEvent
    statement: PrivacyStatement
    fallback_reason: str | None
    accountant: str
    plan: PrivacyPlan
    participation_events: tuple = ()

    def charged_at(self, step: int) -> bool:
        """Whether the step with 0-based index ``step`` is charged in the ledger: every step of
        DP-SGD; with b bands the first of each cycle of b steps (each example's group comes up
        once a cycle, so a cycle is one participation at most); BLT likewise with its G groups."""
        return step % self.plan.groups == 0

    def event_at(self, step: int) -> dp_accounting.DpEvent:
        """What the ledger records for the step with 0-based index ``step``: the step event, or
        ``NoOpDpEvent`` for a banded-MF step that is not the first of its cycle (the ledger
        then counts every step, and charges ⌈T/b⌉ of them)."""
        if not self.charged_at(step):
            return dp_accounting.NoOpDpEvent()
        if self.participation_events:  # BLT: the participation's increment
            return self.participation_events[step // self.plan.groups]
        return self.step_event

    def charges(self, steps: int) -> int:
        """Ledger entries after ``steps`` steps: ⌈steps / G⌉."""
        return participations(steps, self.plan.groups)

    @property
    def step_metadata(self) -> dict[str, Any]:
        """What the training loop passes to ``Ledger.record`` with ``step_event``: the split (a shuffled loader: its caveat)."""
        return {
            "noise_multiplier": self.split.noise_multiplier,
            "gradient_noise_multiplier": self.split.gradient_noise_multiplier,
            "sigma_aux": self.split.sigma_aux,
            "aux_sensitivity": self.split.aux_sensitivity,
            "aux_fraction": self.split.aux_fraction, "releases": list(self.statement.releases),
        } | ({"sample_rate": self.plan.sample_rate, "groups": self.plan.groups, "buffers": self.plan.buffers,
              "sensitivity": math.sqrt(self.plan.sensitivities[-1])} if self.plan.buffers else {}) \
            | ({"caveats": [SHUFFLE_CAVEAT]} if self.plan.sampling == "shuffle" else {})


def solve(plan: PrivacyPlan) -> PlanResult:
    """Noise, events, ε and statement of a plan.

    With ``target_epsilon``: σ_eff = calibrate_noise_multiplier(target, δ, q, steps,
    plan.accountant) (ε <= target, within 1%), then split by the aux spec. With
    ``noise_multiplier``: σ_eff is given and ε is computed. Adding an auxiliary
    statistic never changes ε at a fixed σ_eff; it raises the gradient's noise to
    σ_g = σ_eff·inflation instead.
    """
    if not isinstance(plan, PrivacyPlan):
        raise AccountingError(f"expected a PrivacyPlan, got {type(plan).__name__}", "build one with PrivacyPlan(...)")
    # Banded MF charges ⌈T/b⌉ participations at rate q·b (PrivacyPlan.bands); b = 1 is DP-SGD's q and T.
    charged_rate, charged_steps = plan.group_rate, participations(plan.steps, plan.bands)
    if plan.buffers:
        return _solve_blt(plan)
    note_slow_pld(charged_steps, plan.accountant)
    if plan.target_epsilon is not None:
        sigma_total = calibrate_noise_multiplier(
            plan.target_epsilon, plan.delta, charged_rate, charged_steps, plan.accountant
        )
    else:
        sigma_total = float(plan.noise_multiplier)
    if plan.aux is None:
        split = NoiseSplit.gradient_only(sigma_total)
        releases = [GRADIENT_RELEASE]
    else:
        split = split_noise(sigma_total, plan.aux.sensitivity, aux_sigma=plan.aux.sigma, aux_fraction=plan.aux.fraction,
                            sigma_name=plan.aux.sigma_name)
        releases = [GRADIENT_RELEASE, plan.aux.release()]
    # The event is built from σ_eff itself (not re-derived from the split), so the
    # ledger of a run and this plan hold bit-identical events.
    step_event = gradient_step_event(charged_rate, split.noise_multiplier)
    total_event = dp_accounting.SelfComposedDpEvent(step_event, charged_steps)
    result = account(total_event, plan.delta, plan.accountant)

    statement = PrivacyStatement(
        epsilon=result.epsilon,
        delta=plan.delta,
        accountant=result.accountant,
        conversion=result.conversion,
        sample_rate=plan.sample_rate,
        steps=plan.steps,
        noise_multiplier=split.noise_multiplier,
        gradient_noise_multiplier=split.gradient_noise_multiplier,
        sigma_aux=split.sigma_aux,
        epsilon_rdp=result.epsilon_rdp if result.accountant == "pld" else None,
        sampling=plan.sampling,
        releases=releases,
        fallback_reason=result.fallback_reason,
        seeded_randomness=plan.seeded_randomness,
        not_covered=list(plan.not_covered),
        bands=plan.bands,
        **unit_fields(plan),
    )
    return PlanResult(
        split=split,
        epsilon=result.epsilon,
        epsilon_rdp=result.epsilon_rdp,
        step_event=step_event,
        total_event=total_event,
        statement=statement,
        fallback_reason=result.fallback_reason,
        accountant=result.accountant,
        plan=plan,
    )


def _solve_blt(plan: PrivacyPlan) -> PlanResult:
    """BLT: σ calibrated on (or ε computed for) the composed participation charges
    (:mod:`dpclip.accounting.blt`); the step event is what the engine reports each step. With a
    threshold statistic, σ is the joint σ_eff, split as for DP-SGD, and each charge is joint."""
    def split_of(sigma: float) -> NoiseSplit:
        if plan.aux is None:
            return NoiseSplit.gradient_only(sigma)
        return split_noise(sigma, plan.aux.sensitivity, aux_sigma=plan.aux.sigma, aux_fraction=plan.aux.fraction,
                           sigma_name=plan.aux.sigma_name)

    def ratios(sigma: float) -> tuple[float, float]:
        return split_ratios(split_of(sigma))

    if plan.target_epsilon is not None:
        fixed = None if plan.aux is None or plan.aux.sigma is None else (plan.aux.sensitivity, plan.aux.sigma)
        sigma = calibrate_blt(plan.target_epsilon, plan.delta, plan.sensitivities, plan.accountant, split=ratios,
                              fixed_aux=fixed)
    else:
        sigma = float(plan.noise_multiplier)
    split = split_of(sigma)
    gradient, aux_ratio_sq = ratios(sigma)
    charges = increment_events(gradient, plan.sensitivities, aux_ratio_sq)
    total_event = blt_event(gradient, plan.sensitivities, aux_ratio_sq)
    result = account(total_event, plan.delta, plan.accountant)
    releases = [GRADIENT_RELEASE] if plan.aux is None else [GRADIENT_RELEASE, plan.aux.release()]
    statement = PrivacyStatement(
        epsilon=result.epsilon, delta=plan.delta, accountant=result.accountant, conversion=result.conversion,
        sample_rate=plan.sample_rate, steps=plan.steps, noise_multiplier=sigma,
        gradient_noise_multiplier=split.gradient_noise_multiplier, sigma_aux=split.sigma_aux,
        epsilon_rdp=result.epsilon_rdp if result.accountant == "pld" else None, sampling=plan.sampling,
        releases=releases, fallback_reason=result.fallback_reason,
        seeded_randomness=plan.seeded_randomness, not_covered=list(plan.not_covered),
        buffers=plan.buffers, groups=plan.groups, sensitivity=math.sqrt(plan.sensitivities[-1]), **unit_fields(plan))
    return PlanResult(split=split, epsilon=result.epsilon, epsilon_rdp=result.epsilon_rdp,
                      step_event=gradient_step_event(plan.group_rate, sigma),
                      total_event=total_event, statement=statement, fallback_reason=result.fallback_reason,
                      accountant=result.accountant, plan=plan, participation_events=charges)


def unit_fields(plan: PrivacyPlan) -> dict[str, str]:
    """The statement's privacy unit and neighbouring relation (none: example-level defaults)."""
    if plan.unit != "user":
        return {}
    return user_unit(plan.users, plan.max_examples_per_user)


def user_unit(users: int | None, max_examples_per_user: int | None) -> dict[str, str]:
    people = f"{users} people, " if users is not None else ""
    return {"unit": f"user-level ({people}at most {max_examples_per_user} records of a person in a step)",
            "neighbouring": "add/remove all records of one person"}
