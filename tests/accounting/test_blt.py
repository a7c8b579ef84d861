"""BLT's accounting (docs/formulas.md, "BLT"): the whole run is one Gaussian mechanism of
multiplier σ/s, charged one participation at a time as Gaussians that compose to exactly it;
checked against dp_accounting called directly. The squared prefix sensitivities are plain
numbers here (the engine's tests check how they are computed)."""

from __future__ import annotations

import math

import dp_accounting
import pytest
from dp_accounting.pld import pld_privacy_accountant
from dp_accounting.rdp import rdp_privacy_accountant

from dpclip.accounting import AuxSpec, Ledger, PrivacyPlan, solve, statement_from_ledger
from dpclip.accounting.accountants import RDP_ORDERS, account
from dpclip.accounting.blt import blt_groups
from dpclip.errors import AccountingError

# q = 0.05: G = 20 groups; 100 steps: 5 participations. Increasing squared prefix sensitivities.
Q, STEPS, SENSITIVITIES = 0.05, 100, (1.5, 4.0, 7.5, 12.0, 17.5)


def plan(**change) -> PrivacyPlan:
    kwargs = {"sample_rate": Q, "steps": STEPS, "delta": 1e-5, "noise_multiplier": 6.0, "buffers": 2,
              "sensitivities": SENSITIVITIES, **change}
    return PrivacyPlan(**kwargs)


def test_groups_are_the_batches_of_an_epoch():
    assert [blt_groups(q) for q in (0.05, 1 / 28, 64 / 1437, 0.6, 1.0)] == [20, 28, 22, 1, 1]


def test_blt_epsilon_is_dp_accounting_on_one_gaussian_of_multiplier_sigma_over_s():
    result = solve(plan())
    whole = dp_accounting.GaussianDpEvent(6.0 / math.sqrt(SENSITIVITIES[-1]))
    # RDP of Gaussians adds exactly (α/2σ²): the composed charges are the one Gaussian.
    rdp = rdp_privacy_accountant.RdpAccountant(list(RDP_ORDERS)).compose(whole).get_epsilon(1e-5)
    assert result.epsilon_rdp == pytest.approx(rdp, rel=1e-9)
    # PLD: dp_accounting directly on the ledger's composition, at dpclip's stated discretisation ...
    interval = account(result.total_event, 1e-5, "pld").pld_interval
    direct = pld_privacy_accountant.PLDAccountant(value_discretization_interval=interval).compose(result.total_event)
    assert result.epsilon == pytest.approx(direct.get_epsilon(1e-5), rel=1e-12)
    # ... and within its (pessimistic) discretisation of the single Gaussian's exact ε.
    single = pld_privacy_accountant.PLDAccountant(value_discretization_interval=1e-5).compose(whole).get_epsilon(1e-5)
    assert single <= result.epsilon <= single * 1.01


def test_the_charges_are_the_increments_of_the_squared_sensitivity():
    result = solve(plan())
    charged = [step for step in range(STEPS) if result.charged_at(step)]
    assert charged == [0, 20, 40, 60, 80]
    events = [result.event_at(step) for step in charged]
    previous = 0.0
    for event, squared in zip(events, SENSITIVITIES):
        assert isinstance(event, dp_accounting.GaussianDpEvent)
        assert event.noise_multiplier == pytest.approx(6.0 / math.sqrt(squared - previous), rel=1e-14)
        previous = squared
    assert isinstance(result.event_at(1), dp_accounting.NoOpDpEvent)
    # After j + 1 cycles the charges so far are exactly the Gaussian of the first j + 1 cycles.
    for j in range(len(SENSITIVITIES)):
        so_far = dp_accounting.ComposedDpEvent(list(events[:j + 1]))
        rdp = rdp_privacy_accountant.RdpAccountant(list(RDP_ORDERS)).compose(so_far).get_epsilon(1e-5)
        gaussian = dp_accounting.GaussianDpEvent(6.0 / math.sqrt(SENSITIVITIES[j]))
        assert rdp == pytest.approx(
            rdp_privacy_accountant.RdpAccountant(list(RDP_ORDERS)).compose(gaussian).get_epsilon(1e-5), rel=1e-9)


def test_calibration_reaches_the_target_on_the_charges():
    result = solve(plan(noise_multiplier=None, target_epsilon=4.0))
    assert 4.0 * 0.99 <= result.epsilon <= 4.0
    again = solve(plan(noise_multiplier=result.split.noise_multiplier))
    assert again.epsilon == result.epsilon


def test_a_statistic_of_fixed_noise_calibrates_to_a_target_only_a_sigma_below_its_cap_reaches():
    # DC-SGD's histogram, σ_a = 8, Δ = 1: only σ_eff < 8 splits. ε = 1.2 needs σ_eff ≈ 7.4, and the
    # search over σ_eff used to probe 2s ≈ 8.4 on its way there and refuse the plan. One Gaussian:
    # 1/μ² = s²/σ_g² + K·(Δ/σ_a)², checked with dp_accounting directly.
    histogram = AuxSpec("norm histogram", sensitivity=1.0, groups=1, sigma=8.0)
    result = solve(plan(noise_multiplier=None, target_epsilon=1.2, aux=histogram))
    split = result.split
    assert split.noise_multiplier < 8.0 and split.sigma_aux == 8.0
    mu = (SENSITIVITIES[-1] / split.gradient_noise_multiplier ** 2 + len(SENSITIVITIES) / 64) ** -0.5
    direct = pld_privacy_accountant.PLDAccountant(value_discretization_interval=1e-4).compose(
        dp_accounting.GaussianDpEvent(mu)).get_epsilon(1e-5)
    assert 1.2 * 0.99 <= result.epsilon <= 1.2 and direct == pytest.approx(result.epsilon, rel=1e-3)


def test_the_engine_reports_its_group_rate_not_an_amplified_event():
    result = solve(plan())
    assert result.step_event == dp_accounting.GaussianDpEvent(6.0)   # q·G = 1: the whole group
    odd = solve(plan(sample_rate=0.045, steps=90, sensitivities=(1.0, 2.0, 3.0, 4.0, 5.0)))  # G = 22, q·G = 0.99
    assert odd.step_event == dp_accounting.PoissonSampledDpEvent(0.045 * 22, dp_accounting.GaussianDpEvent(6.0))


def test_the_statement_says_no_amplification_and_the_sensitivity():
    lines = solve(plan()).statement.lines()
    line = next(line for line in lines if line.startswith("mechanism: BLT"))
    assert "2 buffers" in line and "no amplification by sampling" in line and "20 steps apart" in line
    assert f"sensitivity {math.sqrt(17.5):.4f}"[:16] in line
    assert any("the cyclic groups drawn privately, independently for each" in line for line in lines)


def test_with_a_statistic_the_statement_names_the_gradients_multiplier_not_sigma_eff_over_s():
    # σ_eff/s is no mechanism's multiplier here: the run charges Σ_j Δs_j²/σ_g² + K·(Δ_a/σ_a)², and a
    # Gaussian of multiplier σ_eff/s would give a larger ε than the one stated above it.
    quantile = AuxSpec("quantile counts", sensitivity=0.5, groups=1, fraction=0.3)
    result = solve(plan(aux=quantile))
    line = next(line for line in result.statement.lines() if line.startswith("mechanism: BLT"))
    whole = math.sqrt(SENSITIVITIES[-1])
    assert f"σ_g/sensitivity = {result.split.gradient_noise_multiplier / whole:.6g}" in line
    assert f"{result.split.noise_multiplier / whole:.6g}" not in line
    plain = next(line for line in solve(plan()).statement.lines() if line.startswith("mechanism: BLT"))
    assert f"multiplier σ/sensitivity = {6.0 / whole:.6g}," in plain


@pytest.mark.parametrize("change, message", [
    ({"sensitivities": (1.0, 2.0)}, "one sensitivity per participation"),
    ({"sensitivities": (1.0, 2.0, 2.0, 3.0, 4.0)}, "increasing"),
    ({"sensitivities": (0.0, 2.0, 3.0, 4.0, 5.0)}, "positive"),
    ({"bands": 2}, "not both"),
    ({"sampling": "shuffle"}, "needs cyclic Poisson sampling"),
])
def test_blt_plans_that_cannot_be_accounted_are_refused_with_a_hint(change, message):
    with pytest.raises(AccountingError, match=message) as caught:
        plan(**change)
    assert caught.value.hint


def test_a_target_only_pld_reaches_is_calibrated_not_called_unreachable():
    # Histogram σ_a = 8, K = 5: however large σ_g, the statistic alone is a Gaussian of 1/μ² = 5/64, whose
    # ε at δ = 1e-5 is about 1.047 under PLD and 1.143 under RDP. ε = 1.1 lies between the two floors:
    # the RDP search, which runs first, found it unreachable and the plan was refused.
    histogram = AuxSpec("norm histogram", sensitivity=1.0, groups=1, sigma=8.0)
    result = solve(plan(noise_multiplier=None, target_epsilon=1.1, aux=histogram))
    mu = (SENSITIVITIES[-1] / result.split.gradient_noise_multiplier ** 2 + len(SENSITIVITIES) / 64) ** -0.5
    direct = pld_privacy_accountant.PLDAccountant(value_discretization_interval=1e-4).compose(
        dp_accounting.GaussianDpEvent(mu)).get_epsilon(1e-5)
    assert 1.1 * 0.99 <= result.epsilon <= 1.1 and direct == pytest.approx(result.epsilon, rel=1e-3)
    with pytest.raises(AccountingError, match=r"unreachable.*ε = 1\.1"):   # RDP alone cannot: refused as before
        solve(plan(noise_multiplier=None, target_epsilon=1.1, aux=histogram, accountant="rdp"))
    with pytest.raises(AccountingError, match=r"unreachable.*gives ε = 1\.04"):  # below PLD's floor: PLD's ε named
        solve(plan(noise_multiplier=None, target_epsilon=1.0, aux=histogram))


@pytest.mark.parametrize("aux", [None, AuxSpec("quantile counts", sensitivity=0.5, groups=1, fraction=0.3)])
def test_a_run_stopped_early_states_the_sensitivity_of_the_participations_it_made(aux):
    # A 100-step plan (5 participations) stopped after 45 steps has made 3: its ledger charges the first
    # three increments, a Gaussian of sensitivity s_3 = √7.5. The statement named the whole plan's s = √17.5
    # and the multiplier σ/√17.5, from which a reader recomputes a larger ε than the one stated.
    result = solve(plan(aux=aux))
    ledger = Ledger(1e-5, "pld")
    for step in range(45):
        ledger.record(result.event_at(step), metadata=result.step_metadata)
    statement = statement_from_ledger(ledger)
    assert statement.sensitivity == pytest.approx(math.sqrt(7.5), rel=1e-9)
    line = next(line for line in statement.lines() if line.startswith("mechanism: BLT"))
    gradient = result.split.gradient_noise_multiplier
    assert f"sensitivity {math.sqrt(7.5):.6g} per unit clip norm" in line and "at most 3 participations" in line
    assert f"/sensitivity = {gradient / math.sqrt(7.5):.6g}" in line   # σ/s, or σ_g/s with a statistic
    aux_ratio_sq = 0.0 if aux is None else (result.split.aux_sensitivity / result.split.sigma_aux) ** 2
    mu = (7.5 / gradient ** 2 + 3 * aux_ratio_sq) ** -0.5    # the stated multiplier gives the stated ε
    direct = pld_privacy_accountant.PLDAccountant(value_discretization_interval=1e-4).compose(
        dp_accounting.GaussianDpEvent(mu)).get_epsilon(1e-5)
    assert direct == pytest.approx(statement.epsilon, rel=1e-3)
    whole = statement_from_ledger(_completed(result))
    assert whole.sensitivity == result.statement.sensitivity == math.sqrt(SENSITIVITIES[-1])  # the plan's, to the bit


def _completed(result) -> Ledger:
    ledger = Ledger(1e-5, "pld")
    for step in range(STEPS):
        ledger.record(result.event_at(step), metadata=result.step_metadata)
    return ledger


def test_a_target_a_statistic_of_fixed_noise_alone_spends_says_to_raise_its_noise_or_share_the_budget():
    # σ_a = 8, K = 5: whatever σ_g, the histogram alone costs ε ≈ 1.05 (PLD), so ε = 1 is unreachable; the
    # hint said to raise ε or δ or train fewer steps, and not that the statistic's own noise is the cause.
    histogram = AuxSpec("norm histogram", sensitivity=1.0, groups=1, sigma=8.0)
    with pytest.raises(AccountingError, match="unreachable") as info:
        solve(plan(noise_multiplier=None, target_epsilon=1.0, aux=histogram))
    assert "sigma_hist" in info.value.hint and "budget_fraction" in info.value.hint and "8" in info.value.hint
