"""Per-sample losses: ``loss_fn(model, batch) -> Tensor[b]``, one loss per example.

DP-SGD clips each example's gradient, so the engine needs the loss of every example
separately, never a batch mean. A :class:`PerSampleLoss` is two steps, kept apart so the
evaluation and the membership-inference audit can reuse the model outputs:

- ``forward(model, batch)``: the model's outputs (logits) for a batch;
- ``criterion(outputs, batch)``: the per-sample losses from those outputs.

Batches are dicts of tensors as made by :mod:`dpclip.data` (``features`` or
``input_ids`` / ``attention_mask``, and ``labels``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from dpclip.data.columns import IGNORE_INDEX
from dpclip.errors import DpclipError

Batch = dict[str, torch.Tensor]


# ----------------------------------------------------------------------- forwards

def forward_features(model: nn.Module, batch: Batch) -> torch.Tensor:
    """Plain modules on tables and images: ``model(features)``."""
    return model(batch["features"])


def forward_token_ids(model: nn.Module, batch: Batch) -> torch.Tensor:
    """Plain (custom) modules on text: ``model(input_ids)``."""
    return model(batch["input_ids"])


def forward_transformers(model: nn.Module, batch: Batch) -> torch.Tensor:
    """transformers models: logits from ``input_ids`` and ``attention_mask``."""
    with no_generation_cache(model):
        return model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits


@contextmanager
def no_generation_cache(model: nn.Module) -> Iterator[None]:
    """A training forward builds no generation cache (``config.use_cache`` off for the call, as
    it was after): layers that hold their own parameters (Jamba's and Bamba's mixers, gpt-oss'
    attention sinks) would otherwise get a cache whose updates the engine's per-sample
    recomputation cannot replay (docs/supported-models.md, "What is refused"). Logits are unchanged."""
    config = getattr(model, "config", None)
    if config is None or not getattr(config, "use_cache", False):
        yield
        return
    config.use_cache = False
    try:
        yield
    finally:
        config.use_cache = True


# --------------------------------------------------------------------- criterions

def cross_entropy(outputs: torch.Tensor, batch: Batch) -> torch.Tensor:
    """Classification: cross-entropy of logits ``[b, C]`` against class ids ``[b]``."""
    return F.cross_entropy(outputs, batch["labels"], reduction="none")


def squared_error(outputs: torch.Tensor, batch: Batch) -> torch.Tensor:
    """Regression: squared error per example (mean over output dimensions, if several)."""
    labels = batch["labels"].to(outputs.dtype)
    errors = outputs.reshape(len(outputs), -1) - labels.reshape(len(labels), -1)
    return errors.pow(2).mean(dim=1)


def next_token_cross_entropy(logits: torch.Tensor, batch: Batch) -> torch.Tensor:
    """Causal LM: each example's mean cross-entropy over its predicted, non-padding tokens.

    Position t predicts token t + 1; targets equal to -100 (padding) do not count. An
    example with no target token (a single token) has loss 0 rather than 0/0.
    """
    predictions = logits[:, :-1, :]
    targets = batch["labels"][:, 1:]
    token_losses = F.cross_entropy(predictions.transpose(1, 2), targets,
                                   ignore_index=IGNORE_INDEX, reduction="none")
    counts = (targets != IGNORE_INDEX).sum(dim=1)
    return token_losses.sum(dim=1) / counts.clamp(min=1).to(token_losses.dtype)


@dataclass(frozen=True)
class CustomCriterion:
    """A user function ``fn(outputs, labels) -> Tensor[b]``, checked to give one loss per example."""

    fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    target: str

    def __call__(self, outputs: torch.Tensor, batch: Batch) -> torch.Tensor:
        losses = self.fn(outputs, batch["labels"])
        expected = (len(batch["labels"]),)
        if not isinstance(losses, torch.Tensor) or tuple(losses.shape) != expected:
            shape = tuple(losses.shape) if isinstance(losses, torch.Tensor) else type(losses).__name__
            raise DpclipError(f"custom loss {self.target!r} returned {shape}, not one loss per example {expected}",
                              "compute the loss with reduction='none' (per example), never a batch mean")
        return losses


# --------------------------------------------------------------------------- loss

@dataclass(frozen=True)
class PerSampleLoss:
    """``loss_fn(model, batch) -> Tensor[b]``: ``criterion(forward(model, batch), batch)``."""

    forward: Callable[[nn.Module, Batch], torch.Tensor]
    criterion: Callable[[torch.Tensor, Batch], torch.Tensor]

    def __call__(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        batch = batch_on_model_device(model, batch)
        return self.criterion(self.forward(model, batch), batch)


def batch_on_model_device(model: nn.Module, batch: Batch) -> Batch:
    """``batch`` on the device of ``model``'s parameters, the batch itself where it is there
    already (the CPU; ``training.device``, docs/training.md): every forward of a run, private,
    public or diagnostic, goes through :class:`PerSampleLoss`, so the rows move here, one
    batch at a time, and the data stays where it was loaded."""
    device = next((p.device for p in model.parameters()), None)
    if device is None or all(not isinstance(t, torch.Tensor) or t.device == device for t in batch.values()):
        return batch
    return {name: t.to(device) if isinstance(t, torch.Tensor) else t for name, t in batch.items()}
