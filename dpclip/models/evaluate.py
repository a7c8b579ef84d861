"""Evaluation on a split (usually the held-out test set): loss and accuracy or perplexity.

Evaluation looks at held-out data only and its numbers are for the user; evaluating on
the private training set and publishing the result would be a release the ledger does
not cover, which is the caller's responsibility.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from dpclip.data.columns import IGNORE_INDEX
from dpclip.data.dataset import select


@torch.no_grad()
def evaluate(model: nn.Module, loss_fn, tensors: dict[str, torch.Tensor], task: str,
             batch_size: int = 256) -> dict[str, float]:
    """Mean loss over ``tensors`` (a split), plus accuracy (classification) or perplexity
    (causal-lm, from the token-weighted mean cross-entropy, which is then the loss).

    The model is put in eval mode (no dropout) and restored to its previous mode.
    ``loss_fn`` is a :class:`~dpclip.models.losses.PerSampleLoss`; any other callable
    ``loss_fn(model, batch) -> Tensor[b]`` gives the loss alone.
    """
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    num_examples = len(tensors["labels"])
    splits_outputs = hasattr(loss_fn, "forward") and hasattr(loss_fn, "criterion")
    loss_sum, weight_sum = 0.0, 0.0
    correct, scored = 0, 0  # accuracy needs logits, so only examples with [b, C] outputs count
    try:
        for start in range(0, num_examples, batch_size):
            batch = {name: t.to(device) for name, t in
                     select(tensors, slice(start, start + batch_size)).items()}
            if splits_outputs:
                outputs = loss_fn.forward(model, batch)
                losses = loss_fn.criterion(outputs, batch)
            else:
                outputs, losses = None, loss_fn(model, batch)
            if task == "causal-lm":
                # Weight each example by its predicted tokens: perplexity is per token.
                weights = (batch["labels"][:, 1:] != IGNORE_INDEX).sum(dim=1).to(losses.dtype)
            else:
                weights = torch.ones_like(losses)
            loss_sum += float((losses * weights).sum())
            weight_sum += float(weights.sum())
            if task == "classification" and outputs is not None and outputs.dim() == 2:
                correct += int((outputs.argmax(dim=1) == batch["labels"]).sum())
                scored += len(outputs)
    finally:
        model.train(was_training)

    loss = loss_sum / max(weight_sum, 1.0)
    metrics = {"loss": loss}
    if task == "classification" and scored > 0:
        metrics["accuracy"] = correct / scored
    if task == "causal-lm":
        metrics["perplexity"] = math.exp(min(loss, 700.0))  # exp(700) is near float's limit
    return metrics
