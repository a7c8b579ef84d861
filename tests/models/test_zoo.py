import math

import numpy as np
import pytest
import torch
from torch import nn

from dpclip.data import select
from dpclip.data.dataset import PrivateData
from dpclip.errors import DpclipError
from dpclip.models import build_model, evaluate
from dpclip.recipe.schema import CNNModel, MLPModel


def first_rows(split, count=8):
    return select(split, torch.arange(count))


def test_mlp_maps_flattened_inputs_through_the_hidden_sizes_to_one_logit_per_class(digits_data):
    model, loss_fn = build_model(MLPModel(kind="mlp", hidden=[32, 16], activation="tanh"), digits_data)
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert [(m.in_features, m.out_features) for m in linears] == [(64, 32), (32, 16), (16, 10)]
    assert sum(isinstance(m, nn.Tanh) for m in model.modules()) == 2
    losses = loss_fn(model, first_rows(digits_data.train))
    assert losses.shape == (8,) and torch.isfinite(losses).all()


def test_mlp_per_sample_losses_are_each_examples_own_cross_entropy(digits_data):
    model, loss_fn = build_model(MLPModel(kind="mlp", hidden=[16]), digits_data)
    batch = first_rows(digits_data.train, 5)
    alone = torch.stack([loss_fn(model, select(batch, [i]))[0] for i in range(5)])
    assert torch.allclose(loss_fn(model, batch), alone, atol=1e-6)
    mean = nn.functional.cross_entropy(model(batch["features"]), batch["labels"])
    assert torch.allclose(loss_fn(model, batch).mean(), mean)


def regression_data(num_examples=12):
    generator = torch.Generator().manual_seed(0)
    features = torch.randn(num_examples, 3, generator=generator)
    split = {"features": features, "labels": features.sum(dim=1)}
    rows = np.arange(num_examples)
    return PrivateData(train=split, test=split, task="regression", input_shape=(3,),
                       train_indices=rows, test_indices=rows, fingerprint="-", source="test")


def test_mlp_for_regression_has_one_output_and_a_squared_error_per_sample():
    data = regression_data()
    model, loss_fn = build_model(MLPModel(kind="mlp", hidden=[4]), data)
    assert model[-1].out_features == 1
    losses = loss_fn(model, data.train)
    expected = (model(data.train["features"]).squeeze(1) - data.train["labels"]) ** 2
    assert losses.shape == (12,) and torch.allclose(losses, expected)
    metrics = evaluate(model, loss_fn, data.test, data.task, batch_size=5)
    assert set(metrics) == {"loss"} and math.isclose(metrics["loss"], expected.mean().item(), rel_tol=1e-5)


def test_cnn_on_digit_images_uses_group_norm_and_no_batch_norm(digit_images):
    model, loss_fn = build_model(CNNModel(kind="cnn", channels=[8, 16], norm_groups=4, hidden=16), digit_images)
    norms = [m for m in model.modules() if isinstance(m, nn.GroupNorm)]
    assert [(m.num_groups, m.num_channels) for m in norms] == [(4, 8), (4, 16)]
    assert not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())
    convs = [m for m in model.modules() if isinstance(m, nn.Conv2d)]
    assert [c.padding for c in convs] == [(1, 1), (1, 1)]
    losses = loss_fn(model, first_rows(digit_images.train))
    assert losses.shape == (8,) and torch.isfinite(losses).all()
    assert model(digit_images.train["features"][:2]).shape == (2, 10)


def test_cnn_pool_size_keeps_that_many_positions_per_channel_for_the_dense_layer(digit_images):
    model, _ = build_model(CNNModel(kind="cnn", channels=[8, 16], pool_size=4, hidden=16), digit_images)
    pool = next(m for m in model.modules() if isinstance(m, nn.AdaptiveAvgPool2d))
    first_dense = next(m for m in model.modules() if isinstance(m, nn.Linear))
    assert pool.output_size == 4 and first_dense.in_features == 16 * 4 * 4
    # Each pooled cell is the mean of its own 2x2 patch of the last conv output.
    images = digit_images.train["features"][:3]
    conv_out = model[:6](images)
    assert torch.allclose(model[6](conv_out)[:, :, 0, 0], conv_out[:, :, :2, :2].mean(dim=(2, 3)), atol=1e-6)
    default, _ = build_model(CNNModel(kind="cnn", channels=[8, 16], hidden=16), digit_images)
    assert next(m for m in default.modules() if isinstance(m, nn.Linear)).in_features == 16


def test_cnn_refuses_a_pool_size_larger_than_the_image(digit_images):
    with pytest.raises(DpclipError) as info:
        build_model(CNNModel(kind="cnn", pool_size=9), digit_images)
    assert "8x8" in info.value.message and "at most 8" in info.value.hint


def test_cnn_refuses_norm_groups_that_do_not_divide_the_channels(digit_images):
    with pytest.raises(DpclipError) as info:
        build_model(CNNModel(kind="cnn", channels=[8, 12], norm_groups=8), digit_images)
    assert "12" in info.value.message and "[1, 2, 3, 4, 6, 12]" in info.value.hint


def test_cnn_refuses_flat_vectors_and_points_to_as_images(digits_data):
    with pytest.raises(DpclipError) as info:
        build_model(CNNModel(kind="cnn"), digits_data)
    assert "as_images" in info.value.hint


def test_mlp_refuses_text_data(synthetic_text):
    with pytest.raises(DpclipError) as info:
        build_model(MLPModel(kind="mlp"), synthetic_text)
    assert "hf" in info.value.hint


def test_the_same_seed_gives_identical_weights_and_another_seed_different_ones(digit_images):
    config = CNNModel(kind="cnn", channels=[4], norm_groups=2, hidden=8)
    first, _ = build_model(config, digit_images, seed=3)
    again, _ = build_model(config, digit_images, seed=3)
    other, _ = build_model(config, digit_images, seed=4)
    pairs = list(zip(first.state_dict().values(), again.state_dict().values()))
    assert all(torch.equal(a, b) for a, b in pairs)
    assert not torch.equal(first[0].weight, other[0].weight)


def test_building_a_model_leaves_the_global_random_state_untouched(digits_data):
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    build_model(MLPModel(kind="mlp", hidden=[8]), digits_data, seed=0)
    assert torch.equal(torch.rand(3), expected)


def test_evaluate_reports_mean_loss_and_accuracy_over_the_whole_split(digits_data):
    model, loss_fn = build_model(MLPModel(kind="mlp", hidden=[16]), digits_data)
    model.train()
    # 359 rows in batches of 50: the last batch is partial.
    metrics = evaluate(model, loss_fn, digits_data.test, digits_data.task, batch_size=50)
    with torch.no_grad():
        logits = model(digits_data.test["features"])
    expected_accuracy = (logits.argmax(1) == digits_data.test["labels"]).double().mean().item()
    expected_loss = nn.functional.cross_entropy(logits, digits_data.test["labels"]).item()
    assert set(metrics) == {"loss", "accuracy"}
    assert math.isclose(metrics["accuracy"], expected_accuracy)
    assert math.isclose(metrics["loss"], expected_loss, rel_tol=1e-5)
    assert model.training, "evaluate restores the training mode"
