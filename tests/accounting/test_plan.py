"""The privacy plan: the one event builder shared by `dpclip account` and training."""

from __future__ import annotations

import logging
import random

import dp_accounting
import pytest
from dp_accounting.rdp import rdp_privacy_accountant

from dpclip.accounting import (
    RDP_ORDERS,
    SHUFFLE_CAVEAT,
    AuxSpec,
    Ledger,
    PrivacyPlan,
    joint_noise_multiplier,
    solve,
    steps_for_epochs,
)
from dpclip.errors import AccountingError


def test_steps_for_epochs_is_ceiling_of_epochs_over_rate():
    assert steps_for_epochs(90, 0.04) == 2250  # 90 / 0.04 is 2250.0000000000005 in floating point
    assert steps_for_epochs(60, 256 / 60000) == 14063  # 14062.5 -> 14063
    assert steps_for_epochs(1, 1.0) == 1


@pytest.mark.parametrize("accountant", ["rdp", "pld"])
def test_plan_with_target_returns_epsilon_below_target_within_one_percent(accountant):
    result = solve(PrivacyPlan(sample_rate=0.01, steps=3000, delta=1e-5, accountant=accountant, target_epsilon=4.0))
    assert 0.99 * 4.0 <= result.epsilon <= 4.0
    assert result.accountant == accountant and result.fallback_reason is None


def test_plan_step_event_is_poisson_sampled_gaussian_of_the_total_sigma():
    result = solve(PrivacyPlan(sample_rate=0.02, steps=100, delta=1e-5, noise_multiplier=1.3))
    assert result.step_event == dp_accounting.PoissonSampledDpEvent(0.02, dp_accounting.GaussianDpEvent(1.3))
    assert result.total_event == dp_accounting.SelfComposedDpEvent(result.step_event, 100)


def test_plan_epsilon_with_rdp_equals_dp_accounting_called_directly():
    rng = random.Random(3)
    for _ in range(3):
        q, sigma, steps = 10 ** rng.uniform(-3, -1), rng.uniform(0.6, 3), rng.randint(1, 5000)
        result = solve(PrivacyPlan(sample_rate=q, steps=steps, delta=1e-6, accountant="rdp", noise_multiplier=sigma))
        event = dp_accounting.SelfComposedDpEvent(
            dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), steps
        )
        direct = rdp_privacy_accountant.RdpAccountant(list(RDP_ORDERS)).compose(event).get_epsilon(1e-6)
        assert result.epsilon == direct


def test_plan_with_aux_total_sigma_is_the_joint_of_gradient_and_aux():
    aux = AuxSpec("quantile counts", 1.0, groups=4, fraction=0.05)
    result = solve(PrivacyPlan(sample_rate=0.004, steps=5000, delta=1e-5, target_epsilon=3.0, aux=aux))
    split = result.split
    assert split.noise_multiplier == result.step_event.event.noise_multiplier
    assert joint_noise_multiplier(split.gradient_noise_multiplier, [(aux.sensitivity, split.sigma_aux)]) == pytest.approx(
        split.noise_multiplier, rel=1e-12
    )
    assert split.gradient_noise_multiplier > split.noise_multiplier


@pytest.mark.parametrize(
    "aux", [AuxSpec("quantile counts", 1.0, groups=4, fraction=0.1), AuxSpec("norm histogram", 1.0, groups=1, sigma=10.0)]
)
def test_adding_an_aux_statistic_at_fixed_total_sigma_leaves_epsilon_unchanged(aux):
    base = PrivacyPlan(sample_rate=0.01, steps=1000, delta=1e-5, noise_multiplier=1.2)
    plain = solve(base)
    with_aux = solve(PrivacyPlan(sample_rate=0.01, steps=1000, delta=1e-5, noise_multiplier=1.2, aux=aux))
    assert with_aux.epsilon == plain.epsilon
    assert with_aux.step_event == plain.step_event
    assert with_aux.split.gradient_noise_multiplier > plain.split.gradient_noise_multiplier
    assert len(with_aux.statement.releases) == 2


def test_plan_and_training_ledger_agree_on_epsilon():
    result = solve(PrivacyPlan(sample_rate=0.01, steps=2000, delta=1e-5, target_epsilon=3.0,
                               aux=AuxSpec("norm histogram", 1.0, sigma=10.0)))
    ledger = Ledger(1e-5, "pld")
    for _ in range(2000):
        ledger.record(result.step_event, metadata=result.step_metadata)
    assert ledger.composed_event() == result.total_event
    assert ledger.epsilon() == result.epsilon


def test_plan_statement_carries_the_shuffle_caveat_and_the_releases():
    result = solve(PrivacyPlan(sample_rate=0.01, steps=100, delta=1e-5, noise_multiplier=1.0, sampling="shuffle",
                               aux=AuxSpec("quantile counts", 1.0, groups=4, fraction=0.01)))
    assert SHUFFLE_CAVEAT in result.statement.caveats
    assert result.statement.releases == ["gradient (sensitivity 1 after clipping)",
                                         "quantile counts (K=4, sensitivity 1.0)"]
    assert result.statement.epsilon == result.epsilon
    assert result.statement.epsilon_rdp == result.epsilon_rdp


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(),  # neither target nor noise
        dict(target_epsilon=3.0, noise_multiplier=1.0),
        dict(noise_multiplier=0.0),
        dict(target_epsilon=-1.0),
        dict(noise_multiplier=1.0, sampling="sequential"),
        dict(noise_multiplier=1.0, accountant="prv"),
        dict(noise_multiplier=True),   # a bool is not σ = 1
        dict(target_epsilon=True),
    ],
)
def test_invalid_plan_is_refused_with_an_accounting_error(kwargs):
    with pytest.raises(AccountingError) as info:
        PrivacyPlan(sample_rate=0.01, steps=100, delta=1e-5, **kwargs)
    assert info.value.hint


def test_impossible_aux_split_is_refused_by_solve():
    with pytest.raises(AccountingError) as info:
        solve(PrivacyPlan(sample_rate=0.01, steps=100, delta=1e-5, noise_multiplier=2.0,
                          aux=AuxSpec("norm histogram", 1.0, sigma=1.5)))
    assert "greater than" in info.value.hint


@pytest.mark.parametrize("kwargs", [dict(name="", sensitivity=1.0, fraction=0.1),
                                    dict(name="counts", sensitivity=0.0, fraction=0.1),
                                    dict(name="counts", sensitivity=float("inf"), fraction=0.1),
                                    dict(name="counts", sensitivity=1.0),
                                    dict(name="counts", sensitivity=1.0, sigma=1.0, fraction=0.1),
                                    dict(name="counts", sensitivity=1.0, groups=0, fraction=0.1)])
def test_invalid_aux_spec_is_refused(kwargs):
    with pytest.raises(AccountingError):
        AuxSpec(**kwargs)


def test_a_pld_plan_over_more_steps_than_it_answers_quickly_says_so_once(monkeypatch, caplog):
    import dpclip.accounting.accountants as accountants

    # the real threshold is 10⁶ steps, whose PLD takes seconds to minutes: lowered to keep this fast
    monkeypatch.setattr(accountants, "PLD_SLOW_STEPS", 50)
    monkeypatch.setattr(accountants, "_warned_slow", set())
    caplog.set_level(logging.WARNING, logger="dpclip")
    solve(PrivacyPlan(sample_rate=0.01, steps=50, delta=1e-5, noise_multiplier=1.0))
    solve(PrivacyPlan(sample_rate=0.01, steps=51, delta=1e-5, noise_multiplier=1.0, accountant="rdp"))
    assert not caplog.records, "at the threshold, and with RDP, nothing to say"
    for _ in range(2):
        solve(PrivacyPlan(sample_rate=0.01, steps=51, delta=1e-5, noise_multiplier=1.0))
    notes = [r.getMessage() for r in caplog.records]
    assert len(notes) == 1 and "PLD accounting of 51 steps" in notes[0] and "accountant: rdp" in notes[0]
