"""The Poisson rate must be q itself, not q rounded up to a float32 grid.

float32 uniforms are multiples of 2⁻²⁴, so `rand() < q` includes an example with
probability ⌈q·2²⁴⌉/2²⁴: for any q ≤ 2⁻²⁴ that is 2⁻²⁴ ≈ 6e-8, however small q is.
The accountant would then charge q while the sampler uses a rate up to ~1e5 times larger."""

import torch

from dpclip.data import PoissonSampler


def test_tiny_rate_is_not_rounded_up_to_the_float32_grid():
    num_examples, steps, rate = 20_000_000, 10, 1e-12
    sampler = PoissonSampler(num_examples, rate, steps, seed=1)
    included = sum(len(batch) for batch in sampler)
    # At the true rate the expected count is 2e-4, so P(included ≥ 1) ≤ 2e-4. At the float32
    # rate 2⁻²⁴ the count is Poisson(11.9) and P(included = 0) = 7e-6.
    assert included == 0


def test_rate_matches_q_within_three_standard_errors():
    num_examples, steps, rate = 200_000, 20, 3e-3
    sampler = PoissonSampler(num_examples, rate, steps, seed=2)
    included = sum(len(batch) for batch in sampler)
    trials = num_examples * steps
    std = (trials * rate * (1 - rate)) ** 0.5
    assert abs(included - trials * rate) < 3 * std


def test_float32_comparison_would_fail_the_tiny_rate_test():
    """The first test has the power to catch the float32 rounding (same sizes, float32 draws)."""
    generator = torch.Generator()
    generator.manual_seed(1)
    included = sum(int((torch.rand(20_000_000, generator=generator) < 1e-12).sum()) for _ in range(10))
    assert included > 0
