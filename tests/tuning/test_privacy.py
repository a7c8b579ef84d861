import functools
from dataclasses import replace
from pathlib import Path

import pytest
from dp_accounting import dp_event, rdp

import dp_accounting

from dpclip.accounting import event_to_dict, solve
from dpclip.errors import AccountingError
from dpclip.recipe import apply_overrides, read_yaml, validate_recipe
from dpclip.planning.plan import plan_for_recipe
from dpclip.tuning.privacy import LIU_TALWAR, NAIVE, REPEAT_AND_SELECT, search_privacy

REPO = Path(__file__).resolve().parents[2]


@functools.lru_cache(maxsize=None)
def _solved(overrides, configurations):
    # RDP keeps these tests fast; the strategies' arithmetic is the same with PLD.
    data = apply_overrides(read_yaml(REPO / "recipes" / "quickstart.yaml"),
                           ["training.epochs=null", "training.steps=50", "privacy.accountant=rdp", *overrides])
    recipe = validate_recipe(data)
    return recipe, search_privacy(recipe, plan_for_recipe(recipe), configurations)


def _privacy(*overrides, configurations=4):
    return _solved(tuple(overrides), configurations)


def test_every_strategy_keeps_the_search_within_the_recipes_epsilon(public_held_out):
    recipe, privacy = _privacy(*public_held_out, "tuning.score=public")
    for strategy in privacy.strategies:
        assert strategy.epsilon <= recipe.privacy.epsilon * (1 + 1e-9)
        assert strategy.noise_multiplier > privacy.recipe_sigma  # a search needs more noise than one run


def test_naive_search_at_the_recipes_sigma_overspends(public_held_out):
    recipe, privacy = _privacy(*public_held_out, "tuning.score=public")
    assert privacy.epsilon_naive_at_recipe_sigma > recipe.privacy.epsilon


def test_repeat_and_select_sigma_meets_epsilon_in_dp_accountings_rdp(public_held_out):
    recipe, privacy = _privacy(*public_held_out, "tuning.score=public")
    strategy = privacy.strategy(REPEAT_AND_SELECT)
    run = dp_accounting.SelfComposedDpEvent(dp_accounting.PoissonSampledDpEvent(
        privacy.sample_rate, dp_accounting.GaussianDpEvent(strategy.noise_multiplier)), privacy.steps)
    event = dp_event.RepeatAndSelectDpEvent(run, 4.0, recipe.tuning.trials_shape)
    eps = rdp.RdpAccountant().compose(event).get_epsilon(privacy.delta)
    assert eps == pytest.approx(strategy.epsilon, rel=1e-12)
    assert 0.99 * recipe.privacy.epsilon <= eps <= recipe.privacy.epsilon


def test_a_private_score_costs_noise_that_a_public_one_does_not(public_held_out):
    _, public = _privacy(*public_held_out, "tuning.score=public")
    _, private = _privacy(*public_held_out, "tuning.score=private", "tuning.score_noise=5")
    for name in (NAIVE, REPEAT_AND_SELECT):
        assert private.strategy(name).noise_multiplier > public.strategy(name).noise_multiplier


def test_liu_talwar_uses_gamma_one_over_two_g_by_default(public_held_out):
    _, privacy = _privacy(*public_held_out, "tuning.score=public", configurations=5)
    assert privacy.strategy(LIU_TALWAR).detail["gamma"] == pytest.approx(0.1)


def test_a_statistic_lowers_the_gradients_share_of_sigma(public_held_out):
    _, privacy = _privacy(*public_held_out, "tuning.score=public", "clipping.grouping=all-layer",
                          "clipping.threshold={kind: quantile, budget_fraction: 0.1}")
    strategy = privacy.strategy(NAIVE)
    assert strategy.gradient_noise_multiplier > strategy.noise_multiplier


def test_a_strategy_the_score_noise_makes_infeasible_is_reported_not_raised():
    # Liu–Talwar gives each run ε/3 at δ₁ ~ 1e-17, which a score noise of 2.5 alone exceeds.
    _, privacy = _privacy("tuning.score=private", "tuning.score_noise=2.5")
    assert "raise tuning.score_noise" in privacy.strategy(LIU_TALWAR).detail["infeasible"]
    assert privacy.strategy(NAIVE).noise_multiplier is not None


def test_a_search_no_noise_can_make_private_is_an_error():
    with pytest.raises(AccountingError, match="no per-run noise"):
        _privacy("tuning.score=private", "tuning.score_noise=0.05")


@pytest.mark.parametrize("mechanism, words", [
    ("{kind: banded-mf, bands: 2}", "cyclic Poisson sampling over 2 groups"),
    ("{kind: blt, buffers: 2}", "no amplification by sampling is claimed"),
])
def test_a_correlated_noise_search_does_not_claim_poisson_subsampling_at_rate_q(mechanism, words):
    _, privacy = _privacy(f"privacy.mechanism={mechanism}", configurations=2)
    assert not privacy.sampling_assumption.startswith("Poisson subsampling")
    assert words in privacy.sampling_assumption


def test_a_blt_search_charges_each_run_the_joint_events_its_ledger_records_with_a_statistic(public_held_out):
    # BLT with quantile thresholds: each participation is the joint Gaussian 1/μ_j² = Δs_j²/σ_g² + (Δ_a/σ_a)²
    # (docs/formulas.md, "BLT"). The search's run event used σ_eff on the gradient alone (Σ Δs_j² ≥ K: more ε
    # than spent), and `tune-cost --run` stopped at its first trial, whose ledger it did not match.
    recipe, privacy = _privacy(*public_held_out, "tuning.score=public", "privacy.mechanism={kind: blt, buffers: 2}",
                               "clipping.grouping=all-layer", "clipping.threshold={kind: quantile, budget_fraction: 0.3}",
                               configurations=2)
    plan = plan_for_recipe(recipe)
    for strategy in privacy.strategies:
        sigma = strategy.noise_multiplier
        ledger = solve(replace(plan, target_epsilon=None, noise_multiplier=sigma)).total_event
        assert event_to_dict(privacy.release.training(sigma)) == event_to_dict(ledger)
    # dp_accounting directly: two runs at the recipe's σ are one Gaussian of twice a run's precision.
    split = solve(plan).split
    squared, participations = plan.sensitivities[-1], len(plan.sensitivities)
    precision = squared / split.gradient_noise_multiplier ** 2 + participations * (0.5 / split.sigma_aux) ** 2
    two_runs = rdp.RdpAccountant().compose(dp_accounting.GaussianDpEvent((2 * precision) ** -0.5))
    assert privacy.epsilon_naive_at_recipe_sigma == pytest.approx(two_runs.get_epsilon(privacy.delta), rel=1e-9)


def test_a_strategy_a_statistic_of_fixed_noise_leaves_no_gradient_share_is_reported_not_raised(public_held_out):
    # DC-SGD's σ_H = 5 (Δ = 1) splits only σ_eff < 5: the naive and Liu–Talwar searches need more, which
    # used to stop all of tune-cost with the split's error; repeat-and-select fits.
    _, privacy = _privacy(*public_held_out, "tuning.score=public", "clipping.grouping=all-layer",
                          "clipping.threshold={kind: dcsgd-p, sigma_hist: 5.0}", "privacy.epsilon=0.5")
    for name in (NAIVE, LIU_TALWAR):
        assert privacy.strategy(name).noise_multiplier is None
        assert "clipping.threshold.sigma_hist = 5 is too small" in privacy.strategy(name).detail["infeasible"]
    chosen = privacy.strategy(REPEAT_AND_SELECT)
    assert chosen.noise_multiplier < 5.0
    assert chosen.gradient_noise_multiplier == pytest.approx((chosen.noise_multiplier ** -2 - 1 / 25) ** -0.5)


def test_a_blt_search_with_a_statistic_of_fixed_noise_finds_the_sigma_below_its_cap(public_held_out):
    # BLT, σ_H = 5 (Δ = 1): only σ_eff < 5 splits, and the run's charges need the split. The search over
    # σ_eff probed 8 on its way to ≈ 4.2 and refused the whole search; it runs over σ_g instead.
    recipe, privacy = _privacy(*public_held_out, "tuning.score=public", "privacy.mechanism={kind: blt, buffers: 2}",
                               "clipping.grouping=all-layer", "clipping.threshold={kind: dcsgd-p, sigma_hist: 5.0}",
                               "privacy.epsilon=3", configurations=2)
    plan = plan_for_recipe(recipe)
    naive = privacy.strategy(NAIVE)
    assert naive.noise_multiplier < 5.0 and privacy.strategy(REPEAT_AND_SELECT).noise_multiplier < 5.0
    # dp_accounting directly: two runs are one Gaussian of twice a run's precision s²/σ_g² + K·(1/5)².
    precision = plan.sensitivities[-1] / naive.gradient_noise_multiplier ** 2 + len(plan.sensitivities) / 25
    two_runs = rdp.RdpAccountant().compose(dp_accounting.GaussianDpEvent((2 * precision) ** -0.5))
    assert naive.epsilon == pytest.approx(two_runs.get_epsilon(privacy.delta), rel=1e-6)
    assert 0.99 * 3 <= naive.epsilon <= 3
