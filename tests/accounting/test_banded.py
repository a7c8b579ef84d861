"""Banded matrix factorization's accounting (docs/formulas.md, "Banded matrix factorization"):
⌈T/b⌉ participations of PoissonSampled(q·b, Gaussian(σ)), checked against dp_accounting called
directly; b = 1 is DP-SGD to the digit; what cannot be cut into b groups is refused."""

from __future__ import annotations

import math

import dp_accounting
import pytest
from dp_accounting.pld import pld_privacy_accountant
from dp_accounting.rdp import rdp_privacy_accountant

from dpclip.accounting import PrivacyPlan, participations, solve
from dpclip.accounting.accountants import RDP_ORDERS, account
from dpclip.errors import AccountingError


def test_one_band_is_dp_sgd_to_the_digit():
    for sigma in (0.7, 1.3):
        plain = solve(PrivacyPlan(sample_rate=0.01, steps=500, delta=1e-5, noise_multiplier=sigma))
        banded = solve(PrivacyPlan(sample_rate=0.01, steps=500, delta=1e-5, noise_multiplier=sigma, bands=1))
        assert banded.epsilon == plain.epsilon and banded.epsilon_rdp == plain.epsilon_rdp
        assert banded.step_event == plain.step_event and banded.total_event == plain.total_event
        assert "mechanism:" not in "\n".join(banded.statement.lines())


@pytest.mark.parametrize("bands, steps", [(4, 400), (8, 1000), (7, 300)])
def test_banded_epsilon_is_dp_accounting_on_the_participations(bands, steps):
    q, sigma, delta = 0.01, 1.0, 1e-5
    result = solve(PrivacyPlan(sample_rate=q, steps=steps, delta=delta, noise_multiplier=sigma, bands=bands))
    event = dp_accounting.PoissonSampledDpEvent(q * bands, dp_accounting.GaussianDpEvent(sigma))
    composed = dp_accounting.SelfComposedDpEvent(event, math.ceil(steps / bands))
    assert result.total_event == composed
    interval = account(composed, delta, "pld").pld_interval   # dpclip's discretisation, stated in the result
    direct = pld_privacy_accountant.PLDAccountant(value_discretization_interval=interval).compose(composed)
    assert result.epsilon == pytest.approx(direct.get_epsilon(delta), rel=1e-12)
    rdp = rdp_privacy_accountant.RdpAccountant(list(RDP_ORDERS)).compose(composed).get_epsilon(delta)
    assert result.epsilon_rdp == pytest.approx(rdp, rel=1e-12)


def test_calibration_under_bands_reaches_the_target_on_the_participations():
    result = solve(PrivacyPlan(sample_rate=0.01, steps=1000, delta=1e-5, target_epsilon=4.0, bands=8))
    assert 4.0 * 0.99 <= result.epsilon <= 4.0
    check = solve(PrivacyPlan(sample_rate=0.01, steps=1000, delta=1e-5, noise_multiplier=result.split.noise_multiplier,
                              bands=8))
    assert check.epsilon == result.epsilon


def test_the_ledger_is_charged_once_a_cycle():
    result = solve(PrivacyPlan(sample_rate=0.01, steps=10, delta=1e-5, noise_multiplier=1.0, bands=4))
    assert [step for step in range(10) if result.charged_at(step)] == [0, 4, 8]
    assert [result.charges(done) for done in (0, 1, 4, 5, 10)] == [0, 1, 1, 2, 3] == \
        [participations(done, 4) for done in (0, 1, 4, 5, 10)]


def test_the_statement_names_the_mechanism_and_its_participations():
    lines = solve(PrivacyPlan(sample_rate=0.01, steps=1000, delta=1e-5, noise_multiplier=1.0, bands=8)).statement.lines()
    line = next(line for line in lines if line.startswith("mechanism:"))
    assert "8 bands" in line and "125 participations" in line and "q·b = 0.08" in line


@pytest.mark.parametrize("change, message", [
    ({"bands": 0}, "bands must be a whole number from 1"),
    ({"bands": 11}, "bands must be a whole number from 1"),
    ({"bands": 2.0}, "bands must be a whole number from 1"),
    ({"bands": 5, "sample_rate": 0.3}, "fewer than the expected batch"),
    ({"bands": 2, "sampling": "shuffle"}, "needs cyclic Poisson sampling"),
])
def test_bands_that_cannot_be_run_are_refused_with_a_hint(change, message):
    kwargs = {"sample_rate": 0.01, "steps": 10, "delta": 1e-5, "noise_multiplier": 1.0, **change}
    with pytest.raises(AccountingError, match=message) as caught:
        PrivacyPlan(**kwargs)
    assert caught.value.hint
