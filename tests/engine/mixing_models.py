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


class _MeanInTheBackward(torch.autograd.Function):
    """The identity forward, whose backward adds the batch's mean gradient to each row."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad + grad.mean(0, keepdim=True)


class MixingBackward(nn.Module):
    """Each sample's output is its own; its gradient is not (a custom autograd.Function)."""

    def forward(self, x):
        return _MeanInTheBackward.apply(x)


class SavedTensorsMixed(nn.Module):
    """A tanh whose saved activations come back mixed (saved_tensors_hooks' unpack adds the batch
    mean when there are several rows): the forward is per sample, the backward is not."""

    def forward(self, x):
        def unpack(t):
            return t + t.mean(0, keepdim=True) if t.dim() == 2 and t.shape[0] > 1 else t
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t, unpack):
            return torch.tanh(x)


class DetachedMean(nn.Module):
    """x + x.detach().mean(0): the coupling is a constant to autograd, not to the outputs."""

    def forward(self, x):
        return x + x.detach().mean(0)


class GlobalThreshold(nn.Module):
    """torch.where on a condition taken over the whole batch (its maximum)."""

    def forward(self, x):
        return torch.where(x > 0.5 * x.max(), x, torch.zeros_like(x))


class RunningAverageOverRows(nn.Module):
    """A cumulative mean along the batch axis: row k depends on rows 0..k."""

    def forward(self, x):
        return torch.cumsum(x, 0) / torch.arange(1, x.shape[0] + 1, dtype=x.dtype).unsqueeze(1)


def mixing_gradient_pre_hook(module: nn.Module) -> nn.Module:
    """``module`` with a full backward pre-hook that adds the batch's mean output gradient to each row."""
    module.register_full_backward_pre_hook(lambda m, grad: (grad[0] + grad[0].mean(0, keepdim=True),))
    return module


class BatchMeanImputation(nn.Module):
    """Missing features (NaN) filled with the batch's mean of that feature: only the rows that miss
    one depend on the others (the rest are their own)."""

    def forward(self, x):
        return torch.where(torch.isnan(x), torch.nanmean(x, 0, keepdim=True).expand_as(x), x)


class _SwapInTheBackward(torch.autograd.Function):
    """The identity forward, whose backward swaps the gradients of rows 1 and 2."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        perm = list(range(grad.shape[0]))
        if len(perm) > 2:
            perm[1], perm[2] = 2, 1
        return grad[perm]


class NoisyEncoderSwappingInTraining(nn.Module):
    """A transformer layer with dropout and a draw computed with its input (torch.normal(mean, std)):
    the step cannot be replayed, so the certificate checks its sums in eval mode; in training mode
    only, the backward swaps rows 1 and 2 (row 1's gradient is sample 2's loss through sample 1's
    activations), which eval mode cannot see."""

    def __init__(self, width: int = 8, classes: int = 3):
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(width, 2, 16, dropout=0.2, batch_first=True)
        self.proj = nn.Linear(width, width)
        self.head = nn.Linear(width, classes)

    def forward(self, x):
        h = self.proj(self.layer(x))
        if self.training:
            h = _SwapInTheBackward.apply(h * torch.normal(torch.ones_like(h), 0.1))
        return self.head(torch.tanh(h).mean(1))


class DropoutOverSwappedRows(nn.Module):
    """Dropout after h + h[perm].detach(), perm swapping rows 1 and 2: a forward coupling the replay
    alone cannot tell from draws it cannot cut, so the batch is replayed (mode batch)."""

    def __init__(self):
        super().__init__()
        self.dropout = nn.Dropout(0.2)

    def forward(self, x):
        perm = list(range(x.shape[0]))
        if len(perm) > 2:
            perm[1], perm[2] = 2, 1
        return self.dropout(x + 0.5 * x[perm].detach())
