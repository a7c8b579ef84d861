"""What a hyperparameter search costs in privacy: composition, random stopping, repeat-and-select.

Training G configurations on the same private data releases G models (and whatever
selects among them), so the search, not one run, is what the (ε, δ) guarantee must
cover (docs/tuning.md; DC-SGD paper §II-C). Three ways to account for it:

naive composition
    every run is released: ``SelfComposedDpEvent(run_event, G)``. Exact but pessimistic.
Liu–Talwar random stopping (Liu & Talwar 2019, "Private selection from private
candidates", STOC; Theorem 1 of the DC-SGD paper)
    run random candidates, stop after each with probability γ, never more than
    T = (1/γ)·ln(1/δ₂), output the best. If each run is (ε₁, δ₁)-DP the search is
    (3ε₁ + 3√(2δ₁), 3√(2δ₁)·T + δ₂)-DP. A closed-form (ε, δ) statement: no DpEvent.
Papernot–Steinke repeat-and-select (Papernot & Steinke 2022, "Hyperparameter tuning
with Renyi differential privacy", ICLR)
    run a random number K of random candidates, K Poisson or truncated negative
    binomial, output the best: ``RepeatAndSelectDpEvent(run_event, mean, shape)``, which
    only dp_accounting's RDP accountant supports.

Noise calibration for a search reuses the bracketed root search of
:mod:`dpclip.accounting.calibrate`. This module never imports torch.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass

import dp_accounting
from dp_accounting import dp_event

from dpclip.accounting.accountants import check_accountant, check_delta_value, account
from dpclip.accounting.calibrate import check_target, quiet_dp_accounting, sigma_for_epsilon
from dpclip.errors import AccountingError

__all__ = [
    "TRIAL_DISTRIBUTIONS",
    "LiuTalwarBudget",
    "naive_search_event",
    "repeat_and_select_event",
    "repeat_and_select_shape",
    "liu_talwar_guarantee",
    "liu_talwar_per_run_budget",
    "calibrate_search_noise",
    "truncated_negative_binomial_gamma",
    "draw_trial_count",
]

#: Distributions of the number of trials K that Papernot–Steinke analyse (as dpclip names them).
TRIAL_DISTRIBUTIONS = ("poisson", "truncated-negative-binomial")


def _check_runs(runs: int) -> None:
    if isinstance(runs, bool) or not isinstance(runs, int) or runs < 1:
        raise AccountingError(f"the number of runs must be a whole number >= 1, got {runs!r}",
                              "a search trains at least one configuration")


def naive_search_event(run_event: dp_accounting.DpEvent, runs: int) -> dp_accounting.DpEvent:
    """Every one of ``runs`` trainings released: ``SelfComposedDpEvent(run_event, runs)``."""
    _check_runs(runs)
    return dp_accounting.SelfComposedDpEvent(run_event, runs)


def repeat_and_select_shape(distribution: str, shape: float | None = None) -> float:
    """dp_accounting's ``shape`` for a distribution of K: Poisson is shape = ∞.

    For the truncated negative binomial, ``shape`` is η ≥ 0 (η = 0 logarithmic, η = 1
    geometric), as in Papernot & Steinke 2022, §2.
    """
    if distribution == "poisson":
        return math.inf
    if distribution == "truncated-negative-binomial":
        if shape is None or not 0 <= shape < math.inf:
            raise AccountingError(f"the truncated negative binomial needs a finite shape η >= 0, got {shape!r}",
                                  "η = 1 is the geometric distribution, η = 0 the logarithmic one")
        return float(shape)
    raise AccountingError(f"unknown distribution of the number of trials {distribution!r}",
                          "use one of: " + ", ".join(TRIAL_DISTRIBUTIONS))


def repeat_and_select_event(run_event: dp_accounting.DpEvent, mean: float, shape: float) -> dp_accounting.DpEvent:
    """Papernot–Steinke: K ~ D(mean, shape) runs, best one released (RDP accountant only).

    ``shape = inf`` is K ~ Poisson(mean); a finite ``shape`` η is the truncated negative
    binomial with that mean (Papernot & Steinke 2022, Theorems 2 and 6).
    """
    if not isinstance(mean, (int, float)) or not 0 < mean < math.inf:
        raise AccountingError(f"the mean number of trials must be a finite number > 0, got {mean!r}",
                              "the usual choice is the number of configurations in the grid")
    if math.isinf(shape) and mean < 1:
        raise AccountingError(f"a Poisson number of trials needs a mean of at least 1, got {mean:g}",
                              "choose a mean >= 1, e.g. the number of configurations")
    if math.isfinite(shape) and mean <= 1:
        raise AccountingError(f"a truncated negative binomial (K >= 1) needs a mean above 1, got {mean:g}",
                              "choose a mean > 1, e.g. the number of configurations")
    return dp_event.RepeatAndSelectDpEvent(run_event, float(mean), float(shape))


@dataclass(frozen=True)
class LiuTalwarBudget:
    """Per-run budget (ε₁, δ₁) of Liu–Talwar random stopping and what it guarantees.

    Attributes:
        epsilon_run, delta_run: (ε₁, δ₁) each run may spend.
        gamma: stopping probability γ after each run.
        delta_stop: δ₂, the probability mass cut by the hard limit.
        max_runs: T = (1/γ)·ln(1/δ₂), the hard limit on the number of runs.
        epsilon, delta: the search's guarantee, from :func:`liu_talwar_guarantee`.
    """

    epsilon_run: float
    delta_run: float
    gamma: float
    delta_stop: float
    max_runs: float
    epsilon: float
    delta: float


def _check_stopping(gamma: float, delta_stop: float) -> None:
    if not isinstance(gamma, (int, float)) or not 0 < gamma <= 1:
        raise AccountingError(f"the stopping probability γ must be in (0, 1], got {gamma!r}",
                              "DC-SGD used γ = 1/(2G) for a grid of G configurations")
    if not isinstance(delta_stop, (int, float)) or not 0 < delta_stop < 1:
        raise AccountingError(f"δ₂ must be in (0, 1), got {delta_stop!r}", "DC-SGD used δ₂ = 1e-20")


def liu_talwar_guarantee(epsilon_run: float, delta_run: float, gamma: float, delta_stop: float
                         ) -> tuple[float, float, float]:
    """(ε, δ, T) of Liu–Talwar random stopping over (ε₁, δ₁)-DP runs.

    Formula (Liu & Talwar 2019; as stated in Theorem 1 of the DC-SGD paper, Wei et al.)::

        T  = (1/γ) · ln(1/δ₂)
        ε  = 3ε₁ + 3·√(2δ₁)
        δ  = 3·√(2δ₁)·T + δ₂
    """
    _check_stopping(gamma, delta_stop)
    max_runs = math.log(1.0 / delta_stop) / gamma
    root = 3.0 * math.sqrt(2.0 * delta_run)
    return 3.0 * epsilon_run + root, root * max_runs + delta_stop, max_runs


def liu_talwar_per_run_budget(epsilon: float, delta: float, gamma: float, delta_stop: float) -> LiuTalwarBudget:
    """The largest per-run (ε₁, δ₁) whose Liu–Talwar search stays within (ε, δ).

    Inverting :func:`liu_talwar_guarantee` with the whole δ spent::

        √(2δ₁) = (δ − δ₂) / (3T)      i.e. δ₁ = ((δ − δ₂) / (3T))² / 2
        ε₁     = (ε − 3·√(2δ₁)) / 3

    Spending all of δ is the best split: ε₁ only loses 3√(2δ₁)/3 ≈ 1e-8 to it, while a
    larger δ₁ lowers the noise each run needs.
    """
    check_target(epsilon)
    check_delta_value(delta)
    _check_stopping(gamma, delta_stop)
    if delta_stop >= delta:
        raise AccountingError(f"δ₂ = {delta_stop:g} leaves nothing of δ = {delta:g} for the runs",
                              "choose δ₂ much smaller than δ, e.g. 1e-20")
    max_runs = math.log(1.0 / delta_stop) / gamma
    root = (delta - delta_stop) / (3.0 * max_runs)  # √(2δ₁)
    delta_run = root * root / 2.0
    epsilon_run = (epsilon - 3.0 * root) / 3.0
    if epsilon_run <= 0:
        raise AccountingError(f"ε = {epsilon:g} is too small for Liu–Talwar random stopping",
                              "raise ε or δ")
    search_epsilon, search_delta, _ = liu_talwar_guarantee(epsilon_run, delta_run, gamma, delta_stop)
    return LiuTalwarBudget(epsilon_run, delta_run, gamma, delta_stop, max_runs, search_epsilon, search_delta)


def calibrate_search_noise(
    run_event_of: Callable[[float], dp_accounting.DpEvent],
    search_event_of: Callable[[dp_accounting.DpEvent], dp_accounting.DpEvent],
    target_epsilon: float,
    delta: float,
    accountant: str,
    *,
    rtol: float = 0.01,
) -> float:
    """The per-run noise multiplier σ whose whole search meets ``target_epsilon``.

    ε(σ) = ε of ``search_event_of(run_event_of(σ))`` at ``delta`` with ``accountant``;
    the answer has ε(σ) ∈ [(1 − rtol)·target, target], like
    :func:`~dpclip.accounting.calibrate_noise_multiplier` (same bracketed search).
    """
    check_target(target_epsilon)
    check_delta_value(delta)
    check_accountant(accountant)

    def eps(sigma: float) -> float:
        value = account(search_event_of(run_event_of(sigma)), delta, accountant).epsilon
        return math.inf if math.isnan(value) else value

    with quiet_dp_accounting():
        return sigma_for_epsilon(eps, target_epsilon, rtol, 1.0, f"δ = {delta:g}, the whole search")


# ------------------------------------------------------------- drawing the number of trials

def _tnb_mean(gamma: float, shape: float) -> float:
    """Mean of the truncated negative binomial D_{η,γ} (Papernot & Steinke 2022, §2)::

        η > 0:  E[K] = η(1 − γ) / (γ(1 − γ^η))
        η = 0:  E[K] = (1 − γ) / (γ·ln(1/γ))      (logarithmic distribution)
    """
    if shape == 0:
        return (1 - gamma) / (gamma * math.log(1 / gamma))
    return shape * (1 - gamma) / (gamma * (1 - gamma ** shape))


def truncated_negative_binomial_gamma(mean: float, shape: float) -> float:
    """The γ ∈ (0, 1) of D_{η,γ} with the given mean (bisection; E[K] decreases in γ)."""
    if not mean > 1:
        raise AccountingError(f"a truncated negative binomial needs a mean above 1, got {mean:g}",
                              "choose a mean > 1")
    lo, hi = 1e-12, 1 - 1e-12
    for _ in range(200):
        mid = (lo + hi) / 2
        if _tnb_mean(mid, shape) > mean:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def _poisson(mean: float, rng: random.Random) -> int:
    """Knuth's multiplication method, in log space so large means do not underflow."""
    count, total = 0, 0.0
    while True:
        total += -math.log(1.0 - rng.random())  # Exp(1) inter-arrival times
        if total > mean:
            return count
        count += 1


def draw_trial_count(mean: float, shape: float, rng: random.Random) -> int:
    """Draw K for repeat-and-select: Poisson(mean) when shape = ∞, else D_{η,γ} with that mean.

    D_{η,γ} (Papernot & Steinke 2022, §2) has, for k = 1, 2, ...::

        η > 0:  P[K = k] = (1 − γ)^k / (γ^(−η) − 1) · Γ(k + η) / (Γ(η)·k!)
        η = 0:  P[K = k] = (1 − γ)^k / (k · ln(1/γ))

    sampled by inverting its cumulative distribution.
    """
    if math.isinf(shape):
        return _poisson(mean, rng)
    gamma = truncated_negative_binomial_gamma(mean, shape)
    u, cumulative, k = rng.random(), 0.0, 0
    while True:
        k += 1
        if shape == 0:
            log_p = k * math.log1p(-gamma) - math.log(k) - math.log(math.log(1 / gamma))
        else:
            log_p = (k * math.log1p(-gamma) - math.log(gamma ** -shape - 1)
                     + math.lgamma(k + shape) - math.lgamma(shape) - math.lgamma(k + 1))
        cumulative += math.exp(log_p)
        if u <= cumulative or k > 10**7:
            return k
