"""ε and δ from the RDP and PLD accountants: reference numbers, agreement, fallback."""

from __future__ import annotations

import math
import random
import time

import dp_accounting
import pytest
from dp_accounting import dp_event
from dp_accounting.pld import pld_privacy_accountant
from dp_accounting.rdp import rdp_privacy_accountant

import dpclip.accounting.accountants as accountants_module
from dpclip.accounting import (
    RDP_ORDERS,
    account,
    delta_for_epsilon,
    epsilon,
    rdp_curve,
    steps_for_epochs,
    training_event,
)
from dpclip.errors import AccountingError

# Opacus' RDP orders (docs/accounting.md): [1 + x/10 for x in 1..99] + 12..63.
OPACUS_ORDERS = [1 + x / 10.0 for x in range(1, 100)] + list(range(12, 64))


def _rdp_direct(event, delta, orders=RDP_ORDERS):
    return rdp_privacy_accountant.RdpAccountant(list(orders)).compose(event).get_epsilon(delta)


def _pld_direct(event, delta, interval):
    accountant = pld_privacy_accountant.PLDAccountant(value_discretization_interval=interval)
    return accountant.compose(event).get_epsilon(delta)


# ------------------------------------------------------------------ RDP: orders, conversion


def test_dpclip_rdp_orders_contain_opacus_orders():
    assert set(OPACUS_ORDERS) <= set(RDP_ORDERS)


def test_dpclip_rdp_orders_are_dp_accounting_defaults_pinned():
    # dpclip writes the orders out; if a dp_accounting upgrade changes its defaults this
    # fails, so the change is a decision (and a CHANGELOG "Privacy" entry), not an accident.
    assert RDP_ORDERS == tuple(rdp_privacy_accountant.DEFAULT_RDP_ORDERS)


def test_rdp_epsilon_matches_opacus_reference_with_denser_orders():
    """docs/accounting.md: σ = 1.5, q = 0.04, 2250 steps, δ = 1e-5 -> ε = 7.32911117143 (Opacus).

    dpclip uses more orders than Opacus, so its ε can only be lower at equal RDP values;
    here both order sets pick the same order. Opacus computes the subsampled-Gaussian
    RDP with its own code, which differs from dp_accounting's by ~3e-5 relative: the
    stated tolerance is 1e-4 relative.
    """
    event = training_event(0.04, 1.5, 2250)
    ours = epsilon(event, 1e-5, "rdp")
    assert ours == _rdp_direct(event, 1e-5)
    assert ours <= _rdp_direct(event, 1e-5, OPACUS_ORDERS)
    assert ours == pytest.approx(7.32911117143, rel=1e-4)


def test_rdp_conversion_is_the_improved_balle_et_al_bound():
    """ε = min_α [rdp(α) + log((α−1)/α) − (log δ + log α)/(α − 1)]; the older bound is larger."""
    event = training_event(256 / 60000, 1.1, steps_for_epochs(60, 256 / 60000))
    delta = 1e-5
    curve = [(a, r) for a, r in rdp_curve(event) if a > 1.01]
    improved = min(r + math.log((a - 1) / a) - (math.log(delta) + math.log(a)) / (a - 1) for a, r in curve)
    older = min(r + math.log(1 / delta) / (a - 1) for a, r in curve)
    ours = epsilon(event, delta, "rdp")
    assert ours == pytest.approx(improved, rel=1e-12)
    # TF Privacy tutorial (docs/accounting.md): ≈ 2.60 with the improved conversion, 3.01 with the older one.
    assert ours == pytest.approx(2.60, abs=0.01)
    assert older == pytest.approx(3.01, abs=0.01)


def test_rdp_curve_matches_dp_accounting_published_values():
    """docs/accounting.md: q = 0.01, σ = 2.5, 50 steps at orders [1.5, 2.5, 5, 50, 100]."""
    curve = rdp_curve(training_event(0.01, 2.5, 50), [1.5, 2.5, 5, 50, 100])
    expected = [6.70579741e-4, 1.08548710e-3, 2.18075656e-3, 2.38460375e-2, 1.67416308e2]
    assert [a for a, _ in curve] == [1.5, 2.5, 5, 50, 100]
    for (_, got), want in zip(curve, expected):
        assert got == pytest.approx(want, rel=1e-7)


def test_tf_privacy_statement_poisson_epsilons():
    """docs/accounting.md: N = 10000, B = 64, σ = 2.0, 5 epochs, δ = 1e-6: RDP 1.616, PLD 1.199.

    TF Privacy's statement assumes microbatching by default, which doubles the
    sensitivity (its code halves σ); dpclip has no microbatches, so the same release
    is σ_eff = 1.0 here. TF uses the PLD grid 1e-4 and dpclip a coarser, ε-relative
    grid: tolerance 1e-3.
    """
    q = 64 / 10000
    event = training_event(q, 2.0 / 2, steps_for_epochs(5, q))
    assert epsilon(event, 1e-6, "rdp") == pytest.approx(1.616, abs=5e-4)
    result = account(event, 1e-6, "pld")
    assert result.accountant == "pld" and result.fallback_reason is None
    assert result.epsilon == pytest.approx(1.199, abs=1e-3)
    assert result.epsilon_rdp == pytest.approx(1.616, abs=5e-4)


# ------------------------------------------------------------------------------- PLD


def test_pld_epsilon_is_close_to_opacus_prv_reference():
    """docs/accounting.md: PRV gives 6.7773957 for σ = 1.5, q = 0.04, 2250 steps, δ = 1e-5.

    Opacus' PRV accountant is accurate to eps_error = 0.01, so agreement within 0.02.
    """
    result = account(training_event(0.04, 1.5, 2250), 1e-5, "pld")
    assert result.accountant == "pld"
    assert result.epsilon == pytest.approx(6.7773957, abs=0.02)
    assert result.epsilon < result.epsilon_rdp


def test_pld_delta_for_gaussian_composed_three_times():
    event = dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(math.sqrt(3)), 3)
    assert delta_for_epsilon(event, 1.0, "pld") == pytest.approx(0.126936, abs=1e-5)


def test_pld_delta_for_poisson_subsampled_gaussian_composed_three_times():
    event = training_event(0.2, 0.5, 3)
    assert delta_for_epsilon(event, 1.0, "pld") == pytest.approx(0.15594, abs=1e-4)


def test_rdp_delta_for_epsilon_matches_dp_accounting():
    event = training_event(0.02, 1.2, 700)
    direct = rdp_privacy_accountant.RdpAccountant(list(RDP_ORDERS)).compose(event).get_delta(3.0)
    assert delta_for_epsilon(event, 3.0, "rdp") == direct


def test_epsilon_agrees_with_dp_accounting_called_directly_on_random_inputs():
    rng = random.Random(20261121)
    for _ in range(6):
        q = 10 ** rng.uniform(-3, -1)
        sigma = rng.uniform(0.7, 4.0)
        steps = rng.randint(1, 3000)
        delta = 10 ** rng.uniform(-8, -4)
        event = training_event(q, sigma, steps)

        assert epsilon(event, delta, "rdp") == _rdp_direct(event, delta)

        result = account(event, delta, "pld")
        if result.fallback_reason is not None:  # only allowed when PLD is looser than RDP
            assert "looser" in result.fallback_reason
            continue
        # A 5x finer grid is a tighter pessimistic bound: ours may exceed it only by the
        # discretisation error (~1e-3 relative) and can never be meaningfully below it.
        finer = _pld_direct(event, delta, result.pld_interval / 5)
        assert result.epsilon == pytest.approx(finer, rel=2e-3)
        assert result.epsilon >= finer * (1 - 1e-6)


def test_pld_is_fast_for_ten_thousand_steps():
    start = time.perf_counter()
    result = account(training_event(0.001, 0.6, 10_000), 1e-5, "pld")
    elapsed = time.perf_counter() - start
    assert result.accountant == "pld"
    assert elapsed < 5.0  # typically ~0.2 s; generous because the machine is shared


def test_an_equal_event_is_composed_once_and_a_different_one_again(monkeypatch):
    """A run asks about one ledger many times: the composed accountants are kept by the
    event's every field, so an equal event built anew reuses them, and σ one bit apart does
    not (its ε is its own, as dp_accounting's)."""
    composed = []
    for cls in (rdp_privacy_accountant.RdpAccountant, pld_privacy_accountant.PLDAccountant):
        original = cls.compose
        monkeypatch.setattr(cls, "compose", lambda self, event, count=1, _o=original, _c=cls:
                            composed.append(_c.__name__) or _o(self, event, count))
    sigma = 1.2345678901234567
    first = account(training_event(0.013, sigma, 37), 1e-5, "pld")
    assert sorted(composed) == ["PLDAccountant", "RdpAccountant"]
    again = account(training_event(0.013, sigma, 37), 1e-5, "pld")
    assert again == first and len(composed) == 2
    assert delta_for_epsilon(training_event(0.013, sigma, 37), first.epsilon, "rdp") > 0
    assert len(composed) == 2            # δ from the same RDP accountant
    apart = math.nextafter(sigma, 2.0)
    other = account(training_event(0.013, apart, 37), 1e-5, "pld")
    assert len(composed) == 4
    assert other.epsilon == _pld_direct(training_event(0.013, apart, 37), 1e-5, other.pld_interval)
    assert other.epsilon_rdp == _rdp_direct(training_event(0.013, apart, 37), 1e-5)


@pytest.mark.slow   # a few hundred RDP accountings: thorough, and 13 s on the 2-core machine
def test_the_accountant_caches_are_bounded():
    for k in range(accountants_module._RDP_CACHE_SIZE + 5):
        account(training_event(0.01, 1.0 + k / 1000, 3), 1e-5, "rdp")
    assert len(accountants_module._RDP_CACHE) == accountants_module._RDP_CACHE_SIZE
    assert len(accountants_module._PLD_CACHE) <= accountants_module._PLD_CACHE_SIZE


# -------------------------------------------------------------------------- fallback


def test_pld_failure_falls_back_to_rdp_with_a_reason(monkeypatch):
    def broken(event, interval):
        raise MemoryError("simulated: PLD grid too large")

    monkeypatch.setattr(accountants_module, "_pld_accountant", broken)
    event = training_event(0.01, 1.0, 1000)
    result = account(event, 1e-5, "pld")
    assert result.accountant == "rdp" and result.requested == "pld"
    assert "MemoryError" in result.fallback_reason
    assert result.epsilon == _rdp_direct(event, 1e-5)


def test_pld_infinite_epsilon_at_tiny_delta_falls_back_to_rdp():
    """A genuinely hard case: dp_accounting's PLD returns ε = inf for δ = 1e-15 here."""
    event = training_event(0.01, 1.0, 1000)
    assert math.isinf(_pld_direct(event, 1e-15, 1e-4))  # the failure is real
    result = account(event, 1e-15, "pld")
    assert result.accountant == "rdp"
    assert "below 1e-09" in result.fallback_reason
    assert result.epsilon == pytest.approx(_rdp_direct(event, 1e-15), rel=1e-12)
    assert math.isfinite(result.epsilon)


def test_pld_at_a_delta_within_its_floating_point_error_falls_back_to_rdp():
    """At δ = 1e-12 dp_accounting's PLD, on the grid dpclip would use, has returned an ε below the
    true one (with the numpy and scipy of 2026-11; with later builds it lands above, so which side
    it falls on is the FFT's rounding, not a property to rely on): a lower bound of the true ε
    (exponential tilting of the privacy loss rounded down, computed independently of
    dp_accounting) is 7.941 at this δ. dpclip's ε is at least that, whatever the PLD gives."""
    event = training_event(0.004, 0.666966204280318, 2344)
    true_at_least = 7.941
    result = account(event, 1e-12, "pld")
    assert result.accountant == "rdp" and "floating-point error" in result.fallback_reason
    assert result.epsilon >= true_at_least
    assert account(event, 1e-8, "pld").accountant == "pld"       # above it, PLD as before


def test_a_pld_delta_within_its_floating_point_error_gives_way_to_rdp():
    """The same event's δ at ε = 7.941: the true δ is at least 1.010e-12 (the independent lower bound
    above); the PLD's is below 1e-12 there, so the RDP δ is returned."""
    event = training_event(0.004, 0.666966204280318, 2344)
    assert delta_for_epsilon(event, 7.941, "pld") >= 1.010e-12


def test_event_unsupported_by_pld_falls_back_to_rdp():
    run = training_event(0.01, 1.0, 100)
    event = dp_event.RepeatAndSelectDpEvent(run, 5.0, 1.0)
    result = account(event, 1e-5, "pld")
    assert result.accountant == "rdp"
    assert "RepeatAndSelectDpEvent" in result.fallback_reason
    assert result.epsilon == _rdp_direct(event, 1e-5)


def test_reported_epsilon_never_exceeds_rdp_epsilon():
    rng = random.Random(5)
    for _ in range(5):
        event = training_event(10 ** rng.uniform(-3, -0.5), rng.uniform(0.5, 5), rng.randint(1, 2000))
        delta = 10 ** rng.uniform(-14, -3)
        result = account(event, delta, "pld")
        assert result.epsilon <= result.epsilon_rdp


def test_non_private_event_has_infinite_epsilon():
    assert math.isinf(epsilon(dp_accounting.NonPrivateDpEvent(), 1e-5, "pld"))


def test_event_neither_accountant_supports_is_an_accounting_error():
    event = dp_accounting.SampledWithoutReplacementDpEvent(1000, 10, dp_accounting.GaussianDpEvent(1.0))
    with pytest.raises(AccountingError):
        epsilon(event, 1e-5, "pld")


@pytest.mark.parametrize("delta", [0.0, 1.0, -1e-5, 2.0])
def test_delta_outside_open_unit_interval_is_refused(delta):
    with pytest.raises(AccountingError) as info:
        epsilon(training_event(0.01, 1.0, 10), delta)
    assert info.value.hint


def test_unknown_accountant_is_refused():
    with pytest.raises(AccountingError) as info:
        epsilon(training_event(0.01, 1.0, 10), 1e-5, "prv")
    assert "pld" in info.value.hint


def test_a_noise_multiplier_too_large_for_the_rdp_arithmetic_is_called_too_large_not_too_small():
    # σ = 1e300 (a recipe's privacy.noise_multiplier) was refused as "a noise multiplier this small"
    with pytest.raises(AccountingError) as info:
        epsilon(dp_accounting.GaussianDpEvent(1e300), 1e-5, "rdp")
    assert "this large" in info.value.message and "this small" not in info.value.message and info.value.hint


def test_pld_over_more_steps_than_it_answers_in_reasonable_time_falls_back_to_rdp_at_once(monkeypatch):
    """10⁹ steps once ran PLD for minutes after its warning: above PLD_MAX_COMPOSITIONS, PLD is never tried
    (lowered here to 200 steps, so that the same code path runs in milliseconds)."""
    monkeypatch.setattr(accountants_module, "PLD_MAX_COMPOSITIONS", 200, raising=False)
    tried = []
    real = accountants_module._pld_accountant
    monkeypatch.setattr(accountants_module, "_pld_accountant", lambda *args: tried.append(args) or real(*args))
    event = training_event(0.01, 1.0, 201)
    result = account(event, 1e-5, "pld")
    assert result.accountant == "rdp" and result.requested == "pld" and not tried
    assert "201 composed steps are more than the 200" in result.fallback_reason
    assert result.epsilon == _rdp_direct(event, 1e-5)
    assert accountants_module.delta_for_epsilon(event, 2.0, "pld") == pytest.approx(
        float(rdp_privacy_accountant.RdpAccountant(list(RDP_ORDERS)).compose(event).get_delta(2.0)), rel=1e-12)
    assert not tried
    assert account(training_event(0.01, 1.0, 200), 1e-5, "pld").accountant == "pld" and tried  # at the cap: PLD


def test_a_pld_overflow_is_a_stated_fallback_not_a_numpy_warning_on_the_terminal():
    """σ = 0.2336 is a trial σ of calibrating ε = 64 at q = 0.01 over 10⁴ steps: dp_accounting's ε-for-δ divides by
    an underflowed mass and numpy printed "RuntimeWarning: overflow encountered in scalar divide" (with its file
    path) on `dpclip account`'s stderr, and the fallback to RDP gave a reason that was not the cause."""
    import warnings

    event = training_event(0.01, 0.2336116810832323, 10_000)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = account(event, 1e-5, "pld")
    assert not [w for w in caught if issubclass(w.category, RuntimeWarning)], [str(w.message) for w in caught]
    # the reason says what happened (it said "δ is below the probability mass it truncates", at δ = 1e-5)
    assert result.accountant == "rdp" and "overflow" in result.fallback_reason and "truncates" not in result.fallback_reason
    assert result.epsilon == _rdp_direct(event, 1e-5)
