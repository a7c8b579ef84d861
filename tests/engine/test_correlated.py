"""Banded matrix factorization noise (dpclip/engine/correlated.py): the streamed noise is
C⁻¹ z, its covariance is C⁻¹C⁻ᵀ, the strategy's sensitivity is DP-SGD's under b-separated
participation (and not without it), the fast error formula is the dense one, the optimiser
improves on its starting point, and the stream resumes bit for bit from a checkpoint.

Everything is recomputed here from dense matrices (toeplitz_strategy is a two-line gather,
checked against a hand-written C below), never from the module's recurrences.
"""

from __future__ import annotations

import io
import itertools
import math
import time

import pytest
import torch

from dpclip.engine.correlated import (CorrelatedNoise, banded_strategy, log_prefix_sum_error, prefix_sum_error,
                                      scale_free_error, square_root_coefficients, toeplitz_strategy)
from dpclip.errors import EngineError

F64 = torch.float64


def dense_c(c: torch.Tensor, n: int) -> torch.Tensor:
    """C[t, s] = c_{t-s} for 0 <= t-s < b, by explicit loops (independent of the module)."""
    out = torch.zeros(n, n, dtype=F64)
    for t in range(n):
        for s in range(max(0, t - c.numel() + 1), t + 1):
            out[t, s] = c[t - s]
    return out


def dense_error(c: torch.Tensor, n: int) -> float:
    """||A C⁻¹||_F² with A the lower-triangular ones, by a dense triangular solve."""
    a = torch.tril(torch.ones(n, n, dtype=F64))
    # A C⁻¹ = (C⁻ᵀ Aᵀ)ᵀ: solve Cᵀ X = Aᵀ (upper-triangular).
    x = torch.linalg.solve_triangular(dense_c(c, n).T, a.T, upper=True)
    return float(x.square().sum())


def stream(c: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """Run CorrelatedNoise over z's rows (steps), each row split into two 'parameters'."""
    return run_stream(CorrelatedNoise(c), z)


def run_stream(noise, z: torch.Tensor) -> torch.Tensor:
    """A noise stream (anything with correlate_) over z's rows, each split into two 'parameters'."""
    out = []
    for row in z:
        fresh = [row[:6].clone().reshape(2, 3), row[6:].clone()]
        noise.correlate_(fresh)
        out.append(torch.cat([fresh[0].reshape(-1), fresh[1]]))
    return torch.stack(out)


def test_toeplitz_strategy_is_the_banded_lower_triangular_toeplitz_matrix():
    c = torch.tensor([3.0, 2.0, 1.0], dtype=F64)
    torch.testing.assert_close(toeplitz_strategy(c, 4), torch.tensor(
        [[3, 0, 0, 0], [2, 3, 0, 0], [1, 2, 3, 0], [0, 1, 2, 3]], dtype=F64), rtol=0, atol=0)


@pytest.mark.parametrize("bands", [1, 2, 4])
def test_streamed_noise_equals_the_dense_inverse_strategy_times_z(bands):
    n = 12
    c = banded_strategy(bands, n)
    z = torch.randn(n, 10, dtype=F64, generator=torch.Generator().manual_seed(bands))
    expected = torch.linalg.solve_triangular(dense_c(c, n), z, upper=False)
    torch.testing.assert_close(stream(c, z), expected, rtol=0, atol=1e-12)
    if bands > 1:  # the test can fail: the correlated noise is not the fresh draws
        assert (stream(c, z) - z).abs().max() > 0.1


def test_one_band_leaves_the_fresh_draws_exactly_untouched():
    z = torch.randn(5, 10, generator=torch.Generator().manual_seed(0))  # float32
    assert torch.equal(stream(torch.tensor([1.0]), z.clone()), z)


def test_streamed_noise_covariance_across_steps_is_inverse_c_times_its_transpose():
    # m independent coordinates are m samples of the n-step noise vector w = C⁻¹ z, whose
    # covariance is Σ = C⁻¹C⁻ᵀ (z ~ N(0, I)). The mean is known to be 0, so the sample
    # covariance is Σ̂ = W Wᵀ / m, and for Gaussian w each entry has (Isserlis)
    #     Var Σ̂_ij = (E[w_i² w_j²] - Σ_ij²)/m = (Σ_ii Σ_jj + Σ_ij²)/m.
    # 6 standard deviations per entry: over the 36 distinct entries a false failure has
    # probability below 36·2e-9 (and the seed is fixed anyway).
    n, m, bands = 8, 200_000, 4
    c = banded_strategy(bands, n)
    z = torch.randn(n, m, dtype=F64, generator=torch.Generator().manual_seed(29))
    noise, w = CorrelatedNoise(c), z.clone()
    for t in range(n):
        noise.correlate_([w[t]])
    c_inv = torch.linalg.solve_triangular(dense_c(c, n), torch.eye(n, dtype=F64), upper=False)
    sigma = c_inv @ c_inv.T
    sample = w @ w.T / m
    std = ((sigma.diagonal()[:, None] * sigma.diagonal()[None, :] + sigma.square()) / m).sqrt()
    assert ((sample - sigma).abs() <= 6 * std).all(), ((sample - sigma) / std).abs().max()
    # The test can fail: DP-SGD's covariance (identity) is many standard deviations off.
    assert ((sample - torch.eye(n, dtype=F64)).abs() > 6 * std).any()


def _separated(pattern: tuple[int, ...], gap: int) -> bool:
    return all(b - a >= gap for a, b in zip(pattern, pattern[1:]))


def test_sensitivity_is_dp_sgds_exactly_when_participations_are_bands_apart():
    n, bands = 8, 3
    c = banded_strategy(bands, n)
    strategy = dense_c(c, n)
    # Max column norm 1 (the full columns; the last b-1 are cut off by the end of the run).
    assert abs(float(strategy.norm(dim=0).max()) - 1.0) < 1e-12
    separated_worst, violating_worst = 0.0, 0.0
    for size in range(1, n + 1):
        for pattern in itertools.combinations(range(n), size):
            ones = torch.zeros(n, dtype=F64)
            ones[list(pattern)] = 1.0
            excess = float((strategy @ ones).square().sum()) - size
            if _separated(pattern, bands):
                # Disjoint columns: ||C 1_P||² = Σ_P ||C_s||² = |P| when no column is cut
                # off; <= |P| always. Equality on the patterns that avoid the cut tail.
                assert excess <= 1e-12
                if max(pattern) <= n - bands:
                    assert abs(excess) < 1e-12
                separated_worst = max(separated_worst, excess)
            else:
                violating_worst = max(violating_worst, excess)
    # Participations closer than b steps overlap and (c > 0) add: more than |P|, which is why
    # the sampler must separate them. The numbers, for the report:
    print(f"\nb=3 n=8: worst excess ||C1_P||²-|P|, separated {separated_worst:.3g}, "
          f"violating {violating_worst:.3g}")
    assert violating_worst > 0.1


@pytest.mark.parametrize("steps", [1, 2, 3, 5, 64, 65, 130, 300])
def test_prefix_sum_error_matches_the_dense_frobenius_norm(steps):
    g = torch.Generator().manual_seed(steps)
    for c in (torch.tensor([1.0], dtype=F64), square_root_coefficients(4),
              torch.rand(7, dtype=F64, generator=g) + torch.tensor([2.0] + [0.0] * 6, dtype=F64)):
        expected = dense_error(c, steps)
        assert abs(float(prefix_sum_error(c, steps)) - expected) <= 1e-9 * expected


def test_dp_sgd_error_is_n_times_n_plus_one_over_two():
    # A C⁻¹ = A: ||A||_F² = Σ_t (t+1) = n(n+1)/2.
    assert abs(float(prefix_sum_error(torch.tensor([1.0]), 64)) - 64 * 65 / 2) < 1e-9


def test_prefix_sum_error_is_differentiable_and_its_gradient_is_right():
    c = (square_root_coefficients(5) + 0.1).requires_grad_(True)
    assert torch.autograd.gradcheck(lambda x: prefix_sum_error(x, 150), (c,))


def test_error_of_an_unstable_strategy_is_large_and_finite_not_nan():
    # c(x) = 1 + 1.1x has its root inside the unit disk: C⁻¹'s coefficients grow like 1.1^k
    # and overflow float64 within 2000 steps; the log-space error stays finite.
    c = torch.tensor([1.0, 1.1], dtype=F64, requires_grad=True)
    value = log_prefix_sum_error(c, 2000)
    value.backward()
    assert math.isfinite(value.item()) and value.item() > 300 and torch.isfinite(c.grad).all()


def test_optimised_strategy_beats_the_square_root_and_dp_sgd_and_improves_with_bands():
    steps = 64
    errors = {}
    for bands in (1, 2, 4, 8):
        c = banded_strategy(bands, steps)
        errors[bands] = float(scale_free_error(c, steps))
        if bands >= 2:
            start = float(scale_free_error(square_root_coefficients(bands), steps))
            assert errors[bands] < start, (bands, errors[bands], start)
            assert errors[bands] < errors[1]
    print("\nsteps=64 scale-free error by bands:", {b: round(e, 3) for b, e in errors.items()})
    assert errors[1] == pytest.approx(steps * (steps + 1) / 2, rel=1e-12)
    assert errors[2] <= errors[1] and errors[4] <= errors[2] and errors[8] <= errors[4]


def test_strategy_is_normalised_and_deterministic():
    first = banded_strategy(6, 500)
    banded_strategy.cache_clear()
    second = banded_strategy(6, 500)
    assert torch.equal(first, second) and first.dtype == F64
    assert abs(float(first.square().sum()) - 1.0) < 1e-12 and float(first[0]) > 0
    # A fresh tensor each call: mutating one does not touch the cache.
    first.zero_()
    assert torch.equal(banded_strategy(6, 500), second)


def test_one_band_is_dp_sgd_exactly():
    assert torch.equal(banded_strategy(1, 100), torch.tensor([1.0], dtype=F64))


@pytest.mark.parametrize("bands,steps", [(0, 10), (-1, 10), (11, 10)])
def test_bands_outside_one_to_steps_are_refused_with_a_hint(bands, steps):
    with pytest.raises(EngineError) as caught:
        banded_strategy(bands, steps)
    assert "bands" in caught.value.message and caught.value.hint


@pytest.mark.parametrize("bands", [1, 3])
def test_noise_resumed_from_its_state_continues_bit_identically(bands):
    c = banded_strategy(bands, 20)
    g = torch.Generator().manual_seed(7)
    draws = [[torch.randn(4, 3, generator=g), torch.randn(5, generator=g)] for _ in range(10)]
    uninterrupted = CorrelatedNoise(c)
    reference = []
    for fresh in draws:
        fresh = [z.clone() for z in fresh]
        uninterrupted.correlate_(fresh)
        reference.append(fresh)
    for stop in (0, 1, 4):  # before the history is full (b-1 = 2) and after
        before = CorrelatedNoise(c)
        for fresh in draws[:stop]:
            before.correlate_([z.clone() for z in fresh])
        buffer = io.BytesIO()
        torch.save(before.state_dict(), buffer)
        before.correlate_([torch.randn(4, 3), torch.randn(5)])  # the saved state is a copy
        buffer.seek(0)
        resumed = CorrelatedNoise(c)
        resumed.load_state_dict(torch.load(buffer))
        for fresh, expected in zip(draws[stop:], reference[stop:]):
            fresh = [z.clone() for z in fresh]
            resumed.correlate_(fresh)
            assert all(torch.equal(a, b) for a, b in zip(fresh, expected))


def test_resuming_with_other_coefficients_is_refused():
    noise = CorrelatedNoise(banded_strategy(3, 20))
    noise.correlate_([torch.randn(3)])
    with pytest.raises(EngineError):
        CorrelatedNoise(banded_strategy(4, 20)).load_state_dict(noise.state_dict())


def test_a_different_parameter_list_is_refused():
    noise = CorrelatedNoise(banded_strategy(3, 20))
    noise.correlate_([torch.randn(3)])
    with pytest.raises(EngineError):
        noise.correlate_([torch.randn(4)])


def test_strategy_time_for_sixteen_bands_over_two_thousand_steps():
    banded_strategy.cache_clear()
    start = time.perf_counter()
    c = banded_strategy(16, 2000)
    elapsed = time.perf_counter() - start
    print(f"\nbanded_strategy(16, 2000): {elapsed:.3f} s; scale-free error {float(scale_free_error(c, 2000)):.1f}"
          f" (square root {float(scale_free_error(square_root_coefficients(16), 2000)):.1f}, "
          f"DP-SGD {2000 * 2001 / 2:.1f})")


def dense_momentum_error(c: torch.Tensor, n: int, beta: float, nesterov: bool) -> float:
    """||A C⁻¹||_F² for A the running sum of SGD-with-momentum's steps, built row by row by
    simulating the optimizer on unit gradients (independent of Workload's response formula)."""
    a = torch.zeros(n, n, dtype=F64)
    for s in range(n):          # the parameters' displacement at every step from one gradient at step s
        momentum, position = 0.0, 0.0
        for t in range(s, n):
            gradient = 1.0 if t == s else 0.0
            momentum = beta * momentum + gradient
            position += gradient + beta * momentum if nesterov else momentum
            a[t, s] = position
    return float((a @ torch.linalg.inv(dense_c(c, n))).square().sum())


@pytest.mark.parametrize("beta, nesterov", [(0.5, False), (0.9, False), (0.9, True)])
def test_momentum_error_matches_the_dense_error_of_the_simulated_optimizer(beta, nesterov):
    from dpclip.engine.workload import Workload

    c = banded_strategy(5, 150)
    for steps in (40, 150):
        assert float(prefix_sum_error(c, steps, Workload(beta, nesterov))) == \
            pytest.approx(dense_momentum_error(c, steps, beta, nesterov), rel=1e-9)


def test_a_strategy_optimised_for_momentum_beats_the_prefix_sum_one_on_momentum():
    from dpclip.engine.workload import Workload

    momentum = Workload(0.9)
    aware, plain = banded_strategy(8, 600, momentum), banded_strategy(8, 600)
    assert not torch.equal(aware, plain)
    assert float(scale_free_error(aware, 600, momentum)) < 0.995 * float(scale_free_error(plain, 600, momentum))
    assert float(scale_free_error(aware, 600)) > float(scale_free_error(plain, 600))   # and is worse without it
