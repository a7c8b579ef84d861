import json
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from sklearn.metrics import roc_auc_score

from dpclip.accounting import solve
from dpclip.audit.attacks import logit_scaled_confidence
from dpclip.audit.lira import (lira_scores, realised_plan, shadow_keep, shadow_plan, shadow_recipe,
                               target_plan)
from dpclip.recipe import load_recipe, recipe_to_yaml, validate_recipe
from dpclip.planning.plan import privacy_plan

REPO = Path(__file__).resolve().parents[2]


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


@pytest.mark.parametrize("target_rate, size", [(64 / 1437, 898), (64 / 898, 899), (1.0, 500), (1e-4, 300)])
def test_a_shadow_batch_is_the_integer_closest_to_the_targets_rate(target_rate, size):
    plan = shadow_plan({"sample_rate": target_rate, "steps": 7, "noise_multiplier": 1.3}, size)
    assert 1 <= plan["batch_size"] <= size and plan["sample_rate"] == plan["batch_size"] / size
    if target_rate * size >= 1:
        assert abs(plan["sample_rate"] - target_rate) <= 0.5 / size
    assert plan["steps"] == 7 and plan["noise_multiplier"] == 1.3


@pytest.mark.parametrize("shipped", ["quickstart", "quantile-layerwise", "dcsgd-p-digits"])
def test_a_shadow_recipe_plans_the_targets_release_for_its_own_size(shipped):
    # The target is planned for its N, the shadow for a smaller N'; with privacy.epsilon set,
    # re-planning the recipe for N' would calibrate another σ and count other steps. The
    # shadow recipe must survive the YAML round trip of its run directory, and its threshold
    # statistic (if any) must get the target's share of σ.
    recipe = load_recipe(REPO / "recipes" / f"{shipped}.yaml", ["training.epochs=1", "privacy.accountant=rdp"])
    solved_target = solve(privacy_plan(recipe, 1437, groups=3))
    target = {"sample_rate": solved_target.plan.sample_rate, "steps": solved_target.plan.steps,
              "noise_multiplier": solved_target.split.noise_multiplier}
    plan = shadow_plan(target, 898)
    shadow = validate_recipe(yaml.safe_load(recipe_to_yaml(shadow_recipe(recipe, 0, plan))))
    assert shadow.privacy.epsilon is None and shadow.audit.canaries is None
    solved = solve(privacy_plan(shadow, 898, groups=3))
    assert solved.plan.steps == target["steps"]
    assert abs(solved.plan.sample_rate - target["sample_rate"]) <= 0.5 / 898
    assert solved.split == solved_target.split


def test_the_target_plan_of_a_run_written_before_the_noise_keys_were_renamed(tmp_path):
    plan = {"sample_rate": 0.04, "steps": 7, "sigma_total": 1.3, "sigma_gradient": 1.37, "sigma_aux": 9.0,
            "num_train": 100}
    (tmp_path / "meta.json").write_text(json.dumps({"plan": plan}))
    assert target_plan(tmp_path) == {"sample_rate": 0.04, "steps": 7, "noise_multiplier": 1.3,
                                     "gradient_noise_multiplier": 1.37, "sigma_aux": 9.0}
    assert realised_plan(tmp_path)["noise_multiplier"] == 1.3


def test_a_user_level_shadow_takes_or_leaves_all_of_a_persons_records_and_numbers_its_people():
    from dpclip.audit.lira import shadow_data
    from dpclip.audit.report import Pool
    from dpclip.data import load_data

    recipe = load_recipe(REPO / "recipes" / "user-text.yaml", ["data.num_examples=200", "data.num_users=40",
                                                               "data.max_length=16"])
    data = load_data(recipe.data, recipe.seed)
    tensors = {name: torch.cat([data.train[name], data.test[name]]) for name in data.train}
    is_member = np.r_[np.ones(data.num_train, dtype=int), np.zeros(data.num_test, dtype=int)]
    pool = Pool(data, tensors, is_member, np.ones(len(is_member), dtype=bool))
    people = pool.people
    assert len(people) == pool.size and people.max() + 1 == len(set(people.tolist()))
    keep_people = shadow_keep(4, int(people.max()) + 1, seed=0)
    for row in keep_people:
        shadow = shadow_data(pool, row[people], people)
        kept = np.flatnonzero(row[people])
        assert shadow.num_train == len(kept) and shadow.num_users == int(row.sum())
        # the shadow's person of each row is the pool's person, renumbered one to one
        pairs = set(zip(people[kept].tolist(), shadow.train_users.tolist()))
        assert len(pairs) == len({p for p, _ in pairs}) == len({s for _, s in pairs}) == int(row.sum())
        assert sorted({s for _, s in pairs}) == list(range(int(row.sum())))
        held = set(shadow.test_users.tolist())
        assert held.isdisjoint(set(shadow.train_users.tolist()))   # no person is on both sides
        assert len(held) == len(set(people.tolist())) - int(row.sum())


def test_a_user_level_shadow_plan_counts_people_for_its_rate():
    plan = shadow_plan({"sample_rate": 8 / 48, "steps": 6, "noise_multiplier": 1.1}, num_train=130, num_users=24)
    assert plan["batch_size"] == 4 and plan["sample_rate"] == 4 / 24
    assert plan["num_users"] == 24 and plan["num_train"] == 130


def test_two_shadows_still_fit_a_variance_and_do_not_saturate_the_offline_score():
    """Two shadows give each example one "in" and one "out" observation: no degree of freedom
    for a pooled variance (it was 0, floored at 1e-6, and the offline scores tied at the top).
    The shared σ from Var(φ_in − φ_out) = 2σ² recovers the world's 0.5: over 400 examples its
    standard error is about 0.5/sqrt(2·400) = 0.018, so within 0.07 (4 standard errors)."""
    from dpclip.audit.lira import gaussians

    rng = np.random.default_rng(0)
    n = 400
    difficulty = rng.normal(0, 3, size=n)
    keep = shadow_keep(2, n, seed=0)
    observed = difficulty + keep + rng.normal(0, 0.5, size=(2, n))
    _, sd_in, _, sd_out = gaussians(observed, keep)
    assert np.allclose(sd_in, sd_in[0]) and np.allclose(sd_out, sd_in[0])
    assert abs(sd_in[0] - 0.5) < 0.07
    member = rng.random(n) < 0.5
    target = difficulty + member + rng.normal(0, 0.5, size=n)
    offline = lira_scores(target, observed, keep)["offline"]
    assert len(np.unique(offline)) > 0.99 * n            # no saturation into ties
    assert roc_auc_score(member, offline) > 0.6
