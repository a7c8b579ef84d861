"""The optimizer and learning-rate schedule a recipe asks for (docs/training.md).

Training and step timing (:mod:`dpclip.tuning.timing`) build the optimizer here, so a
timed step updates the weights the way the run would.
"""

from __future__ import annotations

import math

import torch


def build_optimizer(config, params) -> torch.optim.Optimizer:
    """``recipe.training.optimizer`` over ``params`` (sgd, adam or adamw)."""
    if config.kind == "sgd":
        return torch.optim.SGD(params, lr=config.lr, momentum=config.momentum, nesterov=config.nesterov,
                               weight_decay=config.weight_decay)
    if config.kind == "adam":
        return torch.optim.Adam(params, lr=config.lr, betas=config.betas, eps=config.eps,
                                weight_decay=config.weight_decay)
    return torch.optim.AdamW(params, lr=config.lr, betas=config.betas, eps=config.eps,
                             weight_decay=config.weight_decay)


def lr_factor(schedule, step: int, total_steps: int) -> float:
    """Multiplier of the base lr at ``step`` (0-based).

    Linear warmup ``(step + 1) / W`` for the first W steps, then with progress
    ``p = (step − W) / (T − W)`` clipped to [0, 1] and final fraction f:
    constant 1, linear ``1 − (1 − f)·p``, or cosine ``f + (1 − f)·(1 + cos πp)/2``
    (Loshchilov & Hutter 2017, SGDR, §3 without restarts)."""
    if schedule.warmup_steps and step < schedule.warmup_steps:
        return (step + 1) / schedule.warmup_steps
    if schedule.kind == "constant":
        return 1.0
    span = max(total_steps - schedule.warmup_steps, 1)
    progress = min(max(step - schedule.warmup_steps, 0) / span, 1.0)
    final = schedule.final_lr_fraction
    if schedule.kind == "linear":
        return 1.0 - (1.0 - final) * progress
    return final + (1.0 - final) * 0.5 * (1.0 + math.cos(math.pi * progress))


class LrSchedule:
    """Sets every parameter group's lr to its base lr × :func:`lr_factor` before a step."""

    def __init__(self, optimizer: torch.optim.Optimizer, schedule, total_steps: int):
        self.optimizer = optimizer
        self.schedule = schedule
        self.total_steps = total_steps
        self.base_lrs = [group["lr"] for group in optimizer.param_groups]

    def apply(self, step: int) -> float:
        """Set the lr of 0-based ``step``; returns the first group's lr."""
        factor = lr_factor(self.schedule, step, self.total_steps)
        for group, base in zip(self.optimizer.param_groups, self.base_lrs):
            group["lr"] = base * factor
        return self.optimizer.param_groups[0]["lr"]
