"""The BLT mechanism (dpclip/engine/blt.py): C's coefficients are the power series of the
rational function, the streamed noise is C⁻¹z with covariance C⁻¹C⁻ᵀ, the sensitivity of the
worst participation pattern is recomputed by brute force over every pattern, the optimiser
beats DP-SGD and never gets worse with more buffers, and the stream resumes bit for bit.

The references here never use the module's partial fractions: C comes from dividing the two
polynomials term by term, C⁻¹ from a dense triangular solve.
"""

from __future__ import annotations

import io
import itertools

import pytest
import torch

from dpclip.engine.blt import (BltStrategy, BufferedNoise, blt_strategy, check_monotone, noise_streamer,
                               participation_sensitivities)
from dpclip.engine.correlated import CorrelatedNoise
from dpclip.errors import EngineError

F64 = torch.float64


def series_by_division(theta, theta_hat, n: int) -> torch.Tensor:
    """The first n coefficients of Π(1 − θ̂_j x) / Π(1 − θ_j x), by long division of the
    numerator's coefficients by the denominator's (q_0 = 1): c_m = p_m − Σ_{i>=1} q_i c_{m−i}."""
    def poly(roots):
        coefficients = [1.0]
        for r in roots:  # multiply by (1 − r x)
            coefficients = [a - r * b for a, b in zip(coefficients + [0.0], [0.0] + coefficients)]
        return coefficients
    p, q = poly(theta_hat), poly(theta)
    c = []
    for m in range(n):
        value = p[m] if m < len(p) else 0.0
        value -= sum(q[i] * c[m - i] for i in range(1, min(m, len(q) - 1) + 1))
        c.append(value)
    return torch.tensor(c, dtype=F64)


def dense_toeplitz(c: torch.Tensor) -> torch.Tensor:
    n = c.numel()
    out = torch.zeros(n, n, dtype=F64)
    for t in range(n):
        for s in range(t + 1):
            out[t, s] = c[t - s]
    return out


def stream(strategy: BltStrategy, z: torch.Tensor) -> torch.Tensor:
    """BufferedNoise over z's rows (steps), each row split into two 'parameters'."""
    from tests.engine.test_correlated import run_stream
    return run_stream(BufferedNoise(strategy), z)


@pytest.mark.parametrize("buffers", [1, 2, 3])
def test_coefficients_are_the_power_series_of_the_rational_generating_function(buffers):
    strategy = blt_strategy(buffers, 60, 7)
    expected = series_by_division(strategy.theta, strategy.theta_hat, 40)
    torch.testing.assert_close(strategy.coefficients(40), expected, rtol=1e-10, atol=1e-12)
    inverse = series_by_division(strategy.theta_hat, strategy.theta, 40)   # C⁻¹(x) = 1 / C(x)
    torch.testing.assert_close(strategy.inverse_coefficients(40), inverse, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("buffers", [1, 2, 4])
def test_streamed_noise_equals_the_dense_inverse_strategy_times_z(buffers):
    steps = 30
    strategy = blt_strategy(buffers, steps, 5)
    z = torch.randn(steps, 10, dtype=F64, generator=torch.Generator().manual_seed(3))
    c = series_by_division(strategy.theta, strategy.theta_hat, steps)
    expected = torch.linalg.solve_triangular(dense_toeplitz(c), z, upper=False)
    torch.testing.assert_close(stream(strategy, z), expected, rtol=0, atol=1e-10)


def test_streamed_noise_covariance_across_steps_is_inverse_c_times_its_transpose():
    # 20,000 independent coordinates, 6 steps: the empirical covariance of each pair of steps
    # has standard error sqrt((Σ_ss Σ_tt + Σ_st²) / n) <= sqrt(2 max Σ_tt² / n); 5 standard
    # errors make a false failure about 1 in 10^6 per entry.
    steps, coordinates = 6, 20_000
    strategy = blt_strategy(2, steps, 2)
    z = torch.randn(steps, coordinates, dtype=F64, generator=torch.Generator().manual_seed(5))
    noise = BufferedNoise(strategy)
    rows = []
    for row in z:
        fresh = [row.clone()]
        noise.correlate_(fresh)
        rows.append(fresh[0])
    w = torch.stack(rows)
    empirical = w @ w.T / coordinates
    c = series_by_division(strategy.theta, strategy.theta_hat, steps)
    inverse = torch.linalg.inv(dense_toeplitz(c))
    expected = inverse @ inverse.T
    bound = 5 * (2 * expected.diagonal().max() ** 2 / coordinates) ** 0.5
    assert (empirical - expected).abs().max() < bound
    assert expected[1, 0].abs() > 2 * bound   # the steps really are correlated: the test can see it


def brute_force_sensitivity(c: torch.Tensor, groups: int, participations: int) -> float:
    """max over every participation set P (members >= G apart, at most K of them) of
    1_Pᵀ CᵀC 1_P. With C >= 0 entrywise, ||Σ_{s∈P} C[:, s] x_s||² = Σ_{s,s'} (CᵀC)_{ss'}⟨x_s, x_s'⟩
    is largest with every unit contribution x_s the same vector, so 0/1 patterns are the worst."""
    n = c.numel()
    gram = dense_toeplitz(c).T @ dense_toeplitz(c)
    best = 0.0
    for size in range(1, participations + 1):
        for pattern in itertools.combinations(range(n), size):
            if any(b - a < groups for a, b in zip(pattern, pattern[1:])):
                continue
            index = torch.tensor(pattern)
            best = max(best, float(gram[index][:, index].sum()))
    return best


@pytest.mark.parametrize("buffers, steps, groups", [(1, 12, 3), (2, 13, 4), (3, 11, 2)])
def test_sensitivity_of_every_prefix_is_the_brute_force_worst_pattern(buffers, steps, groups):
    strategy = blt_strategy(buffers, steps, groups)
    found = participation_sensitivities(strategy, steps, groups)
    c = series_by_division(strategy.theta, strategy.theta_hat, steps)
    participations = -(-steps // groups)
    assert len(found) == participations
    for j, value in enumerate(found):
        rows = min((j + 1) * groups, steps)
        expected = brute_force_sensitivity(c[:rows], groups, j + 1)
        assert value == pytest.approx(expected, rel=1e-10)


def test_participations_closer_than_the_groups_would_cost_more():
    # The accounting's premise: the same strategy with participations 1 step apart is more sensitive.
    strategy = blt_strategy(2, 12, 4)
    c = strategy.coefficients(12)
    assert brute_force_sensitivity(c, 1, 3) > participation_sensitivities(strategy, 12, 4)[-1] * 1.05


def scale_free_loss(c: torch.Tensor, steps: int, groups: int) -> float:
    """‖A C⁻¹‖_F² · (worst-pattern sensitivity)², densely."""
    a = torch.tril(torch.ones(steps, steps, dtype=F64))
    error = float((a @ torch.linalg.inv(dense_toeplitz(c))).square().sum())
    return error * participation_sensitivity_dense(c, groups)


def participation_sensitivity_dense(c: torch.Tensor, groups: int) -> float:
    dense = dense_toeplitz(c)
    return float(dense[:, ::groups].sum(dim=1).square().sum())


def test_optimised_strategy_beats_independent_noise_and_more_buffers_never_hurt():
    steps, groups = 120, 10
    identity = torch.zeros(steps, dtype=F64)
    identity[0] = 1.0
    dp_sgd = scale_free_loss(identity, steps, groups)
    losses = [scale_free_loss(blt_strategy(k, steps, groups).coefficients(steps), steps, groups) for k in (1, 2, 3)]
    assert losses[0] < 0.5 * dp_sgd
    assert losses[1] <= losses[0] * (1 + 1e-9) and losses[2] <= losses[1] * (1 + 1e-9)


def test_strategy_is_deterministic_and_its_poles_interlace():
    blt_strategy.cache_clear()
    first = blt_strategy(3, 200, 9)
    blt_strategy.cache_clear()
    again = blt_strategy(3, 200, 9)
    assert first == again
    ordered = [v for pair in zip(first.theta_hat, first.theta) for v in pair]
    assert 0 < ordered[0] and all(a < b for a, b in zip(ordered, ordered[1:])) and ordered[-1] < 1


def test_a_strategy_with_negative_coefficients_is_refused():
    crossed = BltStrategy(theta=(0.2,), theta_hat=(0.6,))   # ω = θ − θ̂ < 0: c_1 < 0
    with pytest.raises(EngineError, match="positive and non-increasing"):
        participation_sensitivities(crossed, 10, 2)
    with pytest.raises(EngineError):
        check_monotone(torch.tensor([1.0, 0.5, 0.6], dtype=F64))


@pytest.mark.parametrize("buffers, steps, groups", [(0, 10, 2), (9, 10, 2), (2, 0, 2), (2, 10, 0), (True, 10, 2)])
def test_bad_buffers_steps_or_groups_are_refused_with_a_hint(buffers, steps, groups):
    with pytest.raises(EngineError) as caught:
        blt_strategy(buffers, steps, groups)
    assert caught.value.hint


def test_noise_resumed_from_its_state_continues_bit_identically():
    strategy = blt_strategy(3, 40, 4)
    z = torch.randn(12, 10, dtype=torch.float32, generator=torch.Generator().manual_seed(9))
    straight = stream(strategy, z)
    noise = BufferedNoise(strategy)
    for row in z[:5]:
        noise.correlate_([row[:6].clone().reshape(2, 3), row[6:].clone()])
    saved = io.BytesIO()
    torch.save(noise.state_dict(), saved)
    saved.seek(0)
    resumed = BufferedNoise(strategy)
    resumed.load_state_dict(torch.load(saved))
    rows = []
    for row in z[5:]:
        fresh = [row[:6].clone().reshape(2, 3), row[6:].clone()]
        resumed.correlate_(fresh)
        rows.append(torch.cat([fresh[0].reshape(-1), fresh[1]]))
    assert torch.equal(torch.stack(rows), straight[5:])


def test_resuming_with_another_strategy_or_parameter_list_is_refused():
    noise = BufferedNoise(blt_strategy(2, 40, 4))
    noise.correlate_([torch.zeros(3)])
    with pytest.raises(EngineError, match="differs"):
        BufferedNoise(blt_strategy(2, 40, 5)).load_state_dict(noise.state_dict())
    with pytest.raises(EngineError, match="tensors"):
        noise.correlate_([torch.zeros(3), torch.zeros(2)])


def test_the_streamer_follows_the_strategy_kind():
    assert isinstance(noise_streamer(blt_strategy(1, 10, 2)), BufferedNoise)
    assert isinstance(noise_streamer(torch.tensor([0.8, 0.6], dtype=F64)), CorrelatedNoise)
    assert noise_streamer(torch.tensor([1.0], dtype=F64)) is None and noise_streamer(None) is None


def test_a_blt_optimised_for_momentum_is_no_worse_on_momentum_than_the_prefix_sum_one():
    from dpclip.engine.workload import Workload

    steps, groups, momentum = 120, 10, Workload(0.9)
    aware, plain = blt_strategy(2, steps, groups, momentum), blt_strategy(2, steps, groups)
    assert aware != plain

    def loss(strategy):  # dense, with the momentum's running sum simulated as in test_correlated
        from tests.engine.test_correlated import dense_momentum_error
        c = strategy.coefficients(steps)
        # dense_momentum_error takes banded coefficients: C⁻¹ over all n steps needs all of c
        return dense_momentum_error(c, steps, 0.9, False) * participation_sensitivity_dense(c, groups)

    assert loss(aware) < loss(plain)
