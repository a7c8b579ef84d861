"""Clip functions: per-sample factors c_i from a group's per-sample gradient norms.

The clipped per-sample gradient of group k is c_{i,k}·g_{i,k}. Both functions keep
||c·g|| ≤ C_k (abadi) or < C_k (auto), so the clipped sum over K groups has L2
sensitivity sqrt(Σ_k C_k²) (docs/engine.md).

Both give c = 0 for ||g|| = +inf; the engine passes every non-finite norm (NaN too) as
+inf and zeroes that sample's per-sample gradient before summing (0·inf would be NaN).

Both give c = 0 where C/||g|| is below the smallest normal number of the norms' dtype
(:func:`_trusted`): a subnormal factor is rounded to a multiple of 2⁻¹⁴⁹ in float32, up to
twice C/||g|| (C = 1e-26 and a crafted norm of 1e19: the row moved the sum by 1.40·C;
tests/privacy/test_tiny_thresholds.py). Such a sample's norm exceeds C by a factor of
more than 10³⁷ (float32 norms stay below 1.9·10¹⁹, so only C < 2.2·10⁻¹⁹ is concerned).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from dpclip.errors import EngineError

ClipFn = Callable[[Tensor, Tensor], Tensor]


def abadi(norms: Tensor, thresholds: Tensor) -> Tensor:
    """c = min(1, C/||g||): 1 when ||g|| = 0, 0 when ||g|| = +inf (Abadi et al. 2016; docs/engine.md)."""
    # C / max(||g||, tiny) is huge for a zero norm, so the min gives 1 without a branch.
    tiny = torch.finfo(norms.dtype).tiny
    return _trusted((thresholds / norms.clamp_min(tiny)).clamp(max=1.0))


def auto(norms: Tensor, thresholds: Tensor, gamma: float = 0.01) -> Tensor:
    """c = C/(||g|| + γ), 0 when ||g|| = +inf (AUTO-S, Bu et al.; groupwise-clipping paper eq. (4))."""
    return _trusted(thresholds / (norms + gamma))


def _trusted(factors: Tensor) -> Tensor:
    """``factors`` with every subnormal one set to 0 (module doc): c·g then stays within C."""
    return torch.where(factors < torch.finfo(factors.dtype).tiny, torch.zeros_like(factors), factors)


CLIP_FUNCTIONS = ("abadi", "auto")


def make_clip_fn(name: str, gamma: float = 0.01) -> ClipFn:
    """The clip function ``name`` (``abadi`` or ``auto`` with stability constant γ)."""
    if name == "abadi":
        return abadi
    if name == "auto":
        if not gamma > 0:
            raise EngineError(f"auto clipping needs gamma > 0, got {gamma}", "use gamma: 0.01")
        return lambda norms, thresholds: auto(norms, thresholds, gamma)
    raise EngineError(f"unknown clip function {name!r}", "use one of: " + ", ".join(CLIP_FUNCTIONS))
