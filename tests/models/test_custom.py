import sys
import textwrap

import pytest
import torch

from dpclip.data import select
from dpclip.errors import DpclipError, EngineError
from dpclip.models import BATCHNORM_HINT, build_model, refuse_batchnorm
from dpclip.recipe.schema import CustomModel

MODULE = "dpclip_test_custom_zoo"

SOURCE = textwrap.dedent('''
    import math
    import torch
    from torch import nn

    seen = {}

    def linear(input_shape, num_classes, bias=True):
        seen.update(input_shape=input_shape, num_classes=num_classes)
        return nn.Sequential(nn.Flatten(), nn.Linear(math.prod(input_shape), num_classes, bias=bias))

    def only_width(width):
        return nn.Linear(64, width)

    def with_batchnorm(input_shape, num_classes):
        return nn.Sequential(nn.Flatten(), nn.Linear(64, 8), nn.BatchNorm1d(8), nn.Linear(8, num_classes))

    def not_a_module():
        return "a string"

    def hinge(outputs, labels):
        correct = outputs.gather(1, labels[:, None]).squeeze(1)
        return torch.relu(1 - correct[:, None] + outputs).sum(dim=1) - 1

    def batch_mean(outputs, labels):
        return nn.functional.cross_entropy(outputs, labels)
''')


@pytest.fixture
def custom_module(tmp_path, monkeypatch):
    """A user module on the path, imported fresh by each test."""
    (tmp_path / f"{MODULE}.py").write_text(SOURCE)
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop(MODULE, None)
    yield
    sys.modules.pop(MODULE, None)


def custom(name, **fields):
    return CustomModel(kind="custom", target=f"{MODULE}:{name}", **fields)


def test_a_custom_factory_gets_its_kwargs_and_the_data_sizes_it_asks_for(custom_module, digits_data):
    model, loss_fn = build_model(custom("linear", kwargs={"bias": False}), digits_data)
    assert sys.modules[MODULE].seen == {"input_shape": (64,), "num_classes": 10}
    assert model[1].bias is None
    losses = loss_fn(model, select(digits_data.train, torch.arange(7)))
    assert losses.shape == (7,) and torch.isfinite(losses).all()


def test_data_sizes_are_not_passed_to_a_factory_that_does_not_name_them(custom_module, digits_data):
    model, _ = build_model(custom("only_width", kwargs={"width": 10}), digits_data)
    assert model.out_features == 10


def test_a_custom_loss_function_gives_the_per_sample_losses(custom_module, digits_data):
    model, loss_fn = build_model(custom("linear", loss=f"{MODULE}:hinge"), digits_data)
    batch = select(digits_data.train, torch.arange(6))
    outputs = model(batch["features"])
    assert torch.allclose(loss_fn(model, batch), sys.modules[MODULE].hinge(outputs, batch["labels"]))


def test_a_custom_loss_that_returns_a_batch_mean_is_refused_when_called(custom_module, digits_data):
    model, loss_fn = build_model(custom("linear", loss=f"{MODULE}:batch_mean"), digits_data)
    with pytest.raises(DpclipError) as info:
        loss_fn(model, select(digits_data.train, torch.arange(4)))
    assert "one loss per example" in info.value.message and "reduction='none'" in info.value.hint


@pytest.mark.parametrize("target, expected", [
    ("dpclip_no_such_module:make", "cannot import"),
    (f"{MODULE}:no_such_factory", "has no 'no_such_factory'"),
])
def test_a_custom_target_that_does_not_import_is_a_clear_error(custom_module, digits_data, target, expected):
    with pytest.raises(DpclipError) as info:
        build_model(CustomModel(kind="custom", target=target), digits_data)
    assert expected in info.value.message and info.value.hint


def test_wrong_kwargs_and_non_module_results_are_clear_errors(custom_module, digits_data):
    with pytest.raises(DpclipError, match="does not accept"):
        build_model(custom("only_width", kwargs={"depth": 3}), digits_data)
    with pytest.raises(DpclipError, match="not a torch nn.Module"):
        build_model(custom("not_a_module"), digits_data)


def test_a_model_with_batchnorm_is_refused_naming_the_module_with_the_groupnorm_hint(custom_module, digits_data):
    with pytest.raises(EngineError) as info:
        build_model(custom("with_batchnorm"), digits_data)
    assert "BatchNorm1d" in info.value.message and "'2'" in info.value.message
    assert info.value.hint == BATCHNORM_HINT and "GroupNorm" in info.value.hint


def test_refuse_batchnorm_finds_nested_batchnorm_and_accepts_group_norm():
    nested = torch.nn.Sequential(torch.nn.Sequential(torch.nn.Conv2d(1, 4, 3), torch.nn.BatchNorm2d(4)))
    with pytest.raises(EngineError, match="'0.1'"):
        refuse_batchnorm(nested)
    refuse_batchnorm(torch.nn.Sequential(torch.nn.Conv2d(1, 4, 3), torch.nn.GroupNorm(2, 4)))
