import math

import numpy as np
import pytest

from dpclip.audit.metrics import attack_metrics, dp_tpr_bound, null_auc_std


def test_dp_bound_at_one_percent_fpr_and_epsilon_two():
    # docs/auditing.md: at FPR = 1%, ε = 2 allows TPR ≤ 7.4%.
    assert dp_tpr_bound(np.array([0.01]), 2.0, 0.0)[0] == pytest.approx(math.exp(2) * 0.01, rel=1e-9)
    assert dp_tpr_bound(np.array([0.01]), 2.0, 0.0)[0] == pytest.approx(0.0739, abs=1e-4)


def test_dp_bound_never_exceeds_one_and_is_the_diagonal_at_epsilon_zero():
    fpr = np.linspace(0, 1, 11)
    assert np.all(dp_tpr_bound(fpr, 5.0, 1e-5) <= 1.0)
    assert np.allclose(dp_tpr_bound(fpr, 0.0, 0.0), fpr)


def test_dp_bound_of_a_barely_noised_run_allows_every_tpr_without_overflow():
    # σ = 0.01 gives ε in the thousands: e^ε overflows a float (it raised in the ROC plot)
    assert dp_tpr_bound(np.array([0.0, 1e-3, 0.5]), 5e4, 1e-5).tolist() == [1.0, 1.0, 1.0]
    assert dp_tpr_bound(np.array([1e-3]), 699.0, 1e-5)[0] == 1.0


def test_null_auc_standard_error_for_1000_and_1000():
    assert null_auc_std(1000, 1000) == pytest.approx(0.013, abs=5e-4)


def test_useless_scores_have_auc_near_half_within_the_null_error():
    rng = np.random.default_rng(0)
    labels = np.r_[np.ones(1000), np.zeros(1000)]
    result = attack_metrics(labels, rng.normal(size=2000), bootstrap=100, seed=0)
    assert abs(result["auc"] - 0.5) < 3 * result["auc_null_std"]
    low, high = result["auc_ci95"]
    assert low < result["auc"] < high


def test_separable_scores_have_auc_one_and_full_tpr_at_low_fpr():
    labels = np.r_[np.ones(500), np.zeros(500)]
    result = attack_metrics(labels, labels + 0.01 * np.arange(1000) / 1000, bootstrap=0)
    assert result["auc"] == 1.0 and result["tpr_at_0.1%_fpr"] == 1.0
    assert result["advantage"] == 1.0 and result["balanced_accuracy"] == 1.0
