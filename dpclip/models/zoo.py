"""Small built-in models for tables and images: ``mlp`` and ``cnn``.

Both read their input size and number of outputs from the data (``input_shape``,
``num_classes``; one output for regression). Neither uses BatchNorm, which mixes the
examples of a batch and so breaks per-example privacy: the CNN normalises with GroupNorm.
"""

from __future__ import annotations

import math

from torch import nn

from dpclip.errors import DpclipError

ACTIVATIONS = {"relu": nn.ReLU, "tanh": nn.Tanh, "gelu": nn.GELU}


def output_size(data) -> int:
    """Logits per class for classification, one number for regression."""
    return data.num_classes if data.task == "classification" else 1


def _require_numeric_features(data, kind: str) -> None:
    if data.task not in ("classification", "regression") or "features" not in data.train:
        raise DpclipError(f"model.kind {kind!r} needs a table or images (classification or regression), "
                          f"but the data is {data.task} text",
                          "use model.kind: hf for text, or a custom model")


def build_mlp(config, data) -> nn.Sequential:
    """Flatten, then Linear + activation per ``hidden`` size, then a Linear to the outputs."""
    _require_numeric_features(data, "mlp")
    activation = ACTIVATIONS[config.activation]
    layers: list[nn.Module] = [nn.Flatten()]
    width = math.prod(data.input_shape)
    for hidden in config.hidden:
        layers += [nn.Linear(width, hidden), activation()]
        width = hidden
    layers.append(nn.Linear(width, output_size(data)))
    return nn.Sequential(*layers)


def build_cnn(config, data) -> nn.Sequential:
    """Conv -> GroupNorm -> ReLU per entry of ``channels``, average pooling to
    ``pool_size`` x ``pool_size`` positions (1: global average), Linear(``hidden``) -> ReLU ->
    Linear to the outputs. Sized for 1x8x8 digits and up."""
    _require_numeric_features(data, "cnn")
    if len(data.input_shape) != 3:
        raise DpclipError(f"model.kind 'cnn' needs images [channels, height, width], "
                          f"but examples have shape {tuple(data.input_shape)}",
                          "for builtin digits set data.as_images: true; for tables use model.kind: mlp")
    if config.kernel_size % 2 == 0:
        # An odd kernel keeps the image size with symmetric integer padding, which the
        # engine's unfold-based per-sample norms handle directly.
        raise DpclipError(f"model.kernel_size {config.kernel_size} is even",
                          "use an odd kernel_size (3, 5, ...): padding then keeps the image size")
    layers: list[nn.Module] = []
    in_channels = data.input_shape[0]
    for channels in config.channels:
        if channels % config.norm_groups != 0:
            divisors = [g for g in range(1, channels + 1) if channels % g == 0]
            raise DpclipError(f"model.norm_groups {config.norm_groups} does not divide {channels} channels",
                              f"GroupNorm needs groups that divide every entry of model.channels; "
                              f"for {channels} channels use one of {divisors}")
        layers += [nn.Conv2d(in_channels, channels, config.kernel_size, padding=config.kernel_size // 2),
                   nn.GroupNorm(config.norm_groups, channels),
                   nn.ReLU()]
        in_channels = channels
    if config.pool_size > min(data.input_shape[1:]):
        raise DpclipError(f"model.pool_size {config.pool_size} is larger than the "
                          f"{data.input_shape[1]}x{data.input_shape[2]} images",
                          f"use a pool_size of at most {min(data.input_shape[1:])}")
    layers += [nn.AdaptiveAvgPool2d(config.pool_size), nn.Flatten(),
               nn.Linear(in_channels * config.pool_size ** 2, config.hidden), nn.ReLU(),
               nn.Linear(config.hidden, output_size(data))]
    return nn.Sequential(*layers)
