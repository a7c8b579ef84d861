import math
import random

import pytest

from dpclip.errors import RecipeError
from dpclip.tuning.space import parse_grid_option, search_space


def test_grid_is_the_cartesian_product_of_its_values(tiny):
    base, recipe = tiny()
    configs = search_space(base, recipe, ["training.optimizer.lr=0.1,0.5", "clipping.threshold.value=0.1,1,10"])
    assert len(configs) == 6
    assert {(c.recipe.training.optimizer.lr, c.recipe.clipping.threshold.value) for c in configs} == \
        {(lr, c) for lr in (0.1, 0.5) for c in (0.1, 1, 10)}


def test_command_line_grid_replaces_the_recipes_grid(tiny):
    base, recipe = tiny("tuning.grid={training.optimizer.lr: [0.1, 0.2, 0.3]}")
    assert len(search_space(base, recipe)) == 3
    assert [c.values for c in search_space(base, recipe, ["clipping.fn=auto,abadi"])] == \
        [{"clipping.fn": "auto"}, {"clipping.fn": "abadi"}]


def test_exponent_values_are_numbers():
    assert parse_grid_option("training.optimizer.lr=1e-3,2") == ("training.optimizer.lr", [0.001, 2])


def test_unknown_key_is_a_recipe_error_naming_it(tiny):
    base, recipe = tiny()
    with pytest.raises(RecipeError, match="training.optimizr"):
        search_space(base, recipe, ["training.optimizr.lr=0.1"])


def test_value_the_schema_refuses_is_a_recipe_error(tiny):
    base, recipe = tiny()
    with pytest.raises(RecipeError, match="lr"):
        search_space(base, recipe, ["training.optimizer.lr=0.1,-1"])


def test_privacy_keys_cannot_be_searched(tiny):
    base, recipe = tiny()
    with pytest.raises(RecipeError, match="cannot vary 'privacy'"):
        search_space(base, recipe, ["privacy.epsilon=1,8"])


def test_random_search_draws_inside_its_ranges(tiny):
    base, recipe = tiny("tuning.ranges={training.optimizer.lr: {low: 0.001, high: 1.0, log: true}}")
    configs = search_space(base, recipe, random_draws=50, rng=random.Random(1))
    rates = [c.recipe.training.optimizer.lr for c in configs]
    assert len(rates) == 50 and all(0.001 <= r <= 1.0 for r in rates)
    # log-uniform: about half the draws below the geometric midpoint sqrt(0.001 * 1)
    below = sum(r < math.sqrt(0.001) for r in rates)
    assert 15 <= below <= 35


def test_random_search_without_ranges_or_grid_is_refused(tiny):
    base, recipe = tiny()
    with pytest.raises(RecipeError, match="ranges"):
        search_space(base, recipe, random_draws=3)


def test_random_search_draws_are_not_predicted_by_the_recipes_seed(tiny):
    base, recipe = tiny("tuning.ranges={training.optimizer.lr: {low: 0.001, high: 1.0, log: true}}")
    first = [c.values for c in search_space(base, recipe, random_draws=3)]
    assert first != [c.values for c in search_space(base, recipe, random_draws=3)]
    base, recipe = tiny("tuning.ranges={training.optimizer.lr: {low: 0.001, high: 1.0, log: true}}",
                        "privacy.unsafe_seeded_randomness=true")
    first = [c.values for c in search_space(base, recipe, random_draws=3)]
    assert first == [c.values for c in search_space(base, recipe, random_draws=3)]


@pytest.mark.parametrize("space", [
    ["tuning.grid={training.batch_size: [32, 64]}", "tuning.random=1"],
    ["tuning.grid={training.sampling: [poisson, shuffle]}", "tuning.random=1"],
    ["training.steps=null", "training.epochs=1", "tuning.ranges={training.epochs: {low: 1, high: 3}}",
     "tuning.random=1"],
])
def test_a_random_space_that_can_vary_the_privacy_plan_is_refused_whatever_it_draws(tiny, space):
    """A random search draws its configurations again when it runs: a space is checked whole,
    never by one draw (a trial at another q would spend what the search did not account)."""
    from dpclip.tuning.cost import StepTimer, tune_cost

    base, recipe = tiny(*space)
    for _ in range(3):
        with pytest.raises(RecipeError, match="varies the privacy plan") as info:
            tune_cost(base, recipe, timer=StepTimer(fixed_seconds=0.01))
        assert "out of the search" in info.value.hint


def test_run_search_refuses_drawn_configurations_that_vary_the_privacy_plan(tiny, monkeypatch, public_held_out):
    from dpclip.tuning import cost
    from dpclip.tuning.cost import StepTimer, tune_cost
    from dpclip.tuning.search import run_search

    base, recipe = tiny("tuning.grid={training.batch_size: [32, 64]}", "tuning.random=1", *public_held_out,
                        "tuning.score=public", "tuning.trials_mean=2")
    monkeypatch.setattr(cost, "reachable_configurations", lambda *args, **kwargs: [])
    report = tune_cost(base, recipe, timer=StepTimer(fixed_seconds=0.01))   # the pre-run check fooled
    monkeypatch.undo()
    with pytest.raises(RecipeError, match="varies the privacy plan"):
        run_search(base, recipe, report)


@pytest.mark.parametrize("order", [[0, 2], [2, 0]])
def test_a_grid_over_linear_probe_epochs_is_refused_in_either_order(tiny, order):
    """Linear probing at the switch adds private steps outside training.steps: the first
    configuration's plan stood for all, so [0, 2] charged every trial the steps of 0 epochs."""
    from dpclip.tuning.cost import StepTimer, tune_cost

    base, recipe = tiny("data.public_fraction=0.1", "public={source: builtin, name: digits, test_fraction: 0.2}",
                        "continual={schedule: switch, switch: {rule: step, at_step: 1}, "
                        "at_switch: {linear_probe_epochs: 0}}")
    grid = [f"continual.at_switch.linear_probe_epochs={order[0]},{order[1]}"]
    with pytest.raises(RecipeError, match="varies the privacy plan") as info:
        tune_cost(base, recipe, grid=grid, timer=StepTimer(fixed_seconds=0.01))
    assert "linear_probe_epochs" in info.value.hint


def test_a_grid_over_the_statistics_share_of_the_budget_is_one_plan(tiny):
    """σ_eff is one Gaussian however it is split between gradient and quantile counts."""
    from dpclip.tuning.cost import StepTimer, tune_cost

    base, recipe = tiny("clipping.threshold={kind: quantile, budget_fraction: 0.1}")
    report = tune_cost(base, recipe, grid=["clipping.threshold.budget_fraction=0.05,0.2"],
                       timer=StepTimer(fixed_seconds=0.01))
    assert len(report.runs) == 2


def _no_more_than(monkeypatch, limit):
    """Build at most ``limit`` configurations: a space too big to search fails, not hangs."""
    import dpclip.tuning.space as space

    real, built = space._configuration, []

    def counting(*args):
        built.append(1)
        if len(built) > limit:
            raise AssertionError(f"built {len(built)} configurations of a space that should have been refused")
        return real(*args)

    monkeypatch.setattr(space, "_configuration", counting)


def test_a_grid_too_big_to_train_is_refused_before_any_configuration_is_built(tiny, monkeypatch):
    base, recipe = tiny()
    many = ",".join(str(0.001 * (i + 1)) for i in range(200))
    _no_more_than(monkeypatch, 0)
    with pytest.raises(RecipeError, match="40,000 configurations") as refused:
        search_space(base, recipe, [f"training.optimizer.lr={many}", f"clipping.threshold.value={many}"])
    assert "--random" in refused.value.hint


def test_a_random_search_of_too_many_draws_is_refused_before_any_configuration_is_built(tiny, monkeypatch):
    base, recipe = tiny("tuning.ranges={training.optimizer.lr: {low: 0.001, high: 1.0}}")
    _no_more_than(monkeypatch, 0)
    with pytest.raises(RecipeError, match="20,000 configurations"):
        search_space(base, recipe, random_draws=20_000, rng=random.Random(1))


def test_a_grid_value_nested_too_deeply_is_a_recipe_error_not_a_crash():
    with pytest.raises(RecipeError) as info:
        parse_grid_option("training.optimizer.lr=" + "[" * 5000)
    assert "nested too deeply" in info.value.message and info.value.hint


def test_a_blt_grid_over_the_statistics_share_of_the_budget_is_refused(tiny):
    """Under BLT the split moves ε (a charge is Δs_j²/σ_g² + (Δ_a/σ_a)²): one σ_eff for a share of 0.05
    and one of 0.2 would charge one of them less than it spends."""
    from dpclip.tuning.cost import StepTimer, tune_cost

    base, recipe = tiny("privacy.mechanism={kind: blt, buffers: 2}",
                        "clipping.threshold={kind: quantile, budget_fraction: 0.1}")
    with pytest.raises(RecipeError, match="varies the privacy plan") as info:
        tune_cost(base, recipe, grid=["clipping.threshold.budget_fraction=0.05,0.2"],
                  timer=StepTimer(fixed_seconds=0.01))
    assert "threshold statistic" in info.value.hint


@pytest.mark.parametrize("grid", [["training.optimizer.lr=0.1,0.1,0.2"], ["training.optimizer.lr=0.1,1e-1,0.2"],
                                  ["training.optimizer.lr=1,1.0"]])
def test_a_value_given_twice_in_a_grid_is_refused_not_trained_and_charged_twice(tiny, grid):
    """lr=0.1,0.1,0.2 once made three configurations: the search trained 0.1 twice and was priced
    (naive G = 3, E[K] = 3) for three where two are distinct."""
    base, recipe = tiny()
    with pytest.raises(RecipeError, match="more than once") as info:
        search_space(base, recipe, grid)
    assert "once" in info.value.hint


def test_a_recipe_grid_whose_values_coincide_once_validated_is_refused(tiny):
    base, recipe = tiny("tuning.grid={training.optimizer.lr: [1, 1.0, 0.5]}")
    with pytest.raises(RecipeError, match="more than once"):
        search_space(base, recipe)
    base, recipe = tiny("tuning.grid={training.optimizer.lr: [1, 0.5]}", "tuning.random=4")
    with pytest.raises(RecipeError, match="more than once"):   # a random search would draw one value twice as often
        search_space(base, recipe, ["training.optimizer.lr=0.5,0.5,1"])


# compile and bf16 are each valid, together refused; the learning rates only make the space big
_PAIRED = "tuning.grid={training.compile: [false, true], training.precision: [fp32, bf16], " \
          "training.optimizer.lr: [0.1, 0.2, 0.3, 0.4, 0.5], training.optimizer.momentum: [0, 0.1, 0.2, 0.3, 0.4]}"


def test_a_big_random_space_checks_every_pair_of_values_together(tiny, monkeypatch):
    """Above the limit a random space was checked one value at a time: (compile, bf16), refused
    together, passed the plan and failed only when --run drew it."""
    import dpclip.tuning.space as space

    monkeypatch.setattr(space, "REACHABLE_LIMIT", 80)   # 100 combinations, 69 pairs of values
    base, recipe = tiny(_PAIRED, "tuning.random=2")
    with pytest.raises(RecipeError, match="compile"):
        space.reachable_configurations(base, recipe)


def test_a_random_space_too_big_to_check_whole_says_what_was_checked(tiny, monkeypatch):
    import dpclip.tuning.space as space

    base, recipe = tiny("tuning.grid={training.optimizer.lr: [0.1, 0.2, 0.3, 0.4, 0.5], training.optimizer.momentum: "
                        "[0, 0.1, 0.2, 0.3, 0.4], training.optimizer.weight_decay: [0, 0.1, 0.2, 0.3]}", "tuning.random=2")
    assert space.space_checked(recipe) is None and space.space_checked(recipe, random_draws=None) is None
    monkeypatch.setattr(space, "REACHABLE_LIMIT", 80)   # 100 combinations, 65 pairs of values
    checked = space.space_checked(recipe)
    assert "every pair" in checked and "100" in checked and "--run" in checked
    assert len(space.reachable_configurations(base, recipe)) <= 80
    monkeypatch.setattr(space, "REACHABLE_LIMIT", 20)
    checked = space.space_checked(recipe)
    assert "each grid value and range end once" in checked and "100" in checked
