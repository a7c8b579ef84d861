"""``nn.Linear``, transformers' ``Conv1D`` and ``FalconLinear``: one Bilinear use per call
(docs/layer-rules.md).

For a Linear ``y = a Wᵀ + b`` with W of shape (p, d), sample i's weight gradient is
``G_i = b_iᵀ a_i`` over its T positions: L = output gradient, R = input. ``Conv1D``
stores W transposed, (d, p), so its factors swap. The bias gradient Σ_t b_t is small and
instantiated.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dpclip.engine.factors import Bilinear, Dense, Use
from dpclip.engine.layers import (Example, LayerRule, example_tensor, expand_batch, flat3,
                                  register_lazy_layer_rule, register_layer_rule, seeded)
from dpclip.engine.precision import autocast_input, widened


@register_layer_rule(nn.Linear)
class LinearRule(LayerRule):
    name = "linear"

    def feature_dims(self, m):   # position-wise: the batch may sit in any leading axis
        return 1

    def prepare(self, m, x, batch_hint):
        return autocast_input(expand_batch(x, batch_hint)), None

    def forward(self, m, x, info):
        return F.linear(x, m.weight, m.bias)

    def input_grad(self, m, x, gy, info):
        return gy @ m.weight.to(gy.dtype)

    def uses(self, m, x, gy, info):
        b = flat3(gy)
        uses: dict[str, Use] = {"weight": Bilinear(b.unsqueeze(1), flat3(x).unsqueeze(1))}
        if m.bias is not None:
            uses["bias"] = Dense(widened(b).sum(1))
        return uses

    def examples(self):
        return [Example(seeded(nn.Linear(4, 3), 0), (example_tensor(5, 2, 4, seed=0),)),
                Example(seeded(nn.Linear(4, 3, bias=False), 1), (example_tensor(5, 4, seed=1),))]


class HFConv1DRule(LayerRule):
    """transformers' Conv1D: a Linear with its weight stored (in, out)."""

    name = "conv1d_transformers"

    def feature_dims(self, m):
        return 1

    def prepare(self, m, x, batch_hint):
        return autocast_input(expand_batch(x, batch_hint)), None

    def forward(self, m, x, info):
        out = torch.addmm(m.bias, x.reshape(-1, x.shape[-1]), m.weight)
        return out.view(*x.shape[:-1], m.weight.shape[1])

    def input_grad(self, m, x, gy, info):
        return gy @ m.weight.t().to(gy.dtype)

    def uses(self, m, x, gy, info):
        b = flat3(gy)
        return {"weight": Bilinear(flat3(x).unsqueeze(1), b.unsqueeze(1)), "bias": Dense(widened(b).sum(1))}

    def examples(self):
        return [Example(seeded(HFConv1D(3, 4), 2), (example_tensor(5, 2, 4, seed=2),))]


class FalconLinearRule(LinearRule):
    """transformers' FalconLinear: an nn.Linear whose forward is ``x @ W.T + b``, the same
    map as nn.Linear's, so the Linear rule (without it: the torch.func fallback)."""

    name = "linear_falcon"

    def examples(self):
        from transformers.models.falcon.modeling_falcon import FalconLinear

        return [Example(seeded(FalconLinear(4, 3), 15), (example_tensor(5, 2, 4, seed=15),)),
                Example(seeded(FalconLinear(4, 3, bias=False), 16), (example_tensor(5, 4, seed=16),))]


try:  # transformers is a dependency, but the engine must not break without it
    from transformers.pytorch_utils import Conv1D as HFConv1D

    register_layer_rule(HFConv1D, HFConv1DRule())
except ImportError:  # pragma: no cover
    pass

# Importing transformers' Falcon module costs more than a second: the rule is registered
# when that module is imported anyway (by the model that uses it).
register_lazy_layer_rule("transformers.models.falcon.modeling_falcon", "FalconLinear",
                         FalconLinearRule())
