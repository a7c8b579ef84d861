"""Search accounting: naive composition, Liu–Talwar random stopping, repeat-and-select."""

import math
import random

import dp_accounting
import pytest
from dp_accounting import dp_event, rdp

from dpclip.accounting import account, calibrate_noise_multiplier, training_event
from dpclip.accounting.tuning import (
    calibrate_search_noise,
    draw_trial_count,
    liu_talwar_guarantee,
    liu_talwar_per_run_budget,
    naive_search_event,
    repeat_and_select_event,
    repeat_and_select_shape,
    truncated_negative_binomial_gamma,
)
from dpclip.errors import AccountingError

Q, STEPS, DELTA = 0.01, 300, 1e-5


def one_run(sigma):
    return dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(Q, dp_accounting.GaussianDpEvent(sigma)), STEPS)


def test_naive_search_equals_g_fold_composition_in_dp_accounting():
    runs, sigma = 7, 1.3
    ours = account(naive_search_event(training_event(Q, sigma, STEPS), runs), DELTA, "rdp").epsilon
    composed_by_hand = rdp.RdpAccountant().compose(one_run(sigma), runs).get_epsilon(DELTA)
    assert ours == pytest.approx(composed_by_hand, rel=1e-12)


def test_naive_search_of_g_runs_is_g_times_the_steps():
    runs, sigma = 5, 1.1
    search = account(naive_search_event(training_event(Q, sigma, STEPS), runs), DELTA, "pld").epsilon
    long_run = account(training_event(Q, sigma, runs * STEPS), DELTA, "pld").epsilon
    assert search == pytest.approx(long_run, rel=1e-3)


@pytest.mark.parametrize("mean, shape", [(10.0, math.inf), (10.0, 1.0), (4.0, 0.0), (6.0, 0.5)])
def test_repeat_and_select_equals_dp_accountings_rdp_accountant(mean, shape):
    ours = account(repeat_and_select_event(training_event(Q, 1.2, STEPS), mean, shape), DELTA, "rdp").epsilon
    direct = rdp.RdpAccountant().compose(dp_event.RepeatAndSelectDpEvent(one_run(1.2), mean, shape))
    assert ours == pytest.approx(direct.get_epsilon(DELTA), rel=1e-12)


def test_poisson_is_dp_accountings_infinite_shape():
    assert repeat_and_select_shape("poisson") == math.inf
    assert repeat_and_select_shape("truncated-negative-binomial", 0.5) == 0.5


def test_liu_talwar_guarantee_is_the_theorem():
    eps1, delta1, gamma, delta2 = 0.5, 1e-12, 0.1, 1e-10
    epsilon, delta, max_runs = liu_talwar_guarantee(eps1, delta1, gamma, delta2)
    assert max_runs == pytest.approx(math.log(1e10) / 0.1)
    assert epsilon == pytest.approx(1.5 + 3 * math.sqrt(2e-12))
    assert delta == pytest.approx(3 * math.sqrt(2e-12) * math.log(1e10) / 0.1 + 1e-10)


def test_liu_talwar_per_run_budget_spends_exactly_the_search_budget():
    budget = liu_talwar_per_run_budget(2.0, 1e-5, 0.05, 1e-20)
    assert budget.epsilon == pytest.approx(2.0, rel=1e-12)
    assert budget.delta == pytest.approx(1e-5, rel=1e-12)


def test_liu_talwar_refuses_a_stop_delta_that_takes_all_of_delta():
    with pytest.raises(AccountingError, match="δ₂"):
        liu_talwar_per_run_budget(2.0, 1e-5, 0.05, 1e-5)


def test_search_calibration_of_naive_composition_matches_calibrating_g_times_the_steps():
    runs = 4
    sigma = calibrate_search_noise(lambda s: training_event(Q, s, STEPS),
                                   lambda run: naive_search_event(run, runs), 3.0, DELTA, "rdp")
    reference = calibrate_noise_multiplier(3.0, DELTA, Q, runs * STEPS, "rdp")
    assert sigma == pytest.approx(reference, rel=0.02)
    eps = rdp.RdpAccountant().compose(one_run(sigma), runs).get_epsilon(DELTA)
    assert 0.99 * 3.0 <= eps <= 3.0


def test_search_calibration_refuses_an_unreachable_budget():
    with pytest.raises(AccountingError, match="unreachable"):
        calibrate_search_noise(lambda s: dp_accounting.ComposedDpEvent(
            [training_event(Q, s, STEPS), dp_accounting.GaussianDpEvent(0.1)]), lambda run: run, 1.0, DELTA, "rdp")


def test_geometric_gamma_is_one_over_the_mean():
    # η = 1 is the geometric distribution on {1, 2, ...}, whose mean is 1/γ.
    assert truncated_negative_binomial_gamma(8.0, 1.0) == pytest.approx(1 / 8, rel=1e-9)


@pytest.mark.parametrize("shape", [math.inf, 1.0, 0.0])
def test_drawn_trial_counts_have_the_requested_mean(shape):
    rng = random.Random(0)
    draws = [draw_trial_count(5.0, shape, rng) for _ in range(4000)]
    assert sum(draws) / len(draws) == pytest.approx(5.0, rel=0.1)
    if math.isfinite(shape):
        assert min(draws) >= 1  # truncated: never zero trials


def test_truncated_negative_binomial_needs_a_mean_above_one():
    with pytest.raises(AccountingError, match="mean above 1"):
        repeat_and_select_event(training_event(Q, 1.0, STEPS), 1.0, 1.0)


def test_a_poisson_number_of_trials_below_mean_one_is_an_accounting_error_not_a_crash():
    from dpclip.accounting.tuning import repeat_and_select_event

    run = dp_accounting.GaussianDpEvent(1.0)
    with pytest.raises(AccountingError, match="at least 1"):
        repeat_and_select_event(run, 0.5, math.inf)


@pytest.mark.parametrize("trials, mean", [("poisson", 0.5), ("truncated-negative-binomial", 1.0)])
def test_the_recipe_refuses_a_mean_number_of_trials_its_law_cannot_have(trials, mean):
    from pathlib import Path

    from dpclip.errors import RecipeError
    from dpclip.recipe import load_recipe

    quickstart = Path(__file__).resolve().parents[2] / "recipes" / "quickstart.yaml"
    with pytest.raises(RecipeError, match="trials_mean") as info:
        load_recipe(quickstart, [f"tuning.trials={trials}", f"tuning.trials_mean={mean}"])
    assert info.value.hint
