"""How well a membership-inference attack does, and what DP allows it to do.

Scores follow one convention everywhere: higher score = "more likely a member".
Labels are 1 for members, 0 for non-members.
"""

from __future__ import annotations

import math

import numpy as np
from sklearn.metrics import roc_auc_score, roc_curve


def dp_tpr_bound(fpr: np.ndarray, epsilon: float, delta: float) -> np.ndarray:
    """Largest TPR an (ε, δ)-DP training run allows at each FPR (docs/auditing.md).

    TPR ≤ e^ε·FPR + δ, and, applying the same bound to the complementary test,
    1 − FPR ≤ e^ε·(1 − TPR) + δ, i.e. TPR ≤ 1 − e^(−ε)·(1 − δ − FPR)
    (Kairouz, Oh, Viswanath 2015, the hypothesis-testing view of DP).
    """
    fpr = np.asarray(fpr, dtype=float)
    if epsilon > 700:   # e^ε overflows a float: the bound allows every TPR (np.exp would warn, math raise)
        return np.ones_like(fpr)
    first = math.exp(epsilon) * fpr + delta
    second = 1.0 - math.exp(-epsilon) * (1.0 - delta - fpr)
    return np.clip(np.minimum(first, second), 0.0, 1.0)


def null_auc_std(num_members: int, num_non_members: int) -> float:
    """Standard error of the AUC of a useless attack (Mann–Whitney U under H0):
    sqrt((n₁ + n₀ + 1) / (12·n₁·n₀)); ≈ 0.013 for 1000 + 1000 (docs/auditing.md)."""
    n1, n0 = num_members, num_non_members
    return math.sqrt((n1 + n0 + 1) / (12.0 * n1 * n0))


def tpr_at_fpr(fpr: np.ndarray, tpr: np.ndarray, target: float) -> float:
    """Best TPR among thresholds whose FPR is at most ``target`` (0 if none)."""
    ok = fpr <= target
    return float(tpr[ok].max()) if ok.any() else 0.0


def bootstrap_auc(labels: np.ndarray, scores: np.ndarray, rounds: int, seed: int,
                  confidence: float = 0.95) -> tuple[float, float]:
    """Percentile bootstrap interval of the AUC, resampling members and non-members
    separately (so every resample has both classes)."""
    rng = np.random.default_rng(seed)
    members, non_members = scores[labels == 1], scores[labels == 0]
    aucs = np.empty(rounds)
    for i in range(rounds):
        m = rng.choice(members, size=len(members))
        n = rng.choice(non_members, size=len(non_members))
        aucs[i] = roc_auc_score(np.r_[np.ones(len(m)), np.zeros(len(n))], np.r_[m, n])
    tail = (1.0 - confidence) / 2.0
    return float(np.quantile(aucs, tail)), float(np.quantile(aucs, 1.0 - tail))


def attack_metrics(labels, scores, *, bootstrap: int = 200, seed: int = 0) -> dict:
    """AUC (with a bootstrap CI and the null standard error), TPR at 0.1% and 1% FPR,
    best balanced accuracy and advantage max(TPR − FPR), and the ROC curve itself.

    The balanced accuracy and advantage are taken at the best threshold chosen on the
    same scores, so they are optimistic (an upper estimate of what a fixed threshold
    achieves); TPR at an FPR below 1/n_non_members cannot be measured and reads as the
    TPR at FPR = 0.
    """
    labels = np.asarray(labels, dtype=int)
    scores = np.asarray(scores, dtype=float)
    fpr, tpr, _ = roc_curve(labels, scores)
    auc = float(roc_auc_score(labels, scores))
    low, high = bootstrap_auc(labels, scores, bootstrap, seed) if bootstrap else (None, None)
    advantage = float(np.max(tpr - fpr))
    n1, n0 = int(labels.sum()), int((1 - labels).sum())
    return {
        "auc": auc, "auc_ci95": [low, high], "auc_null_std": null_auc_std(n1, n0),
        "tpr_at_0.1%_fpr": tpr_at_fpr(fpr, tpr, 0.001), "tpr_at_1%_fpr": tpr_at_fpr(fpr, tpr, 0.01),
        "balanced_accuracy": 0.5 + advantage / 2.0, "advantage": advantage,
        "members": n1, "non_members": n0,
        "roc": {"fpr": fpr.tolist(), "tpr": tpr.tolist()},
    }
