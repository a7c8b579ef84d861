"""Grouping styles: which parameters are clipped together."""

import pytest
from torch import nn

from dpclip.engine import build_groups
from dpclip.errors import EngineError
from tests.engine.conftest import mlp, tiny_bert, tiny_gpt2


def _members(groups):
    return [[groups.params[i].name for i in m] for m in groups.members]


def test_all_layer_is_one_group_and_tied_weights_appear_once():
    model = tiny_gpt2()
    g = build_groups(model, "all-layer")
    assert g.names == ["all"]
    names = _members(g)[0]
    assert "transformer.wte.weight" in names and "lm_head.weight" not in names
    assert g.sizes == [sum(p.numel() for p in model.parameters())]
    assert g.params[0].names == ["transformer.wte.weight", "lm_head.weight"]


def test_layer_groups_weight_and_bias_of_a_module_and_param_splits_them():
    model = mlp()
    layer = build_groups(model, "layer")
    assert layer.names == ["0", "2", "4"]
    assert _members(layer)[0] == ["0.weight", "0.bias"]
    param = build_groups(model, "param")
    assert len(param) == 6 and param.names[1] == "0.bias"


def test_block_finds_transformer_blocks_and_groups_the_rest_by_top_module():
    g = build_groups(tiny_gpt2(), "block")
    assert g.names == ["transformer.wte", "transformer.wpe", "transformer.h.0", "transformer.h.1",
                       "transformer.ln_f"]
    b = build_groups(tiny_bert(), "block")
    assert b.names == ["bert.embeddings", "bert.encoder.layer.0", "bert.encoder.layer.1",
                       "bert.pooler", "classifier"]
    assert "bert.embeddings.LayerNorm.weight" in _members(b)[0]


def test_block_without_blocks_is_refused():
    model = nn.Sequential(nn.Linear(2, 3), nn.ReLU(), nn.Linear(3, 1))
    with pytest.raises(EngineError, match="block"):
        build_groups(model, "block")


@pytest.mark.parametrize("m", [1, 2, 3, 5])
def test_uniform_groups_are_contiguous_and_cut_at_the_nearest_tensor_boundary(m):
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(6)])   # tensors of 64 and 8
    g = build_groups(model, {"uniform": m})
    flat = [i for members in g.members for i in members]
    assert flat == list(range(12)) and all(g.members) and len(g) == m
    total, cum = sum(g.sizes), 0
    for k, size in enumerate(g.sizes[:-1], start=1):
        cum += size
        assert abs(cum - total * k / m) <= 32   # half the largest tensor


def test_uniform_refuses_more_groups_than_tensors():
    with pytest.raises(EngineError, match="only 6"):
        build_groups(mlp(), {"uniform": 7})


def test_explicit_groups_report_orphans_and_duplicates():
    model = mlp()
    g = build_groups(model, {"groups": [[r"^0\."], [r"^2\.", r"^4\."]]})
    assert _members(g) == [["0.weight", "0.bias"], ["2.weight", "2.bias", "4.weight", "4.bias"]]
    with pytest.raises(EngineError) as err:
        build_groups(model, {"groups": [[r"^0\."], [r"weight"]]})
    assert "4.bias" in err.value.message and "0.weight" in err.value.message
    assert "in no group" in err.value.message and "in several groups" in err.value.message


def test_explicit_groups_may_name_either_alias_of_a_tied_weight():
    with pytest.raises(EngineError, match="several groups"):
        build_groups(tiny_gpt2(), {"groups": [["lm_head"], ["^transformer"]]})


def test_stages_cut_in_forward_order_at_named_modules():
    g = build_groups(tiny_gpt2(), {"stages": [r"^transformer\.wte$", r"^transformer\.h\.1$"]})
    first, second = _members(g)
    assert first[0] == "transformer.wte.weight" and first[-1].startswith("transformer.h.0.")
    assert second[0].startswith("transformer.h.1.") and second[-1] == "transformer.ln_f.bias"
    with pytest.raises(EngineError, match="increasing"):
        build_groups(tiny_gpt2(), {"stages": [r"h\.1$", r"h\.0$"]})


def test_a_stage_regex_that_matches_no_module_is_refused_with_a_hint_naming_modules():
    # `dpclip train` printed this error without a hint line
    with pytest.raises(EngineError, match="matches no module") as info:
        build_groups(tiny_gpt2(), {"stages": [r"^transformer\.wte$", "abc"]})
    assert info.value.hint and "transformer" in info.value.hint


def test_frozen_parameters_are_in_no_group():
    model = mlp()
    model[0].requires_grad_(False)
    g = build_groups(model, "layer")
    assert g.names == ["2", "4"]


@pytest.mark.parametrize("bad", ["flat", {"uniform": 0}, {"nope": 1}, {"groups": []}])
def test_unknown_or_malformed_grouping_is_refused(bad):
    with pytest.raises(EngineError):
        build_groups(mlp(), bad)


def test_a_lazy_module_not_yet_initialised_is_refused_with_a_hint():
    from dpclip.engine import DPEngine
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.LazyLinear(3))
    with pytest.raises(EngineError, match=r"2\.weight .*not initialised") as refused:
        DPEngine(model, gradient_noise_multiplier=1.0, expected_batch_size=4)
    assert "forward" in refused.value.hint
