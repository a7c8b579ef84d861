"""``dpclip.fix(model)``: the layers that mix samples replaced by per-sample ones (Opacus's
``ModuleValidator.fix``), so that the engine accepts the model (docs/python-api.md).

- ``BatchNorm1d/2d/3d`` and ``SyncBatchNorm`` (batch statistics: every sample's output depends on
  the others) become ``GroupNorm(gcd(32, C), C)`` with the same affine setting: a sample's own
  statistics over groups of channels.
- ``InstanceNorm*`` with ``track_running_stats=True`` (running statistics of the private data,
  released with the model) stops tracking them.

The replaced layers start from fresh weights (GroupNorm's affine is 1 and 0), as in Opacus.
"""

from __future__ import annotations

import math

from torch import nn

from dpclip.torch_compat import BatchNormBase, InstanceNormBase


def fix(model: nn.Module) -> nn.Module:
    """``model`` with its sample-mixing norms replaced (in place; also returned)."""
    for name, child in list(model.named_children()):
        replacement = _fixed(child)
        if replacement is not child:
            setattr(model, name, replacement)
        else:
            fix(child)
    return _fixed(model)


def _fixed(module: nn.Module) -> nn.Module:
    if isinstance(module, BatchNormBase):
        channels = module.num_features
        return nn.GroupNorm(math.gcd(32, channels), channels, eps=module.eps, affine=module.affine)
    if isinstance(module, InstanceNormBase) and module.track_running_stats:
        module.track_running_stats = False
        module.running_mean = module.running_var = None
        module.num_batches_tracked = None
    return module
