"""Group-level tensor math of a finalization (docs/layer-rules.md, "Work per group").

Pure functions on one or several groups' tensors at once, so that a group's work is a few
kernels whatever its number of parameters: :class:`~dpclip.engine.microbatch.MicroBatch`
decides what is finalized when and keeps the state; this module does the arithmetic.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
from torch import Tensor

from dpclip.engine.factors import Dense, Use, choose_ghost
from dpclip.engine.sums import as_rows, sum_of_squares


def concatenated_norm_sq(grads: list[Tensor]) -> tuple[Tensor, Tensor]:
    """(the small instantiated gradients ``grads`` [b, ...] as one [b, N], their joint
    per-sample norm² [b]): one concatenation and one reduction for all of them."""
    flat = as_rows(grads[0]) if len(grads) == 1 else torch.cat([as_rows(g) for g in grads], dim=1)
    return flat, sum_of_squares(flat)


def sliced_sums(flat: Tensor, shapes: list[torch.Size], factors: Tensor, keep: Tensor | None) -> list[Tensor]:
    """Σ_i c_i G_i of each gradient concatenated in ``flat`` [b, N]: one [b] x [b, N] product,
    each sum a slice of it of its ``shapes`` (as a bucketed data-parallel gradient is a view of
    its bucket). Rows not in ``keep`` are zeroed first: a non-finite sample's row would give
    0·inf = NaN with its zero factor."""
    rows = flat if keep is None else torch.where(keep.view(-1, 1), flat, 0)
    summed = factors.to(flat.dtype) @ rows
    out, offset = [], 0
    for shape in shapes:
        out.append(summed[offset:offset + shape.numel()].view(shape))
        offset += shape.numel()
    return out


def stacked_columns(columns: list[Tensor | None], batch: int, device, dtype) -> Tensor:
    """Groups' norms² [b] side by side, [b, K'] (a group with none: zeros)."""
    zeros = None
    if any(c is None for c in columns):
        zeros = torch.zeros(batch, device=device, dtype=dtype)
    columns = [zeros if c is None else c for c in columns]
    return columns[0].unsqueeze(1) if len(columns) == 1 else torch.stack(columns, dim=1)


def thresholds_of(thresholds: Tensor, groups: list[int]) -> Tensor:
    """``thresholds`` [K] of the sorted ``groups``, [K']: a view where they are consecutive."""
    if groups == list(range(groups[0], groups[-1] + 1)):
        return thresholds[groups[0]:groups[-1] + 1]
    return torch.stack([thresholds[k] for k in groups])


def nonfinite_norms(norms: Tensor, total_sq: float | None) -> tuple[Tensor, Tensor | None]:
    """``norms`` [b, K'] with every non-finite one read as +inf, and which to keep (None: all).

    A sample with a non-finite norm would put 0·inf = NaN into the sum: one example could
    change the release without bound. It contributes zero instead, and reads as +inf
    (clipped, above every threshold) to the policy. The norms are ≥ 0, so their sum
    (``total_sq``: Σ norm², already read; else summed here) is finite unless one is not (or
    it overflows: then nothing is dropped); one reduction is ~4x cheaper than isfinite().all()."""
    if math.isfinite(total_sq if total_sq is not None else float(norms.sum())):
        return norms, None
    finite = torch.isfinite(norms)
    if bool(finite.all()):
        return norms, None
    return torch.where(finite, norms, math.inf), finite


def weights_toward_zero(row_weights: Tensor, dtype: torch.dtype, device: torch.device) -> Tensor:
    """``row_weights`` in ``dtype`` on ``device``, each cast toward zero, never up: a person's k
    weights of 1/k (float64) rounded to nearest in float32 summed to 1 + 3·10⁻⁸, past the one
    unit that the gradient's and the statistics' sensitivities are calibrated to (docs/users.md)."""
    cast = row_weights.to(dtype)
    if cast.dtype != row_weights.dtype:
        up = cast.to(row_weights.dtype) > row_weights    # compared in the caller's precision
        if bool(up.any()):
            cast = torch.where(up, torch.nextafter(cast, torch.zeros_like(cast)), cast)
    return cast.to(device)


def clip_factors(clip: Callable[[Tensor, Tensor], Tensor], norms: Tensor, thresholds: Tensor,
                 keep: Tensor | None, row_weights: Tensor | None, unscale: float | None,
                 sum_scale: float | None) -> Tensor:
    """Clip factors [b, K'] of ``norms`` [b, K'] against ``thresholds`` ([K'] or [b, K']), with
    the row weights, the loss scale's 1/scale (the parts hold the scaled gradient) and the
    sums' 1/B on them; 0 for a row not in ``keep``."""
    factors = clip(norms, thresholds)
    if row_weights is not None:
        factors = factors * row_weights.unsqueeze(1)
    if keep is not None:
        factors = torch.where(keep, factors, 0)
    if unscale is not None:
        factors = factors * unscale
    if sum_scale is not None:
        factors = factors * sum_scale
    return factors


def chunk_clip(clip: Callable[[Tensor, Tensor], Tensor], threshold: Tensor, row_weights: Tensor | None,
               unscale: float | None, sum_scale: float | None) -> Callable[[Tensor, slice], Tensor]:
    """The clip of a streamed group's chunks (:func:`~dpclip.engine.streamed.streamed_clip`):
    (chunk norms, rows) -> factors. The chunks' G_i are scaled by the loss scale: unscaled
    norms in, factors that also unscale out; and the sums carry 1/B."""
    to_sum = (unscale or 1.0) * (sum_scale or 1.0)

    def factors_of(chunk_norms: Tensor, rows: slice) -> Tensor:
        factors = clip(chunk_norms if unscale is None else chunk_norms * unscale, threshold)
        if row_weights is not None:
            factors = factors * row_weights[rows]
        return factors if to_sum == 1.0 else factors * to_sum
    return factors_of


def describe_path(parts: list[Use], method: str, transient: bool) -> str:
    """How a parameter's norm was computed from its ``parts`` (engine.debug_clipped's paths)."""
    def one(part: Use) -> str:
        if isinstance(part, Dense):
            return "instantiated"
        kind = "ids " if part.is_ids else ""
        if choose_ghost(part, method, transient):
            return kind + "ghost"
        return kind + "instantiated norm, factor sum"
    return " + ".join(one(p) for p in parts)


__all__ = ["chunk_clip", "describe_path", "clip_factors", "concatenated_norm_sq", "nonfinite_norms", "sliced_sums", "stacked_columns",
           "thresholds_of"]
