"""Budget split between gradient and auxiliary statistics (docs/accounting.md)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dpclip.accounting import NoiseSplit, joint_noise_multiplier, split_noise
from dpclip.accounting.split import check_aux_fits
from dpclip.errors import AccountingError


@pytest.mark.parametrize(("fraction", "inflation"), [(0.01, 1.005), (0.1, 1.054)])
def test_budget_fraction_inflates_gradient_noise_as_published(fraction, inflation):
    """docs/accounting.md: r = 0.01 -> σ_g = 1.005σ; r = 0.1 -> 1.054σ."""
    split = split_noise(2.0, 1.0, aux_fraction=fraction)   # quantile counts of K = 4 groups: Δ = 1
    assert split.inflation == pytest.approx(inflation, abs=5e-4)
    assert split.gradient_noise_multiplier == pytest.approx(2.0 * split.inflation, rel=1e-12)
    assert split.aux_fraction == pytest.approx(fraction, rel=1e-12)


def test_given_aux_sigma_reproduces_dc_sgd_example():
    """docs/accounting.md (DC-SGD): σ = 1.0, σ_H = 10, Δ = 1 -> σ_T = 1.00504."""
    split = split_noise(1.0, 1.0, aux_sigma=10.0)   # one histogram: Δ = 1
    assert split.gradient_noise_multiplier == pytest.approx(1.00504, abs=1e-5)
    assert split.aux_fraction == pytest.approx(0.01, rel=1e-12)


@settings(max_examples=50, deadline=None)
@given(
    sigma=st.floats(0.1, 50.0),
    sensitivity=st.floats(0.1, 5.0),
    fraction=st.floats(1e-4, 0.99),
)
def test_split_recombines_to_the_total_noise_multiplier(sigma, sensitivity, fraction):
    by_fraction = split_noise(sigma, sensitivity, aux_fraction=fraction)
    joint = joint_noise_multiplier(by_fraction.gradient_noise_multiplier, [(sensitivity, by_fraction.sigma_aux)])
    assert joint == pytest.approx(sigma, rel=1e-9)
    # Splitting by the σ_a just found gives back the same split.
    by_sigma = split_noise(sigma, sensitivity, aux_sigma=by_fraction.sigma_aux)
    assert by_sigma.gradient_noise_multiplier == pytest.approx(by_fraction.gradient_noise_multiplier, rel=1e-9)
    assert by_sigma.aux_fraction == pytest.approx(fraction, rel=1e-9)


def test_aux_sigma_at_or_below_sensitivity_times_sigma_is_refused_with_smallest_working_value():
    with pytest.raises(AccountingError) as info:
        split_noise(2.0, 1.0, aux_sigma=2.0)  # Δ·σ = 2: the statistic would use the whole budget
    assert "greater than" in info.value.hint and "= 2" in info.value.hint
    with pytest.raises(AccountingError):
        split_noise(2.0, 1.0, aux_sigma=1.5)


def test_a_vanishing_aux_sigma_is_refused_as_too_small_not_an_overflow():
    # (Δ/σ_a)² overflowed as a float power (OverflowError: the CLI's "unexpected" exit 1) for
    # `dpclip account --aux quantile --aux-sigma 1e-300`
    with pytest.raises(AccountingError) as info:
        split_noise(0.5, 0.5, aux_sigma=1e-300)
    assert "too small" in info.value.message and "far more than all of the budget" in info.value.message
    with pytest.raises(AccountingError) as info:
        check_aux_fits(0.5, [(0.5, 1e-300)])
    assert "greater than" in info.value.hint


@pytest.mark.parametrize("fraction", [0.0, 1.0, -0.1, 1.5])
def test_fraction_outside_open_unit_interval_is_refused(fraction):
    with pytest.raises(AccountingError) as info:
        split_noise(1.0, 0.5, aux_fraction=fraction)
    assert info.value.hint


def test_both_or_neither_of_sigma_and_fraction_is_refused():
    with pytest.raises(AccountingError):
        split_noise(1.0, 0.5)
    with pytest.raises(AccountingError):
        split_noise(1.0, 0.5, aux_sigma=10.0, aux_fraction=0.1)


@pytest.mark.parametrize("sensitivity", [0.0, -1.0, math.inf])
def test_non_positive_sensitivity_is_refused(sensitivity):
    with pytest.raises(AccountingError):
        split_noise(1.0, sensitivity, aux_fraction=0.1)


def test_gradient_only_split_is_trivial():
    split = NoiseSplit.gradient_only(1.3)
    assert (split.gradient_noise_multiplier, split.sigma_aux, split.aux_fraction, split.inflation) == (1.3, None, 0.0, 1.0)


def test_a_recipes_statistic_too_noisy_for_the_budget_is_named_by_its_recipe_field():
    """A recipe's sigma_hist (or the quantile's sigma) below Δ·σ was named "aux_sigma", the Python
    API's argument (rev45): the refusal names the field the recipe gives and budget_fraction."""
    from dpclip.engine.policies import policy_spec

    aux = policy_spec("dcsgd-p")(kind="dcsgd-p", sigma_hist=0.5).statistic(1)
    with pytest.raises(AccountingError, match=r"clipping\.threshold\.sigma_hist = 0\.5 is too small") as info:
        split_noise(1.0, aux.sensitivity, aux_sigma=aux.sigma, sigma_name=aux.sigma_name)
    assert "budget_fraction" in info.value.hint and "aux_sigma" not in info.value.hint
    with pytest.raises(AccountingError, match="aux_sigma = 0.5 is too small"):   # the API's own name stays
        split_noise(1.0, 1.0, aux_sigma=0.5)
