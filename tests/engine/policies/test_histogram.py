import math

import pytest
import torch
from torch import nn

from dpclip.engine import DPEngine
from dpclip.engine.policies import PolicyContext, build_policy, policy_spec
from dpclip.engine.policies.histogram import (error_range, error_threshold, expected_error, histogram_counts,
                                              percentile_threshold)
from dpclip.errors import EngineError

F64 = torch.float64


def context(groups=1, batch=10, sigma=1.0, sizes=None):
    return PolicyContext([f"g{k}" for k in range(groups)], sizes or [1] * groups, batch, sigma,
                         torch.device("cpu"), F64)


def policy(kind="dcsgd-p", groups=1, batch=10, sigma=1.0, sizes=None, **spec):
    return build_policy({"kind": kind, "sigma_hist": 1e-12, **spec}, context(groups, batch, sigma, sizes))


def t(values):
    return torch.tensor(values, dtype=F64)


# ------------------------------------------------------------------ histogram

def test_bin_index_is_min_not_max_and_overflow_lands_in_the_last_bin():
    # R = 1, b = 20: floor(20 n) -> 0, 0, 1, 19, 20 -> 19, 140 -> 19
    counts = histogram_counts(t([0.0, 0.04, 0.05, 0.99, 1.0, 7.0]), 1.0, 20)
    expected = torch.zeros(20, dtype=F64)
    expected[0], expected[1], expected[19] = 2, 1, 3
    assert torch.equal(counts, expected)   # the paper's "max" would put all six in bin 19


def test_histogram_adds_up_over_micro_batches_and_resets_after_release():
    rule = policy(bins=4, range=4.0)
    rule.observe(t([[0.5], [3.5]]))
    rule.observe(t([[1.5], [9.0]]))
    assert rule._counts.tolist() == [[1.0, 1.0, 0.0, 2.0]]
    rule.release(torch.Generator().manual_seed(0))
    assert rule._counts.sum().item() == 0


# ------------------------------------------------------------------ percentile rule (DC-SGD-P)

def test_percentile_is_the_midpoint_of_the_first_bin_reaching_p_of_the_total():
    # counts 1, 1, 6, 2 over [0, 4): S' = 10, 0.5·S' = 5 reached in bin 2 -> C = 2.5
    assert percentile_threshold(t([1, 1, 6, 2]), 4.0, 0.5) == pytest.approx(2.5)
    assert percentile_threshold(t([1, 1, 6, 2]), 4.0, 0.1) == pytest.approx(0.5)
    assert percentile_threshold(t([1, 1, 6, 2]), 4.0, 1.0) == pytest.approx(3.5)


def test_percentile_one_reaches_the_last_bin_whatever_the_rounding_of_the_total():
    # p = 1 is allowed; S' summed pairwise was above the cumulative sum's last value (an ulp or so) in 83 of these
    # 300 noisy 20-bin histograms, no bin reached p·S' and the policy raised IndexError
    generator = torch.Generator().manual_seed(0)
    for _ in range(300):
        noisy = torch.randn(20, generator=generator, dtype=F64) * 5 + torch.rand(20, generator=generator, dtype=F64) * 30
        last = int(torch.nonzero(noisy > 0)[-1])
        assert percentile_threshold(noisy, 20.0, 1.0) == pytest.approx(last + 0.5)


def test_negative_noisy_counts_are_clamped_before_cumulating():
    # clamped: 1, 0, 2, 1 -> S' = 4, target 2 reached in bin 2 -> C = 2.5.
    # Without the clamp: S' = 2, target 1 reached already in bin 0 -> C = 0.5.
    assert percentile_threshold(t([1, -2, 2, 1]), 4.0, 0.5) == pytest.approx(2.5)


def test_nonpositive_noisy_total_returns_nothing_and_the_policy_keeps_c_and_r():
    assert percentile_threshold(t([-1, -0.5, 0, -3]), 4.0, 0.5) is None
    for kind in ("dcsgd-p", "dcsgd-e"):
        rule = policy(kind, bins=4, range=4.0, initial=1.5)
        assert rule._update(1.5, 4.0, t([-1.0, -1.0, 0.0, -2.0])) == (1.5, 4.0)


def test_percentile_policy_sets_c_and_the_next_range_to_twice_c():
    rule = policy(bins=4, range=4.0, percentile=0.5)
    rule.observe(t([[0.5], [1.5], [2.5], [2.6], [2.7], [3.9]]))   # counts 1, 1, 3, 1
    rule.release(torch.Generator().manual_seed(0))
    assert rule.thresholds().item() == pytest.approx(2.5)
    assert rule._ranges == [pytest.approx(5.0)]
    assert rule.summary()["range"] == [4.0] and rule.summary()["next_range"] == [pytest.approx(5.0)]


def test_percentile_policy_keeps_c_within_its_bounds():
    rule = policy(bins=4, range=4.0, percentile=0.5, max_threshold=2.0)
    rule.observe(t([[3.9]] * 5))
    rule.release(torch.Generator().manual_seed(0))
    assert rule.thresholds().item() == pytest.approx(2.0)


# ------------------------------------------------------------------ error rule (DC-SGD-E)

def test_expected_error_matches_the_formula_by_hand():
    # b = 2 over [0, 2): midpoints 0.5, 1.5; counts 1, 3 (S' = 4); σ = 2, d = 3, B = 4.
    e = expected_error(t([1.0]), t([1, 3]), 2.0, sigma=2.0, dim=3, batch=4)
    by_hand = 4 * 1 * 3 / 16 + (1 * 0 + 3 * 0.5 ** 2) / 4
    assert e.item() == pytest.approx(by_hand)


def test_error_rule_picks_the_interior_minimum():
    # all norms at 1.5: E = 2C² + (1.5 − C)² (σ=1, d=2, B=1), minimised at C = 0.5
    assert error_threshold(1.0, t([0, 4]), 2.0, 1.0, 2, 1, 1e-4, 1e4) == pytest.approx(0.5)


def test_error_rule_recentres_on_an_end_candidate_until_the_minimum_is_inside():
    # all norms at 0.5: E = 99C² + (0.5 − C)², minimised at C = 0.005: 1 -> 0.1 -> 0.01 -> 0.005
    assert error_threshold(1.0, t([4, 0]), 2.0, 1.0, 99, 1, 1e-6, 1e4) == pytest.approx(0.005)


def test_error_rule_recentring_loop_is_capped():
    assert error_threshold(1.0, t([4, 0]), 2.0, 1.0, 99, 1, 1e-6, 1e4, max_rounds=2) == pytest.approx(0.01)


def test_error_rule_keeps_c_within_its_bounds():
    assert error_threshold(1.0, t([4, 0]), 2.0, 1.0, 99, 1, 0.05, 1e4) == pytest.approx(0.05)
    # almost no noise and every norm overflowing: E decreases up to the largest candidate
    assert error_threshold(1.0, t([0, 4]), 2.0, 1e-9, 1, 1, 1e-4, 1.2) == pytest.approx(1.2)


def test_error_rule_with_nonpositive_total_returns_nothing():
    assert error_threshold(1.0, t([-1, 0]), 2.0, 1.0, 2, 1, 1e-4, 1e4) is None


@pytest.mark.parametrize("counts, factor", [
    ([0, 0, 1, 5], 2.0),      # last bin holds ≥ S'/2: double
    ([5, 0, 0, 0], 0.5),      # upper half holds 0 ≤ S'/b: halve
    ([2, 1, 1, 0], 0.5),      # upper half holds exactly S'/b = 1: halve
    ([1, 1, 1, 1], 1.0),      # neither
    ([-1, -1, -2, -3], 1.0),  # S' ≤ 0: keep
])
def test_error_range_doubles_or_halves_by_the_papers_rules(counts, factor):
    assert error_range(8.0, t(counts)) == pytest.approx(8.0 * factor)


def test_error_policy_uses_the_total_parameter_count_and_the_expected_batch_size():
    # two groups of sizes 1 and 1: D = 2 (not d_k = 1); B = 1 expected
    rule = policy("dcsgd-e", groups=2, batch=1, sigma=1.0, sizes=[1, 1], bins=2, range=2.0 * math.sqrt(2),
                  initial=math.sqrt(2))
    assert rule._ranges == [pytest.approx(2.0)] * 2 and rule.thresholds().tolist() == [pytest.approx(1.0)] * 2
    # a realised batch of 4 (B = 1 is what the rule must use): E = 2C² + (1.5 − C)² -> 0.5
    rule.observe(t([[1.5, 1.5]] * 4))
    rule.release(torch.Generator().manual_seed(0))
    assert rule.thresholds().tolist() == [pytest.approx(0.5)] * 2


def test_error_policy_range_stays_within_the_threshold_bounds_when_every_norm_is_zero_or_infinite():
    # the paper's range rule halves R while the upper bins are empty and doubles it while the last bin holds half:
    # with every norm 0 (a group with no gradient) R reached 0 after ~1075 steps and the next histogram
    # crashed on 0/0 (RuntimeError from bincount); with every norm non-finite it reached inf (inf/inf)
    generator = torch.Generator().manual_seed(0)
    for norm, start, bound in ((0.0, 2e-323, 1e-4), (math.inf, 1e307, 2e4)):
        rule = policy("dcsgd-e", batch=100, bins=4)
        rule.load_state_dict({"thresholds": [1.0], "ranges": [start]})
        for _ in range(12):
            rule.observe(torch.full((100, 1), norm, dtype=F64))
            rule.release(generator)
        assert rule._ranges == [pytest.approx(bound)]   # min_threshold, 2·max_threshold (defaults 1e-4, 1e4)


def test_error_policy_needs_gradient_noise():
    with pytest.raises(EngineError):
        policy("dcsgd-e", sigma=0.0)


# ------------------------------------------------------------------ privacy of the release

def test_release_reports_sensitivity_sqrt_k_and_sigma_hist():
    rule = build_policy({"kind": "dcsgd-p", "sigma_hist": 7.0}, context(groups=3))
    rule.observe(torch.rand(5, 3, dtype=F64))
    (release,) = rule.release(torch.Generator().manual_seed(0))
    assert release.sensitivity == pytest.approx(math.sqrt(3)) and release.sigma == 7.0


def test_histogram_noise_has_std_sigma_hist_from_the_engine_generator():
    sigma = 5.0
    rule = build_policy({"kind": "dcsgd-p", "sigma_hist": sigma, "bins": 20}, context())
    generator = torch.Generator().manual_seed(3)
    values = []
    for _ in range(250):
        rule.observe(torch.zeros((0, 1), dtype=F64))
        rule.release(generator)
        values += rule.summary()["noisy_histogram"][0]
    values = torch.tensor(values)
    n = len(values)
    assert abs(values.mean().item()) < 4 * sigma / math.sqrt(n)
    assert abs(values.std().item() - sigma) < 4 * sigma / math.sqrt(2 * n) + 1e-3   # rounding to 3 decimals
    # same generator state -> same noise: the engine's seed controls it
    a = build_policy({"kind": "dcsgd-p", "sigma_hist": sigma}, context())
    b = build_policy({"kind": "dcsgd-p", "sigma_hist": sigma}, context())
    a.release(torch.Generator().manual_seed(1))
    b.release(torch.Generator().manual_seed(1))
    assert a.summary() == b.summary()


def test_missing_sigma_hist_is_refused_with_a_hint():
    with pytest.raises(EngineError) as info:
        build_policy({"kind": "dcsgd-p"}, context())
    assert "sigma_hist" in info.value.message and info.value.hint


# ------------------------------------------------------------------ in the engine

def test_new_threshold_applies_from_the_next_step_only():
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    engine = DPEngine(model, {"threshold": {"kind": "dcsgd-p", "sigma_hist": 1e-9, "bins": 4, "range": 40.0,
                                            "percentile": 0.5, "initial": 1.0}},
                      gradient_noise_multiplier=0.0, expected_batch_size=4)
    x = torch.randn(4, 3) * 10
    engine.backward((model(x).squeeze(1) - 1) ** 2)
    first = engine.privatize()
    assert first.thresholds.item() == 1.0                 # clipped at C0 in step 1
    assert first.policy_summary["range"] == [40.0]
    c_next = engine.thresholds.item()
    assert c_next != 1.0
    engine.backward((model(x).squeeze(1) - 1) ** 2)
    assert engine.privatize().thresholds.item() == pytest.approx(c_next)


@pytest.mark.parametrize("kind", ["dcsgd-p", "dcsgd-e"])
@pytest.mark.parametrize("optimizer", [torch.optim.SGD, torch.optim.Adam])
def test_policies_train_a_grouped_model_with_sgd_and_adam(kind, optimizer):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    engine = DPEngine(model, {"grouping": "layer", "threshold": {"kind": kind, "sigma_hist": 5.0}},
                      gradient_noise_multiplier=1.0, expected_batch_size=16, seed=0)
    opt = optimizer(model.parameters(), lr=0.01)
    for _ in range(3):
        x, y = torch.randn(16, 4), torch.randint(0, 2, (16,))
        engine.backward(nn.functional.cross_entropy(model(x), y, reduction="none"))
        report = engine.privatize()
        opt.step()
    assert len(report.aux_releases) == 1 and report.aux_releases[0].sensitivity == pytest.approx(math.sqrt(2))
    assert torch.isfinite(engine.thresholds).all() and (engine.thresholds > 0).all()


@pytest.mark.parametrize("kind", ["dcsgd-p", "dcsgd-e"])
@pytest.mark.parametrize(("groups", "expected"), [(1, 1.0), (4, 2.0), (9, 3.0)])
def test_planner_charges_histogram_sensitivity_sqrt_groups_whatever_the_bins(kind, groups, expected):
    for bins in (2, 20, 500):
        spec = policy_spec(kind)(kind=kind, bins=bins)
        assert spec.statistic(groups).sensitivity == pytest.approx(expected)
        assert spec.statistic(groups).sigma == 5.0             # the paper's σ_H by default
