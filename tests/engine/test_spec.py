"""The clipping settings: one typed spec and one table of defaults, for recipes and DPEngine alike."""

import pytest
import torch

from dpclip.engine import DPEngine
from dpclip.engine.policies.base import PolicySpec
from dpclip.engine.spec import CLIPPING_DEFAULTS, ClippingSpec
from dpclip.errors import EngineError
from dpclip.recipe.schema import Clipping


def test_a_recipes_clipping_defaults_are_the_engines_table():
    recipe_side = Clipping()
    for name, default in CLIPPING_DEFAULTS.items():
        if name == "threshold":
            assert recipe_side.threshold.kind == default["kind"]
        else:
            assert getattr(recipe_side, name) == default, name
    engine_side = ClippingSpec.from_dict(None)
    assert engine_side.as_dict() == {**dict(CLIPPING_DEFAULTS), "threshold": dict(CLIPPING_DEFAULTS["threshold"])}


def test_the_recipe_hands_the_engine_a_validated_spec_with_the_splits_noise():
    clipping = Clipping.model_validate({"grouping": "layer",
                                        "threshold": {"kind": "quantile", "initial": 0.5, "budget_fraction": 0.1}})
    spec = clipping.engine_spec(sigma_aux=3.0)
    assert isinstance(spec, ClippingSpec) and spec.grouping == "layer"
    assert isinstance(spec.threshold, PolicySpec) and spec.threshold.kind == "quantile"
    assert spec.threshold.aux_sigma == 3.0 and spec.threshold.budget_fraction is None


def test_a_dict_and_a_spec_build_the_same_engine():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    settings = {"grouping": "layer", "fn": "auto", "gamma": 0.05, "threshold": {"kind": "fixed", "value": 2.0}}
    from_dict = DPEngine(model, settings, expected_batch_size=4)
    thresholds = from_dict.policy.thresholds().clone()
    from_dict.detach()
    from_spec = DPEngine(model, ClippingSpec.from_dict(settings), expected_batch_size=4)
    assert from_spec.clipping == from_dict.clipping
    assert torch.equal(from_spec.policy.thresholds(), thresholds)
    from_spec.detach()


@pytest.mark.parametrize("settings, named", [({"threshhold": {"kind": "fixed"}}, "threshhold"),
                                             ({"norm_method": "fast"}, "fast")])
def test_unknown_settings_at_the_engines_edge_are_refused_with_a_hint(settings, named):
    with pytest.raises(EngineError) as info:
        ClippingSpec.from_dict(settings)
    assert named in info.value.message and info.value.hint


@pytest.mark.parametrize("clipping", [True, "abadi", {"threshold": True}, {"threshold": 5.0}, {"threshold": [1.0]}])
def test_a_clipping_or_threshold_that_is_not_a_dict_is_refused_with_a_hint(clipping):
    """DPEngine(clipping={"threshold": True}) raised "'bool' object has no attribute 'build'";
    clipping=True "'bool' object is not iterable" (rev45): refused naming what is wanted."""
    with pytest.raises(EngineError, match="must be a dict") as err:
        DPEngine(torch.nn.Linear(3, 2), clipping, gradient_noise_multiplier=1.0, expected_batch_size=4)
    assert "kind" in err.value.hint or "threshold" in err.value.hint
