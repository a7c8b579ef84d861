"""Modules that mix samples or keep data, for the certificate's tests (docs/certificate.md, "The
certificate"): each must be refused, naming it."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Center(nn.Module):
    """x - x.mean(0): every sample's output depends on the others (no parameter, no class to refuse)."""

    def forward(self, x):
        return x - x.mean(0)


class FunctionalBatchNorm(nn.Module):
    """F.batch_norm called functionally with running buffers: batch statistics, and the data's
    statistics in the state_dict."""

    def __init__(self, width: int):
        super().__init__()
        self.register_buffer("running_mean", torch.zeros(width))
        self.register_buffer("running_var", torch.ones(width))

    def forward(self, x):
        return F.batch_norm(x, self.running_mean, self.running_var, training=True)


class CopyRow(nn.Module):
    """A buffer that copies the batch's first row into itself (released verbatim with the model)."""

    def __init__(self, width: int):
        super().__init__()
        self.register_buffer("row", torch.zeros(width))

    def forward(self, x):
        self.row.copy_(x[0].detach())
        return x
