"""Norms the working precision cannot vouch for: found, and recomputed in float64.

The ghost norm ||Σ_t L_tᵀR_t||² = Σ_{t,s} (L Lᵀ)_{ts}(R Rᵀ)_{ts} is a sum of T² products
that may cancel: with L_1 = L_2 and R_{1,2} = ±K·u + w the exact value is 4||L_1||²||w||²,
but every term is of size K², and float32 returns round-off (even ≤ 0, clamped to 0: the
sample would pass unclipped). The clipped sum Lᵀdiag(c)R read from the same factors
cancels the same way. Both errors are bounded by the size of the *atoms* G_t = L_tᵀR_t
the sum is made of, not by the result: |N̂ − N| ≈ λ·u·D with D = Σ_t ||L_t||²||R_t||²,
u the unit round-off and λ ≲ sqrt(m + n + T) (docs/formulas.md, "Cancellation"). Where
that bound is not small against N̂, the sample's parameter is recomputed in float64 and
its norm raised by a rigorous float64 error bound: the norm used for clipping is then
never below the exact norm of what is summed (:mod:`dpclip.engine.microbatch` applies it).
"""

from __future__ import annotations

import functools
import math

import torch
from torch import Tensor

from dpclip.engine.factors import Bilinear, Dense, Use, atom_sizes, param_norm_sq


#: the relative error of a norm² the engine accepts from its working precision (2e-5 on
#: the norm², 1e-5 on the norm: the clip invariant ‖c_i g_i‖ ≤ C·(1 + 1e-5))
CANCELLATION_TOLERANCE = 2e-5


def _dims(parts: list[Use]) -> tuple[int, int, int]:
    """(largest m, largest n, positions T over all parts) of a parameter's parts."""
    m = n = t = 0
    for part in parts:
        if isinstance(part, Dense):
            t += 1
            continue
        m = max(m, 1 if part.is_ids else part.left.shape[3])
        n = max(n, part.right.shape[3])
        t += part.right.shape[2]
    return m, n, t


def cancellation_bound(parts: list[Use], dtype: torch.dtype) -> float | None:
    """u·sqrt(m + n + T) of :func:`cancellation_flags` for ``parts`` and a norm² of ``dtype``
    (u its unit round-off), or None when nothing of ``parts`` is read from factors."""
    if not any(isinstance(p, Bilinear) for p in parts):
        return None
    m, n, t = _dims(parts)
    return torch.finfo(dtype).eps / 2 * math.sqrt(m + n + t)


def cancellation_flags(parts: list[Use], norm_sq: Tensor, atoms_sq: Tensor) -> Tensor | None:
    """Samples whose norm² ``norm_sq`` [B] the working precision cannot vouch for, or None
    when nothing of ``parts`` is read from factors (instantiated gradients give the norm
    and the sum from the same numbers: consistent whatever their round-off). ``atoms_sq``:
    D [B], the parts' atoms' squared sizes (``param_norm_sq(..., with_atoms=True)``).

    Flagged: N̂·ρ < u·sqrt(m + n + T)·D, with ρ = :data:`CANCELLATION_TOLERANCE`. Unflagged,
    the error λ·u·D (λ measured at most 0.52·sqrt(m + n + T) for m up to 8192 and K up to
    10⁵, benchmarks/cancellation.py) is below 0.52·ρ·N̂, so the norm is within 5.2e-6 of exact.
    A NaN norm is not flagged (the non-finite handling zeroes that sample)."""
    bound = cancellation_bound(parts, norm_sq.dtype)
    if bound is None:
        return None
    return norm_sq * CANCELLATION_TOLERANCE < bound * atoms_sq


def stacked_cancellation_flags(norm_sq: Tensor, atoms_sq: Tensor, bounds: list[float]) -> Tensor:
    """:func:`cancellation_flags` of P parameters at once: ``norm_sq`` and ``atoms_sq``
    [P, B] stacked, ``bounds`` their :func:`cancellation_bound` -> flags [P, B]. The same
    comparison in four kernels for a whole group instead of three per parameter (a GPU
    step's host time is bounded by its launches)."""
    scale = _bound_column(tuple(bounds), norm_sq.dtype, norm_sq.device)
    return norm_sq * CANCELLATION_TOLERANCE < scale * atoms_sq


@functools.lru_cache(maxsize=64)
def _bound_column(bounds: tuple[float, ...], dtype: torch.dtype, device: torch.device) -> Tensor:
    """The bounds as a [P, 1] tensor, made once per group layout (a copy to the device otherwise
    at every step)."""
    return torch.tensor(bounds, dtype=dtype, device=device).unsqueeze(1)


def certified_rows(parts: list[Use], rows: Tensor, shape: torch.Size,
                   method: str) -> tuple[Tensor, list[Use]]:
    """The flagged samples ``rows`` of one parameter recomputed in float64.

    Returns (an upper bound of each row's exact norm² [F] in float64, the rows' parts in
    float64 for :func:`clipped_sum`). The float64 computation's own error is at most
    γ·M² with γ = 2(m + n + T² + 8)·u₆₄ (every entry it forms is a sum of at most
    max(m, n, T²) products of atoms, docs/formulas.md), so N̂₆₄ + γ·M² ≥ N exactly."""
    wide = torch.float64
    picked: list[Use] = []
    for part in parts:
        if isinstance(part, Dense):
            picked.append(Dense(part.grad[rows].to(wide)))
        elif part.is_ids:
            picked.append(Bilinear(part.left[rows], part.right[rows].to(wide), part.vocab))
        else:
            picked.append(Bilinear(part.left[rows].to(wide), part.right[rows].to(wide)))
    norm_sq, parts64 = param_norm_sq(picked, shape, method, wide)
    size = sum(atom_sizes(p, wide)[1] for p in picked)
    m, n, t = _dims(picked)
    gamma = 2 * (m + n + t * t + 8) * torch.finfo(wide).eps / 2
    return norm_sq.clamp_min(0) + gamma * size.square(), parts64


__all__ = ["CANCELLATION_TOLERANCE", "cancellation_bound", "cancellation_flags", "certified_rows",
           "stacked_cancellation_flags"]
