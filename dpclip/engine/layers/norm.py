"""Normalisation layers with an elementwise affine: ``y = x̂ ⊙ w + b`` (docs/layer-rules.md).

The normalisation x -> x̂ has no parameters and runs under ordinary autograd (in
``prepare``); only the affine is book-kept. Its per-sample gradients are tiny ([B, C])
so they are instantiated: dw_i = Σ_{other axes} b ⊙ x̂, db_i = Σ b.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dpclip.engine.factors import Dense, Use
from dpclip.engine.layers import (Example, LayerRule, example_tensor, expand_batch,
                                  register_layer_rule, seeded)
from dpclip.engine.precision import LOW_PRECISION, widened
from dpclip.torch_compat import InstanceNormBase

_CHANNEL_NORMS = (nn.GroupNorm, InstanceNormBase)


def _affine_shape(m, x):
    """Shape that broadcasts the affine parameters against x."""
    if isinstance(m, _CHANNEL_NORMS):
        return (1, x.shape[1]) + (1,) * (x.dim() - 2)
    return tuple(m.weight.shape)


class AffineNormRule(LayerRule):
    """The affine of a norm layer; subclasses say how x is normalised."""

    name = "affine_norm"

    def normalise(self, m, x):
        raise NotImplementedError

    def prepare(self, m, x, batch_hint):
        # A half-precision input is normalised in float32 and the output rounded once, as
        # torch's own fused norm kernels do (``info``: the output dtype); CUDA autocast runs
        # norms in float32 and returns float32, so there the output stays float32.
        x = expand_batch(x, batch_hint)
        low = x.dtype in LOW_PRECISION and not (x.is_cuda and torch.is_autocast_enabled("cuda"))
        return self.normalise(m, widened(x)), (x.dtype if low else None)

    def forward(self, m, xhat, info):
        shape = _affine_shape(m, xhat)
        bias = getattr(m, "bias", None)
        if bias is None:
            y = xhat * m.weight.view(shape)
        else:
            y = torch.addcmul(bias.view(shape), xhat, m.weight.view(shape))
        return y if info is None else y.to(info)

    def input_grad(self, m, xhat, gy, info):
        dtype = torch.promote_types(gy.dtype, xhat.dtype)
        return gy.to(dtype) * m.weight.view(_affine_shape(m, xhat)).to(dtype)

    def uses(self, m, xhat, gy, info):
        if isinstance(m, _CHANNEL_NORMS):
            dims = tuple(range(2, xhat.dim()))
        else:
            dims = tuple(range(1, xhat.dim() - m.weight.dim()))
        gy = widened(gy)   # sums over positions in float32, not in the output's bf16
        weight_grad = (gy * xhat).sum(dims) if dims else gy * xhat
        bias_grad = gy.sum(dims) if dims else gy
        uses: dict[str, Use] = {"weight": Dense(weight_grad)}
        if getattr(m, "bias", None) is not None:
            uses["bias"] = Dense(bias_grad)
        return uses


# Where a fused LayerNorm's backward runs once per sample (LayerNormRule._per_sample_backward)
PER_SAMPLE_BACKWARD_DEVICES = ("cpu",)


class _Statistics:
    """The mean and 1/std a fused LayerNorm call's forward found, for its backward; on the
    CPU, the per-sample weight and bias gradients its input gradient found alongside."""

    __slots__ = ("mean", "rstd", "weight_grad", "bias_grad")

    def __init__(self):
        self.weight_grad = self.bias_grad = None


@register_layer_rule(nn.LayerNorm)
class LayerNormRule(AffineNormRule):
    """A float32 or float64 input outside autocast is normalised and scaled by torch's fused
    kernel, which also returns the mean and 1/std of each position; the backward's input
    gradient is the fused backward's, and x̂ = (x - mean)·rstd is recomputed for the
    per-sample gradients. The two-step path of :class:`AffineNormRule` (x̂ under autograd,
    then the affine) read and wrote every activation twice more in each direction and held
    x̂ beside x (CHANGELOG). Other inputs (half precision, autocast) keep that path."""

    def feature_dims(self, m):   # position-wise over the leading axes
        return len(m.normalized_shape)

    def normalise(self, m, x):
        return F.layer_norm(x, m.normalized_shape, None, None, m.eps)

    @staticmethod
    def _fused(m, x) -> bool:
        return (x.dtype in (torch.float32, torch.float64) and m.weight is not None
                and m.weight.dtype == x.dtype
                and (m.bias is None or m.bias.dtype == x.dtype)
                and not torch.is_autocast_enabled(x.device.type))

    def prepare(self, m, x, batch_hint):
        if self._fused(m, x):
            return x, _Statistics()
        return super().prepare(m, x, batch_hint)

    def forward(self, m, x, info):
        if not isinstance(info, _Statistics):
            return super().forward(m, x, info)
        y, info.mean, info.rstd = torch.native_layer_norm(x, m.normalized_shape, m.weight, m.bias, m.eps)
        return y

    def input_grad(self, m, x, gy, info):
        if not isinstance(info, _Statistics):
            return super().input_grad(m, x, gy, info)
        if x.device.type in PER_SAMPLE_BACKWARD_DEVICES and gy.dtype == x.dtype:
            return self._per_sample_backward(m, x, gy, info)
        dtype = torch.promote_types(gy.dtype, x.dtype)
        bias = None if m.bias is None else m.bias.to(dtype)
        return torch.ops.aten.native_layer_norm_backward(
            gy.to(dtype), x.to(dtype), m.normalized_shape, info.mean.to(dtype), info.rstd.to(dtype),
            m.weight.to(dtype), bias, [True, False, False])[0]

    @staticmethod
    def _per_sample_backward(m, x, gy, info):
        """The fused backward once per sample (on the CPU): sample i's input gradient and its
        own weight and bias gradients Σ_t gy ⊙ x̂ and Σ_t gy in one pass over its x and gy,
        kept in ``info`` for :meth:`uses`. For GPT-2 small's norms on the CPU: 0.53 ms against
        0.82 for the batch's input gradient, x̂ and the two sums (B 4, T 256), 0.91 against
        1.61 (B 2, T 1024; benchmarks/results/norm_layernorm_cpu.txt). Not on a GPU: B
        launches of it per norm would grow with the batch."""
        grad_x = x.new_empty(x.shape)   # contiguous: each sample's rows are written in place
        info.weight_grad = x.new_empty(x.shape[0], *m.weight.shape)
        if m.bias is not None:
            info.bias_grad = x.new_empty(x.shape[0], *m.bias.shape)
        for i in range(x.shape[0]):
            if m.bias is not None:   # written in place
                torch.ops.aten.native_layer_norm_backward.out(
                    gy[i], x[i], m.normalized_shape, info.mean[i], info.rstd[i], m.weight, m.bias,
                    [True, True, True], out0=grad_x[i], out1=info.weight_grad[i], out2=info.bias_grad[i])
                continue
            # the .out form needs a bias gradient to write: without a bias, copied
            grad_xi, weight_grad_i, _ = torch.ops.aten.native_layer_norm_backward(
                gy[i], x[i], m.normalized_shape, info.mean[i], info.rstd[i], m.weight, None,
                [True, True, False])
            grad_x[i].copy_(grad_xi)
            info.weight_grad[i].copy_(weight_grad_i)
        return grad_x

    def uses(self, m, x, gy, info):
        if isinstance(info, _Statistics):
            if info.weight_grad is not None:
                uses: dict[str, Use] = {"weight": Dense(info.weight_grad)}
                if info.bias_grad is not None:
                    uses["bias"] = Dense(info.bias_grad)
                info.weight_grad = info.bias_grad = None
                return uses
            x = (x - info.mean) * info.rstd   # x̂, as the forward formed it
        return super().uses(m, x, gy, info)

    def examples(self):
        return [Example(seeded(nn.LayerNorm(4), 8), (example_tensor(5, 3, 4, seed=8),)),
                Example(seeded(nn.LayerNorm((2, 3), bias=False), 9),
                        (example_tensor(5, 2, 3, seed=9),))]


@register_layer_rule(nn.GroupNorm)
class GroupNormRule(AffineNormRule):
    def normalise(self, m, x):
        return F.group_norm(x, m.num_groups, None, None, m.eps)

    def examples(self):
        return [Example(seeded(nn.GroupNorm(2, 4), 10), (example_tensor(5, 4, 3, seed=10),))]


@register_layer_rule(nn.RMSNorm)
class RMSNormRule(AffineNormRule):
    def feature_dims(self, m):
        return len(m.normalized_shape)

    def normalise(self, m, x):
        return F.rms_norm(x, m.normalized_shape, None, m.eps)

    def examples(self):
        return [Example(seeded(nn.RMSNorm(4), 11), (example_tensor(5, 3, 4, seed=11),))]


class InstanceNormRule(AffineNormRule):
    def normalise(self, m, x):
        return F.instance_norm(x, None, None, None, None, True, 0.0, m.eps)

    def examples(self):
        return [Example(seeded(nn.InstanceNorm1d(3, affine=True), 12), (example_tensor(5, 3, 4, seed=12),)),
                Example(seeded(nn.InstanceNorm2d(2, affine=True), 13),
                        (example_tensor(5, 2, 3, 3, seed=13),)),
                Example(seeded(nn.InstanceNorm3d(2, affine=True), 14),
                        (example_tensor(5, 2, 2, 2, 3, seed=14),))]


INSTANCE_NORM_RULE = InstanceNormRule()
for _cls in (nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d):
    register_layer_rule(_cls, INSTANCE_NORM_RULE)
