import math

import dp_accounting
import numpy as np
import pytest
from dp_accounting.pld import pld_privacy_accountant
from scipy.optimize import minimize
from scipy.special import ndtr, ndtri
from scipy.stats import binom, norm

from dpclip.audit.fdp_one_run import (gaussian_tail_bound, gaussian_tradeoff, gdp_delta, gdp_epsilon,
                                      mu_lower_bound, rejects_mu, tail_bound)
from dpclip.audit.one_run import epsilon_lower_bound, one_run_audit


def gaussian_guesses(m: int, mu: float, k: int, trials: int, seed: int) -> np.ndarray:
    """Right guesses of the top-k-in, bottom-k-out auditor against an exactly μ-GDP mechanism.

    Canary j's score is N(μ, 1) if it is in and N(0, 1) if not, independently: changing one
    canary changes one coordinate from N(0, 1) to N(μ, 1), whose trade-off curve is f_μ.
    """
    rng = np.random.default_rng(seed)
    included = rng.random((trials, m)) < 0.5
    scores = rng.normal(size=(trials, m)) + mu * included
    order = np.argsort(-scores, axis=1, kind="stable")
    top = np.take_along_axis(included, order[:, :k], axis=1).sum(axis=1)
    bottom = (~np.take_along_axis(included, order[:, m - k:], axis=1)).sum(axis=1)
    return top + bottom


def test_gaussian_tradeoff_at_known_points():
    alpha = np.linspace(0.0, 1.0, 11)
    assert gaussian_tradeoff(alpha, 0.0) == pytest.approx(1.0 - alpha, abs=1e-12)
    # Symmetric: f_μ is its own inverse, f_μ(f_μ(α)) = α.
    assert gaussian_tradeoff(gaussian_tradeoff(alpha, 1.3), 1.3) == pytest.approx(alpha, abs=1e-9)
    assert gaussian_tradeoff(0.05, 1.0) == pytest.approx(norm.cdf(norm.ppf(0.95) - 1.0), abs=1e-12)  # 0.7405
    assert np.all(gaussian_tradeoff(alpha[1:], 40.0) < 1e-300)           # μ → ∞: a perfect test
    assert gaussian_tradeoff(0.0, 5.0) == 1.0 and gaussian_tradeoff(1.0, 5.0) == 0.0


@pytest.mark.parametrize("mu", [0.25, 0.5, 1.0, 2.0])
@pytest.mark.parametrize("delta", [1e-5, 1e-3])
def test_gdp_epsilon_is_the_epsilon_of_a_gaussian_mechanism_of_noise_one_over_mu(mu, delta):
    accountant = pld_privacy_accountant.PLDAccountant()
    accountant.compose(dp_accounting.GaussianDpEvent(1.0 / mu))
    epsilon = gdp_epsilon(mu, delta)
    # PLD's pessimistic discretisation puts it above the exact ε, by at most 4e-8 here.
    assert 0.0 <= accountant.get_epsilon(delta) - epsilon < 1e-6
    assert epsilon == pytest.approx(dp_accounting.get_epsilon_gaussian(1.0 / mu, delta), abs=1e-9)
    assert gdp_delta(epsilon, mu) == pytest.approx(delta, rel=1e-8)


def test_gdp_epsilon_edges():
    assert gdp_epsilon(0.0, 1e-5) == 0.0 and gdp_epsilon(0.0, 0.0) == 0.0
    assert gdp_epsilon(1.0, 0.0) == math.inf                 # μ > 0 has no finite ε at δ = 0
    assert gdp_epsilon(1.0, gdp_delta(0.0, 1.0)) == 0.0      # δ(0) = 2Φ(½) − 1 ≈ 0.383


def test_generic_and_gaussian_tail_bounds_agree():
    for r, v in [(40, 30), (100, 90), (200, 200)]:
        generic = tail_bound(1000, r, v, lambda a: gaussian_tradeoff(a, 1.0))
        assert generic == pytest.approx(gaussian_tail_bound(1000, r, v, 1.0), rel=1e-6, abs=1e-15)


def test_at_mu_zero_the_tail_bound_covers_the_binomial_tail():
    # A mechanism that ignores the canaries leaves every guess right with probability ½,
    # independently: V ~ Binomial(r, ½) exactly. The bound must be at least that tail
    # (measured: 0.032 against 0.028 at r = 100, v = 60).
    for r, v in [(20, 15), (100, 60), (100, 70), (200, 130), (40, 40)]:
        assert gaussian_tail_bound(1000, r, v, 0.0) >= binom.sf(v - 1, r, 0.5) * (1 - 1e-9)


def test_the_recursion_is_the_largest_tail_its_three_facts_allow():
    # The module doc's facts 1-3 are convex constraints on the law π of V (b ≥ f(1 − a)
    # with x ↦ f(1 − x) convex); the recursion claims their maximum of P[V ≥ v] in closed
    # form. A general solver (SLSQP from several starts) finds the same value.
    def solver(m, r, v, mu):
        j = np.arange(r + 1)

        def gap(p):  # b_i − f(1 − a_{i+1}), i = 0..r−1
            a = np.cumsum((j * p)[::-1])[::-1] / m
            b = np.cumsum(((r - j) * p)[::-1])[::-1] / m
            return b[:-1] - ndtr(ndtri(np.clip(a[1:], 1e-300, 1.0)) - mu)

        constraints = [{"type": "eq", "fun": lambda p: p.sum() - 1.0}, {"type": "ineq", "fun": gap}]
        best = 0.0
        for seed in range(3):
            start = np.random.default_rng(seed).dirichlet(np.ones(r + 1))
            result = minimize(lambda p: -p[v:].sum(), start, bounds=[(0, 1)] * (r + 1), method="SLSQP",
                              constraints=constraints, options={"maxiter": 1000, "ftol": 1e-12})
            if result.success and gap(result.x).min() > -1e-9:
                best = max(best, -result.fun)
        return best

    for m, r, v, mu in [(20, 10, 8, 1.0), (20, 10, 10, 1.0), (10, 8, 6, 0.5)]:
        assert gaussian_tail_bound(m, r, v, mu) == pytest.approx(solver(m, r, v, mu), abs=1e-7)


def test_the_tail_bound_holds_for_an_exactly_gaussian_mechanism_where_it_is_nearly_tight():
    # m = 200 canaries, μ = 2, 10 "in" and 10 "out" guesses: all 20 are right in about 89%
    # of runs, and the bound on P[V = 20] is 0.907, within 1.5 points of it, so a bound
    # that were 2 points too optimistic would fail. Tolerance: the simulated frequency of
    # n = 20,000 runs has standard deviation sqrt(p(1 − p)/n) ≤ 0.0022; allow 3 of them.
    m, mu, k, trials = 200, 2.0, 10, 20_000
    right = gaussian_guesses(m, mu, k, trials, seed=0)
    frequency = float(np.mean(right == 2 * k))
    bound = gaussian_tail_bound(m, 2 * k, 2 * k, mu)
    tolerance = 3 * math.sqrt(frequency * (1 - frequency) / trials)
    assert frequency <= bound + tolerance
    assert bound - frequency < 0.03          # measured 0.014: the check has teeth
    for v in range(2 * k - 3, 2 * k):        # lower counts: the bound covers the tail too
        assert float(np.mean(right >= v)) <= gaussian_tail_bound(m, 2 * k, v, mu) + tolerance


def test_the_mu_lower_bound_exceeds_the_true_mu_at_most_alpha_of_the_time():
    # m = 1000, μ = 1, one guess count (k = 50, r = 100) at α = 0.05, no Bonferroni, so
    # the whole α is spent on this test. Exceeding μ means rejecting the truth, which
    # happens with probability ≤ α; over n = 2000 runs the observed rate has standard
    # deviation sqrt(α(1 − α)/n) = 0.0049: allow α + 3 of them (0.065). Measured: 0 of 2000.
    # The check has teeth: the same bounds exceed 0.7·μ in about 24% of runs, so a bound
    # inflated by 1/0.7 (or any bound of the true μ's rejection rate > 6.5%) would fail.
    m, mu, k, alpha, trials = 1000, 1.0, 50, 0.05, 2000
    right = gaussian_guesses(m, mu, k, trials, seed=1)
    bound_at = {v: mu_lower_bound(m, 2 * k, int(v), alpha) for v in np.unique(right)}
    bounds = np.array([bound_at[v] for v in right])
    tolerance = 3 * math.sqrt(alpha * (1 - alpha) / trials)
    assert np.mean(bounds > mu) <= alpha + tolerance
    assert np.mean(bounds / 0.7 > mu) > alpha + tolerance
    # The bound is the crossing of rejection: μ just below it is rejected, just above it not.
    for v, b in bound_at.items():
        if b > 0:
            assert rejects_mu(m, 2 * k, int(v), b, alpha) and not rejects_mu(m, 2 * k, int(v), b + 2e-4, alpha)


@pytest.mark.parametrize("mu, margin", [(1.0, 0.5), (2.0, 1.5)])
def test_the_fdp_bound_is_tighter_than_steinke_on_gaussian_canaries(mu, margin):
    # m = 1000 canaries, scores N(μ, 1) in / N(0, 1) out, δ = 1e-5, both bounds from the
    # same guesses and Bonferroni levels. Measured over seeds 0-4: f-DP − Steinke ε ≥ 0.54
    # (μ = 1; e.g. seed 0: 2.44 against 1.72) and ≥ 1.54 (μ = 2; 6.04 against 3.75), ratio
    # 1.4-1.6; the true ε of μ-GDP at δ = 1e-5 is 4.38 and 10.0. Margins asserted: 0.5, 1.5.
    for seed in (0, 1):
        rng = np.random.default_rng(seed)
        included = rng.random(1000) < 0.5
        result = one_run_audit(rng.normal(size=1000) + mu * included, included, delta=1e-5)
        fdp = result["fdp"]
        assert fdp["epsilon_lower_bound"] >= result["epsilon_lower_bound"] + margin
        assert fdp["epsilon_lower_bound"] < gdp_epsilon(mu, 1e-5)


@pytest.mark.parametrize("m, r", [(200, 100), (1000, 200), (1000, 1000)])
def test_chance_level_guesses_give_no_evidence_to_either_bound(m, r):
    assert epsilon_lower_bound(m, r, r // 2, 0.0) == 0.0
    assert mu_lower_bound(m, r, r // 2) == 0.0
    assert gdp_epsilon(mu_lower_bound(m, r, r // 2), 0.0) == 0.0


def test_one_run_audit_reports_the_fdp_bound_beside_unchanged_fields():
    rng = np.random.default_rng(3)
    included = rng.random(200) < 0.5
    result = one_run_audit(rng.normal(size=200) + 1.5 * included, included, delta=1e-5)
    alpha = 0.05 / len(result["tried"])
    best = max(result["tried"], key=lambda t: t["epsilon_lower_bound"])
    assert result["epsilon_lower_bound"] == best["epsilon_lower_bound"] > 0
    assert (result["guesses"], result["correct"]) == (best["guesses"], best["correct"])
    fdp = result["fdp"]
    assert fdp["curve"] == "gaussian" and fdp["mu_lower_bound"] > 0
    # The same guesses: each k's counts are today's, tested at today's Bonferroni level.
    assert [(t["k"], t["guesses"], t["correct"]) for t in fdp["tried"]] == \
        [(t["k"], t["guesses"], t["correct"]) for t in result["tried"]]
    chosen = max(fdp["tried"], key=lambda t: t["mu_lower_bound"])
    assert fdp["mu_lower_bound"] == chosen["mu_lower_bound"]
    assert fdp["mu_lower_bound"] == mu_lower_bound(200, fdp["guesses"], fdp["correct"], alpha)
    assert fdp["epsilon_lower_bound"] == gdp_epsilon(fdp["mu_lower_bound"], 1e-5)
