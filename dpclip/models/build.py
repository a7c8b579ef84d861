"""``build_model``: from a recipe's ``model`` section and the loaded data to (model, loss_fn).

The model's sizes come from the data (input shape, classes, vocabulary), its initial
weights from the recipe seed, and it is checked for BatchNorm before anyone trains it.
What an export needs to rebuild the model without the data (the sizes, label names, a
transformers config) is attached to it as ``model.dpclip_model_info`` (:func:`model_info`),
which the checkpoint writes as ``model.json`` (docs/export.md).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn

from dpclip.rng import derived_seed
from dpclip.errors import DpclipError, EngineError, first_line
from dpclip.models.custom import build_custom, custom_criterion
from dpclip.models.hf import build_hf
from dpclip.models.losses import (
    PerSampleLoss,
    cross_entropy,
    forward_features,
    forward_token_ids,
    forward_transformers,
    next_token_cross_entropy,
    squared_error,
)
from dpclip.models.zoo import build_mlp, build_cnn
from dpclip.torch_compat import BatchNormBase

BATCHNORM_HINT = "use GroupNorm; BatchNorm mixes samples and breaks per-example privacy"


def refuse_batchnorm(model: nn.Module) -> None:
    """Raise EngineError naming the first BatchNorm module (its path in the model), if any.

    BatchNorm normalises each example with statistics of the whole batch, so one
    example's gradient depends on the others and per-example clipping bounds nothing.
    """
    for path, module in model.named_modules():
        if isinstance(module, BatchNormBase):
            where = path or "the model itself"
            raise EngineError(f"the model contains {type(module).__name__} at {where!r}", BATCHNORM_HINT)


def _table_criterion(data):
    return cross_entropy if data.task == "classification" else squared_error


def _build(config, data) -> tuple[nn.Module, PerSampleLoss]:
    if config.kind == "mlp":
        return build_mlp(config, data), PerSampleLoss(forward_features, _table_criterion(data))
    if config.kind == "cnn":
        return build_cnn(config, data), PerSampleLoss(forward_features, _table_criterion(data))
    if config.kind == "hf":
        criterion = next_token_cross_entropy if config.task == "causal-lm" else _table_criterion(data)
        return build_hf(config, data), PerSampleLoss(forward_transformers, criterion)
    if config.kind == "custom":
        forward = forward_features if "features" in data.train else forward_token_ids
        criterion = custom_criterion(config.loss, data, config.module_dir)
        return build_custom(config, data), PerSampleLoss(forward, criterion)
    raise DpclipError(f"unknown model.kind {config.kind!r}", "use mlp, cnn, hf or custom")


@contextmanager
def seeded_init(seed: int):
    """Torch's global RNG seeded for a model's initial weights from the recipe ``seed``,
    inside a forked RNG state: the same seed gives the same weights (an export rebuilds a
    LoRA run's public base with it, dpclip/export/model.py), the caller's randomness is kept."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(derived_seed(seed, "model-init"))
        yield


def build_model(config, data, *, seed: int = 0) -> tuple[nn.Module, PerSampleLoss]:
    """The model for a recipe's ``model`` section, sized to ``data`` (a PrivateData), and
    its per-sample loss ``loss_fn(model, batch) -> Tensor[b]``.

    The same seed gives the same initial weights. The global torch RNG is seeded only
    inside a forked RNG state, so building a model leaves the caller's randomness as it was.
    """
    try:
        with seeded_init(seed):
            model, loss_fn = _build(config, data)
    except (MemoryError, RuntimeError) as exc:
        if not _out_of_memory(exc):
            raise
        raise DpclipError(f"the model does not fit in memory: building it failed ({first_line(exc)})",
                          "make the model smaller (model.hidden, channels, lora.r, a transformers config's "
                          "sizes), or use a machine with more memory") from None
    refuse_batchnorm(model)
    model.dpclip_model_info = _describe(config, data)
    return model, loss_fn


def _out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` is an allocation that failed (Python's MemoryError, torch's CPU allocator or CUDA)."""
    text = str(exc)
    return (isinstance(exc, (MemoryError, torch.OutOfMemoryError)) or "can't allocate memory" in text
            or "out of memory" in text.lower())


def _describe(config, data) -> dict:
    return {"kind": config.kind, "task": getattr(config, "task", None) or data.task,
            "input_shape": list(data.input_shape) if data.input_shape is not None else None,
            "num_classes": data.num_classes, "label_names": data.label_names,
            "vocab_size": data.vocab_size, "model": config.model_dump(mode="json")}


def model_info(model: nn.Module) -> dict:
    """What :func:`build_model` recorded about ``model`` (empty for a model built elsewhere),
    plus its transformers config and peft adapter config when it has them."""
    info = dict(getattr(model, "dpclip_model_info", None) or {})
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = getattr(base, "config", None)
    if config is not None and hasattr(config, "to_dict"):
        info["hf_config"] = config.to_dict()
        info["hf_class"] = type(base).__name__
    peft_config = getattr(model, "peft_config", None)
    if peft_config:
        info["peft_config"] = peft_config["default"].to_dict()
    return info
