import math

import pytest
import torch

from dpclip.engine.policies import PolicyContext, build_policy
from dpclip.engine.policies.quantile import QuantileSpec, QuantileThreshold
from dpclip.errors import EngineError


def context(groups=3, batch=10):
    return PolicyContext([f"g{k}" for k in range(groups)], [1] * groups, batch, 1.0, torch.device("cpu"),
                         torch.float64)


def policy(groups=3, batch=10, **spec):
    return build_policy({"kind": "quantile", "sigma": 1e-12, **spec}, context(groups, batch))


def test_update_follows_the_geometric_rule_with_the_expected_batch_size():
    rule = policy(groups=2, batch=10, target=0.6, lr=0.3, initial=1.0)
    # group 0: 3 of 4 samples unclipped; group 1: all 4 clipped. B = 10 (expected, not 4).
    norms = torch.tensor([[0.5, 2.0], [0.9, 3.0], [1.0, 1.5], [1.2, 9.0]], dtype=torch.float64)
    rule.observe(norms)
    release = rule.release(torch.Generator().manual_seed(0))
    counts = torch.tensor([3 - 4 * 0.5, 0 - 4 * 0.5], dtype=torch.float64)
    fraction = (counts / 10 + 0.5).clamp(0, 1)
    expected = torch.exp(-0.3 * (fraction - 0.6))
    assert torch.allclose(rule.thresholds(), expected, atol=1e-9)
    assert release[0].sensitivity == pytest.approx(math.sqrt(2) / 2)


def test_too_many_unclipped_shrinks_the_threshold_and_too_few_grows_it():
    rule = policy(groups=1, batch=4, target=0.5)
    rule.observe(torch.full((4, 1), 0.1, dtype=torch.float64))
    rule.release(torch.Generator().manual_seed(0))
    assert rule.thresholds().item() < 1.0
    rule2 = policy(groups=1, batch=4, target=0.5)
    rule2.observe(torch.full((4, 1), 10.0, dtype=torch.float64))
    rule2.release(torch.Generator().manual_seed(0))
    assert rule2.thresholds().item() > 1.0


def test_counts_get_gaussian_noise_of_the_given_sigma_from_the_engine_generator():
    sigma, batch = 3.0, 50
    rule = QuantileThreshold(torch.ones(1, dtype=torch.float64), target=0.5, lr=1.0, sigma=sigma,
                             expected_batch_size=batch)
    generator = torch.Generator().manual_seed(7)
    released = []
    for _ in range(4000):
        rule._values = torch.ones(1, dtype=torch.float64)
        rule.observe(torch.zeros((0, 1), dtype=torch.float64))   # no samples: the count is pure noise
        rule.release(generator)
        # invert C = exp(-(b - 0.5)) to recover b, then the noisy count
        fraction = 0.5 - math.log(rule.thresholds().item())
        released.append((fraction - 0.5) * batch)
    values = torch.tensor(released)
    # clamp at [0, 1] bites only beyond 8 sigma here; std of the sample std ~ sigma / sqrt(2n)
    assert abs(values.mean().item()) < 4 * sigma / math.sqrt(len(values))
    assert abs(values.std().item() - sigma) < 4 * sigma / math.sqrt(2 * len(values))


def test_thresholds_converge_to_the_target_quantile_of_the_norms():
    torch.manual_seed(0)
    rule = policy(groups=1, batch=200, target=0.8, lr=0.2, initial=5.0)
    generator = torch.Generator().manual_seed(1)
    for _ in range(400):
        rule.observe(torch.rand(200, 1, dtype=torch.float64))   # uniform(0, 1): 0.8-quantile is 0.8
        rule.release(generator)
    assert rule.thresholds().item() == pytest.approx(0.8, abs=0.05)


def test_missing_sigma_is_refused_with_a_hint():
    with pytest.raises(EngineError) as info:
        build_policy({"kind": "quantile", "target": 0.5}, context())
    assert "sigma" in info.value.message and info.value.hint


@pytest.mark.parametrize(("groups", "expected"), [(1, 0.5), (4, 1.0), (9, 1.5)])
def test_planner_charges_counts_sensitivity_sqrt_groups_over_two(groups, expected):
    spec = QuantileSpec(kind="quantile", budget_fraction=0.05)
    assert spec.statistic(groups).sensitivity == pytest.approx(expected)
    assert spec.statistic(groups).release() == f"quantile counts (K={groups}, sensitivity {expected})"



def test_removing_one_person_moves_the_counts_by_at_most_half_in_a_large_user_level_batch():
    """A person's rows weigh 1/(their rows) together: their shifted count moves by at most ½. The
    counts were summed in float32 over micro-batches, where each addition to a count of thousands
    rounds to ulps of 0.0005: removing one person moved the released statistic by more than ½."""
    rows, per_person, micro = 30_000, 3, 64
    norms = torch.rand((rows, 1), generator=torch.Generator().manual_seed(46))  # 90% unclipped at C = 0.9
    weights = torch.full((rows,), 1 / per_person)
    ctx = PolicyContext(["g0"], [1], rows // per_person, 1.0, torch.device("cpu"), torch.float32)
    whole, without = (build_policy({"kind": "quantile", "sigma": 1.0, "initial": 0.9}, ctx) for _ in range(2))
    for start in range(0, rows, micro):
        whole.observe(norms[start:start + micro], weights[start:start + micro])
        first = max(start, per_person)                                   # the same rows, less the first person
        without.observe(norms[first:start + micro], weights[first:start + micro])
    change = (whole.pending_statistic().double() - without.pending_statistic().double()).abs().item()
    assert change <= 0.5 * (1 + 1e-6), change      # up to the float32 weights' own rounding (3·fl(1/3) = 1 + 3e-8)
