import numpy as np
import torch
from sklearn.metrics import roc_auc_score

from dpclip.audit.attacks import logit_scaled_confidence
from dpclip.audit.lira import lira_scores, shadow_keep


def test_every_example_is_in_half_of_the_shadows():
    keep = shadow_keep(8, 500, seed=0)
    assert (keep.sum(axis=0) == 4).all()
    assert abs(keep.sum(axis=1).mean() - 250) < 1e-9
    assert not np.array_equal(shadow_keep(8, 500, seed=1), keep)


def test_logit_scaling_is_log_odds_of_the_label():
    logits = torch.tensor([[2.0, 0.5, -1.0], [0.0, 0.0, 3.0]])
    labels = torch.tensor([0, 1])
    p = torch.softmax(logits, dim=1)[torch.arange(2), labels]
    assert torch.allclose(logit_scaled_confidence(logits, labels), torch.log(p / (1 - p)), atol=1e-6)


def test_lira_separates_members_when_training_shifts_confidence():
    # Synthetic world: each example has its own difficulty d; a model's confidence is
    # d + 1 if it trained on the example, d otherwise, plus N(0, 0.5²) noise.
    rng = np.random.default_rng(0)
    n, shadows = 400, 16
    difficulty = rng.normal(0, 3, size=n)
    keep = shadow_keep(shadows, n, seed=0)
    observed = difficulty + keep + rng.normal(0, 0.5, size=(shadows, n))
    member = rng.random(n) < 0.5
    target = difficulty + member + rng.normal(0, 0.5, size=n)
    scores = lira_scores(target, observed, keep)
    # The per-example fit removes the difficulty, which drowns a plain threshold on φ.
    assert roc_auc_score(member, scores["online"]) > 0.8
    assert roc_auc_score(member, scores["offline"]) > 0.75
    assert roc_auc_score(member, target) < 0.65
