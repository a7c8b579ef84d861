import pytest

from dpclip.tuning.compare import DC_SGD_C_GRID, method_searches, tune_cost_compared
from dpclip.tuning.cost import StepTimer


def test_each_method_keeps_the_users_other_axes_and_brings_its_own_threshold_grid(tiny):
    base, recipe = tiny()
    grid = ["training.optimizer.lr=0.1,0.5,1", "clipping.threshold.value=1,2"]
    runs = {m.name: m.runs for m in method_searches(base, recipe, grid)}
    assert runs["fixed"] == len(DC_SGD_C_GRID) * 3  # the user's C values are replaced by the C grid
    assert runs["auto"] == 3
    assert runs["quantile"] == 45 * 3


def test_methods_are_the_registered_threshold_kinds(tiny, monkeypatch):
    import dpclip.tuning.compare as compare

    monkeypatch.setattr(compare, "threshold_kinds", lambda: ["fixed", "quantile"])
    base, recipe = tiny()
    assert [m.name for m in method_searches(base, recipe, [])] == ["fixed", "quantile", "auto"]


@pytest.mark.slow   # 4-7 s: the default run keeps under 10 minutes
def test_speedup_is_the_ratio_of_search_times(tiny, public_held_out):
    base, recipe = tiny("privacy.accountant=rdp", *public_held_out, "tuning.score=public")
    report = tune_cost_compared(base, recipe, grid=["training.optimizer.lr=0.1,0.5"],
                                timer=StepTimer(fixed_seconds=0.01))
    rows = {row["method"]: row for row in report.comparison}
    fixed = rows["fixed"]
    for row in rows.values():
        assert row["search_hours"] == pytest.approx(row["runs"] * report.privacy.steps * 0.01 / 3600)
        assert row["speedup_vs_fixed"] == pytest.approx(fixed["search_hours"] / row["search_hours"])
    # fewer runs in the search, less noise per run
    key = "gradient_noise_multiplier_repeat_and_select"
    assert rows["auto"][key] < fixed[key]


@pytest.mark.slow  # an end-to-end run: the slow set (README)
def test_a_method_the_recipe_cannot_use_is_left_out_with_the_reason(tiny, public_held_out):
    from dpclip.engine.policies import threshold_kinds

    if "dcsgd-e" not in threshold_kinds():
        pytest.skip("dcsgd-e is not registered")
    base, recipe = tiny("clipping.noise_allocation=equal-budget", "privacy.accountant=rdp", *public_held_out,
                        "tuning.score=public")
    report = tune_cost_compared(base, recipe, timer=StepTimer(fixed_seconds=0.01))
    rows = {row["method"]: row for row in report.comparison}
    if "skipped" not in rows["dcsgd-e"]:
        pytest.skip("this schema accepts dcsgd-e with equal-budget allocation")
    assert "noise_allocation" in rows["dcsgd-e"]["skipped"]
    assert rows["fixed"]["runs"] == 10


def test_compare_prices_repeat_and_select_at_the_recipes_trials_mean(tiny, monkeypatch, public_held_out):
    """tuning.trials_mean is how many trials the recipe's search runs on average: --compare once
    priced each method at E[K] = its grid size instead (10 for fixed C, no selection at all for auto)."""
    import dpclip.tuning.compare as compare
    from dp_accounting import dp_event
    from dpclip.planning.plan import plan_for_recipe, recipe_units

    priced = []

    def spy(run_event_of, search_event_of, epsilon, delta, accountant):   # the search event, not its σ
        priced.append(search_event_of(run_event_of(1.0)))
        return 1.0

    monkeypatch.setattr(compare, "threshold_kinds", lambda: ["fixed"])
    monkeypatch.setattr(compare, "calibrate_search_noise", spy)
    base, recipe = tiny("privacy.accountant=rdp", *public_held_out, "tuning.score=public", "tuning.trials_mean=3")
    rows = compare.compare_methods(method_searches(base, recipe, []), recipe, plan_for_recipe(recipe),
                                   StepTimer(fixed_seconds=0.01), recipe_units(recipe))
    selections = [event for event in priced if not isinstance(event, dp_event.SelfComposedDpEvent)]
    assert [row["method"] for row in rows] == ["fixed", "auto"] and len(selections) == 2
    assert all(isinstance(event, dp_event.RepeatAndSelectDpEvent) and event.mean == 3 for event in selections)
    assert [row["repeat_and_select_mean"] for row in rows] == [3, 3]
