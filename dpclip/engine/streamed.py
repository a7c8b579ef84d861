"""Transient parameters instantiated a chunk of samples at a time (layer-wise clipping).

A group whose parameters the mixed rule instantiates (:func:`~dpclip.engine.factors.choose_ghost`,
``transient=True``) gets its norms and clipped sums here, without ever holding every G_i
at once (docs/layer-rules.md). Pure tensor math on :mod:`dpclip.engine.factors`' uses.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
from torch import Tensor

from dpclip.engine import factors
from dpclip.engine.factors import Bilinear, Use, concat_uses, instantiate, numel_per_sample, sqrt_or_zero, widened_use
from dpclip.engine.sums import sum_of_squares


# On the CPU a transient G_i of at least this many elements (all the group's bundles
# together, per sample) is formed one sample at a time (:func:`_one_sample_at_a_time`);
# smaller ones in batched chunks, whose one matmul beat B small ones: at B 16 and 64,
# T 16 to 256, batched chunks were faster for every G_i up to 256 x 1024, one sample at a
# time for GPT-2 small's 768 x 2304 and 768 x 3072 at B 4, T 256 (13.1 and 17.0 ms
# against 15.3 and 21.5) and for 1024 x 4096 in 6 of 8 cells (benchmarks/norm_rule.py;
# benchmarks/results/norm_rule_cpu.txt).
ONE_AT_A_TIME_MIN_NUMEL = 1 << 20


def streamable(uses: list[Use], method: str) -> Bilinear | None:
    """The single dense bundle of a transient parameter that the mixed rule instantiates,
    or None (ids, instantiated uses, several parts: those take :func:`param_norm_sq`)."""
    if not uses or not all(isinstance(u, Bilinear) and not u.is_ids for u in uses):
        return None
    bundle = concat_uses(uses)
    return None if factors.choose_ghost(bundle, method, transient=True) else bundle  # the module's: one rule, one place to observe it


def streamed_clip(bundles: list[Bilinear], shapes: list[torch.Size], base_norm_sq: Tensor,
                  clip: Callable[[Tensor, slice], Tensor], meter=None,
                  one_at_a_time: bool | None = None) -> tuple[Tensor, list[Tensor]]:
    """Group norms and Σ_i c_i G_i of instantiated parameters, a chunk of samples at a time.

    For a group whose other parameters' norms² are known (``base_norm_sq`` [B]), sample
    i's group norm needs only its own G_i: instantiate G_i for a chunk of samples, add
    ||G_i||², clip (``clip``: the chunk's norms and rows -> factors), and add c_i G_i to the sums before the next
    chunk. Same numbers as instantiating everything first. On the CPU a large G_i's chunk is
    one sample (:func:`_one_sample_at_a_time`, :data:`ONE_AT_A_TIME_MIN_NUMEL`); otherwise a
    chunk's G_i take at most twice the memory of the factors already held (one chunk, one
    batched matmul and one Σ_i c_i G_i, for a bundle within twice its factors: the time
    rule's bound off the CPU, :func:`choose_ghost`). ``meter`` (add/remove of tensors,
    optional) counts each chunk's G_i while it lives. A sample with a non-finite norm gets
    c_i = 0 and its G_i adds nothing (0·NaN would poison the sum). Returns (norms [B], non-finite
    ones included, and one sum per bundle). ``one_at_a_time`` overrides the choice by device.
    """
    batch = base_norm_sq.shape[0]
    inst = sum(numel_per_sample(b)[0] for b in bundles)
    if one_at_a_time is None:
        one_at_a_time = (inst >= ONE_AT_A_TIME_MIN_NUMEL
                         and all(b.right.device.type == "cpu" for b in bundles))
    if one_at_a_time:
        return _one_sample_at_a_time(bundles, shapes, base_norm_sq, clip, meter)
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
            sq = sq + sum_of_squares(g).to(sq.dtype)
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


def _one_sample_at_a_time(bundles: list[Bilinear], shapes: list[torch.Size], base_norm_sq: Tensor,
                          clip: Callable[[Tensor, slice], Tensor], meter=None) -> tuple[Tensor, list[Tensor]]:
    """:func:`streamed_clip` on the CPU: one sample's G_i at a time, in one buffer per bundle
    that stays in cache while its norm is taken and c_i G_i is added (the first sample's is
    written straight into the sum). On GPT-2 small at B 4, T 256 this took 13.1, 17.0 and
    17.5 ms on ``attn.c_attn``, ``mlp.c_fc`` and ``mlp.c_proj`` against 15.3, 21.5 and 21.0
    ms in batched chunks, and 13.8, 18.0 and 18.2 ms ghost-normed (benchmarks/norm_rule.py;
    benchmarks/results/norm_rule_cpu.txt)."""
    batch = base_norm_sq.shape[0]
    dtype = base_norm_sq.dtype
    # [g, m, n] per bundle, in the dtype of its (widened) factors, as the batched chunks'
    # sums are: sample 0's G_0 is computed into the sum itself
    sums = [torch.empty(b.left.shape[1], b.left.shape[3], b.right.shape[3], device=b.right.device,
                        dtype=widened_use(Bilinear(b.left[:1], b.right[:1]), dtype).right.dtype)
            for b in bundles]
    buffers = [torch.empty_like(t) for t in sums] if batch > 1 else []
    if meter is not None:
        meter.add(sums + buffers)
    norms = []
    for i in range(batch):
        grads = sums if i == 0 else buffers
        sq = base_norm_sq[i:i + 1]
        for b, g in zip(bundles, grads):
            one = widened_use(Bilinear(b.left[i], b.right[i]), dtype)   # bf16 factors: G_i in float32
            torch.matmul(one.left.transpose(-1, -2), one.right, out=g)
            sq = sq + sum_of_squares(g.unsqueeze(0)).to(dtype)
        norm = sqrt_or_zero(sq)
        c = clip(norm, slice(i, i + 1))
        finite = math.isfinite(float(norm))   # a CPU tensor: no device to wait for
        for total, g in zip(sums, grads):
            if i == 0:   # a non-finite sample adds nothing (0·inf would be NaN)
                total.mul_(c.to(total.dtype)) if finite else total.zero_()
            elif finite:
                total.addcmul_(g, c.to(total.dtype))
        norms.append(norm)
    if meter is not None:
        meter.remove(sums + buffers)
    return torch.cat(norms), [t.reshape(shape) for t, shape in zip(sums, shapes)]


__all__ = ["ONE_AT_A_TIME_MIN_NUMEL", "streamable", "streamed_clip"]
