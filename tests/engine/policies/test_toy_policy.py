"""A new threshold policy is one definition: register it, and recipes, the planner, training
and the contract suite take it (docs/engine.md, "Adding a threshold policy")."""

import json
import math
from typing import Literal

import pytest
import torch
from pydantic import Field

from dpclip.engine.policies import (PolicyContext, PolicySpec, ThresholdPolicy, initial_thresholds,
                                    register_policy, threshold_kinds, unregister_policy)
from dpclip.engine.policies.base import PositiveFloat, PositiveInt
from dpclip.errors import RecipeError
from dpclip.planning.plan import aux_spec
from dpclip.train.workflow import train
from tests.engine.policies.contract import (check_engine_dict, check_neighbouring_batches,
                                            check_planner_agrees_with_engine, check_roll_back,
                                            check_state_round_trip)


# ------------------------------------------------------------------ the whole policy

class Halving(ThresholdPolicy):
    """Fixed thresholds that halve after every ``every`` steps; releases nothing."""

    def __init__(self, values: torch.Tensor, every: int):
        self._values, self.every, self.steps = values, every, 0

    def thresholds(self):
        return self._values

    def release(self, generator):
        self.steps += 1
        if self.steps % self.every == 0:
            self._values = self._values / 2
        return None

    def state_dict(self):
        return {"thresholds": self._values.tolist(), "steps": self.steps}

    def load_state_dict(self, state):
        self._values = torch.tensor(state["thresholds"], dtype=self._values.dtype)
        self.steps = state["steps"]


class HalvingSpec(PolicySpec):
    """Toy: C halves every `every` steps."""

    kind: Literal["halving"]
    value: PositiveFloat = Field(1.0, description="initial C (total over groups)")
    every: PositiveInt = Field(1, description="steps between halvings")

    example = {"kind": "halving", "value": 2.0, "every": 2}

    def build(self, ctx: PolicyContext) -> Halving:
        return Halving(initial_thresholds(self.value, ctx), self.every)


@pytest.fixture
def halving():
    register_policy(HalvingSpec)
    yield
    unregister_policy("halving")


# ------------------------------------------------------------------ what it gets for free

def test_a_registered_toy_policy_validates_in_a_recipe_and_trains_by_its_rule(halving, quickstart):
    recipe = quickstart("training.epochs=null", "training.steps=3", "eval.every_steps=null",
                        "clipping.threshold={kind: halving, value: 2.0, every: 1}")
    assert isinstance(recipe.clipping.threshold, HalvingSpec) and aux_spec(recipe) is None
    result = train(recipe)
    records = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()
               if '"thresholds"' in line]
    assert [r["step"] for r in records] == [1, 2, 3]
    groups = 3                                           # quickstart: 3 Linear layers, layer grouping
    for t, record in enumerate(records):
        assert record["thresholds"] == pytest.approx([2.0 / math.sqrt(groups) / 2 ** t] * groups)


def test_a_registered_toy_policy_keeps_the_contract(halving):
    for check in (check_state_round_trip, check_neighbouring_batches, check_planner_agrees_with_engine,
                  check_engine_dict, check_roll_back):
        check("halving")


def test_an_unregistered_policy_is_refused_by_recipes(quickstart):
    assert "halving" not in threshold_kinds()
    with pytest.raises(RecipeError) as info:
        quickstart("clipping.threshold={kind: halving}")
    assert "is not one of fixed, quantile, dcsgd-p, dcsgd-e, discriminative" in info.value.message
