"""Transient parameters instantiated a chunk of samples at a time (layer-wise clipping).

A group whose parameters the mixed rule instantiates (:func:`~dpclip.engine.factors.choose_ghost`,
``transient=True``) gets its norms and clipped sums here, without ever holding every G_i
at once (docs/engine.md). Pure tensor math on :mod:`dpclip.engine.factors`' uses.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
from torch import Tensor

from dpclip.engine import factors
from dpclip.engine.factors import Bilinear, Use, concat_uses, instantiate, numel_per_sample, sqrt_or_zero, widened_use


def streamable(uses: list[Use], method: str) -> Bilinear | None:
    """The single dense bundle of a transient parameter that the mixed rule instantiates,
    or None (ids, instantiated uses, several parts: those take :func:`param_norm_sq`)."""
    if not uses or not all(isinstance(u, Bilinear) and not u.is_ids for u in uses):
        return None
    bundle = concat_uses(uses)
    return None if factors.choose_ghost(bundle, method, transient=True) else bundle  # the module's: one rule, one place to observe it


def streamed_clip(bundles: list[Bilinear], shapes: list[torch.Size], base_norm_sq: Tensor,
                  clip: Callable[[Tensor, slice], Tensor], meter=None) -> tuple[Tensor, list[Tensor]]:
    """Group norms and Σ_i c_i G_i of instantiated parameters, a chunk of samples at a time.

    For a group whose other parameters' norms² are known (``base_norm_sq`` [B]), sample
    i's group norm needs only its own G_i: instantiate G_i for a chunk of samples, add
    ||G_i||², clip (``clip``: the chunk's norms and rows -> factors), and add c_i G_i to the sums before the next
    chunk. Same numbers as instantiating everything first; the chunk's G_i never take more
    than twice the memory of the factors already held, the bound of the time rule
    (:func:`choose_ghost`), so a bundle that rule instantiates is one chunk: one batched
    matmul and one Σ_i c_i G_i, where chunks of one sample took about 1.8x as long on
    GPT-2 small's MLP (docs/performance.md). ``meter`` (add/remove of tensors, optional) counts
    each chunk's G_i while it lives. A sample with a non-finite norm gets c_i = 0 and its
    G_i is zeroed before the sum (0·NaN would poison it). Returns (norms [B], non-finite
    ones included, and one sum per bundle).
    """
    batch = base_norm_sq.shape[0]
    inst = sum(numel_per_sample(b)[0] for b in bundles)
    held = sum(numel_per_sample(b)[1] for b in bundles)
    chunk = max(1, min(batch, 2 * batch * held // max(inst, 1)))
    sums: list[Tensor | None] = [None] * len(bundles)
    norms = []
    for start in range(0, batch, chunk):
        rows = slice(start, start + chunk)
        grads = [instantiate(widened_use(Bilinear(b.left[rows], b.right[rows]), base_norm_sq.dtype)).flatten(1)
                 for b in bundles]
        if meter is not None:
            meter.add(grads)
        sq = base_norm_sq[rows]
        for g in grads:
            sq = sq + torch.linalg.vector_norm(g, dim=1).square().to(sq.dtype)
        chunk_norms = sqrt_or_zero(sq)
        c = clip(chunk_norms, rows)
        summed = grads
        if not math.isfinite(float(chunk_norms.sum())):  # norms ≥ 0: one cheap check per chunk
            finite = torch.isfinite(chunk_norms)
            c = torch.where(finite, c, 0)
            summed = [torch.where(finite[:, None], g, 0) for g in grads]
        for j, g in enumerate(summed):
            row = c.to(g.dtype).unsqueeze(0)
            if sums[j] is None:
                sums[j] = (row @ g).squeeze(0)
            else:  # accumulate in the GEMM: no [m·n] temporary per chunk
                sums[j].unsqueeze(0).addmm_(row, g)
        if meter is not None:
            meter.remove(grads)
        norms.append(chunk_norms)
    return torch.cat(norms), [t.reshape(shape) for t, shape in zip(sums, shapes)]


__all__ = ["streamable", "streamed_clip"]
