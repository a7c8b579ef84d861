"""Groups are counted in one place (dpclip.planning.plan.count_groups), for every command."""

import pytest
from torch import nn

from dpclip.planning.plan import aux_spec, count_groups, statistic_groups


@pytest.mark.parametrize("grouping, groups", [("all-layer", 1), ("{uniform: 4}", 4),
                                              ("{groups: [['0'], ['2', '4']]}", 2),
                                              ("{stages: ['^0', '^2', '^4']}", 3)])
def test_groups_fixed_by_the_grouping_need_no_model(quickstart, grouping, groups):
    recipe = quickstart(f"clipping.grouping={grouping}")
    assert count_groups(recipe, model=object()) == groups        # the model is never looked at


def test_model_dependent_groups_are_counted_on_the_given_model(quickstart):
    recipe = quickstart("clipping.grouping=layer")
    model = nn.Sequential(nn.Linear(64, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4),
                          nn.ReLU(), nn.Linear(4, 10))
    assert count_groups(recipe, model) == 4


def test_without_a_model_the_recipes_model_is_built(quickstart):
    assert count_groups(quickstart("clipping.grouping=param")) == 6        # weight and bias of 3 layers
    assert count_groups(quickstart("model.hidden=[16]")) == 2              # layer grouping, 2 layers


def test_groups_are_needed_only_for_a_released_statistic(quickstart):
    assert statistic_groups(quickstart()) is None
    recipe = quickstart("clipping.threshold={kind: dcsgd-p}")
    assert statistic_groups(recipe) == 3
    assert aux_spec(recipe).sensitivity == pytest.approx(3 ** 0.5)        # one histogram per group
    assert aux_spec(recipe, groups=4).sensitivity == pytest.approx(2.0)
