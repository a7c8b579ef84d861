"""Gram matrices for ghost norms: symmetric strips, and one Gram per shared input.

A ghost norm ||Σ_t L_tᵀ R_t||² = Σ_{t,s} (L Lᵀ)_{ts} (R Rᵀ)_{ts} needs two T x T Grams
(docs/layer-rules.md, "Symmetric Grams" and "One Gram per shared input"). Pure tensor math;
:mod:`dpclip.engine.factors` builds the norms of parameters on it.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from dpclip.engine.sums import batched_dot
from dpclip.torch_compat import tensor_version


# A Gram is computed in column strips of at least this many columns (the second GEMM
# dimension): narrower strips lose more to GEMM overhead than the skipped half saves. On
# CUDA the full product is one kernel, and on an H200 it beat 2, 4 and 8 strips on every
# GPT-2 small layer at T 256 and 1024 (each strip's launches cost more than its flops), so
# CUDA splits only from T 4096, unmeasured (benchmarks/norm_rule.py --strips;
# benchmarks/results/strips_h200.txt).
GHOST_MIN_BLOCK = {"cpu": 32, "cuda": 2048}
# At most this many strips (9/16 of the plain product's work at 8). On the Intel VM, 8
# strips against 4 on GPT-2 small's block weights, three runs on two days: at B 2, T 1024
# faster in 11 of 12 (up to 13%; one tie), at B 4, T 256 in 9 of 12 (both MLP weights in
# every run, by up to 8%; attn.c_proj up to 11% slower, 0.2 ms) (benchmarks/norm_rule.py
# --strips; benchmarks/results/norm_strips_cpu.txt).
GHOST_MAX_STRIPS = 8
# ... and of at least this many columns, at most GHOST_WIDE_MAX_STRIPS of them, where a
# factor holds more than GHOST_WIDE_BYTES per sample (T·n·itemsize), which no cache holds:
# each strip streams its rows from memory again, so a narrow strip is bound by memory, not
# by its flops. On the CPU, GPT-2 small's tied lm_head (a [T, 50257] output gradient) took
# 73, 66, 73 and 76 ms at 1, 2, 3 and 4 strips at T 256 (strips of 128 columns fastest), and
# 549, 419, 422 and 375 ms at T 1024 (256 columns), 441 ms at 8 (one day; 482 at 4 and 447
# at 8 the next: kept at 4), while its MLP factors (3 MB a sample at T 256) were fastest
# at 4 strips of 64 then (benchmarks/norm_rule.py --strips).
GHOST_WIDE_BYTES = 16 << 20
GHOST_WIDE_MIN_BLOCK = 128
GHOST_WIDE_MAX_STRIPS = 4
# ... unless the strips are read in panels: up to T = 256 on the CPU, a wide factor is read
# GHOST_PANEL_COLUMNS columns at a time, and every strip's product with the panel is added
# while the panel is in cache, so the factor streams from memory once whatever the strip
# count: 8 strips of 32 (9/16 of the product). GPT-2's tied lm_head ([T, 50257] output
# gradient) at B 4, T 256 took 58.8 ms so against 65.4 ms in 2 plain strips
# (benchmarks/results/norm_strips_cpu.txt). Longer sequences keep plain strips (at T 1024, 4
# of 256, 375 ms there): a strip that tall amortises its read of the factor, and panels
# did not beat it in a trial at T 1024.
GHOST_PANEL_COLUMNS = 512
GHOST_PANEL_MAX_SEQ = 256
GHOST_PANEL_MAX_STRIPS = 8


# Rounding (docs/formulas.md, "Rounding of a norm"): each Gram entry is one GEMM's sum over
# the factor's width, and on rows of constant entries its round-off grows with that width,
# in one direction: a ghost norm² came out 1.3e-5 low at width 16384 and 4.7e-5 at 65536
# (benchmarks/norm_rounding.py), past the unflagged tolerance ρ = 2e-5. A float32/64 factor
# wider than this is read in panels of at most this many columns, whatever the speed rules
# say: the error is then that of an 8192-wide product (7.8e-6 measured) plus one rounding per
# panel.
GHOST_ROUNDING_MAX_WIDTH = 8192


def _rounding_panel(panel: int | None, x: Tensor, is_ids: bool) -> int | None:
    """``panel`` capped at :data:`GHOST_ROUNDING_MAX_WIDTH` for a wide float32/64 factor."""
    if is_ids or x.dtype not in (torch.float32, torch.float64) or x.shape[-1] <= GHOST_ROUNDING_MAX_WIDTH:
        return panel
    return min(panel or GHOST_ROUNDING_MAX_WIDTH, GHOST_ROUNDING_MAX_WIDTH)


def ghost_panel(seq: int, device: torch.device, sample_bytes: int = 0) -> int | None:
    """The panel width (columns of the factor) :func:`symmetric_ghost` reads a wide factor in,
    or None (plain strips, each reading the whole factor)."""
    if (torch.device(device).type == "cpu" and sample_bytes > GHOST_WIDE_BYTES
            and seq <= GHOST_PANEL_MAX_SEQ):
        return GHOST_PANEL_COLUMNS
    return None


def ghost_strips(seq: int, device: torch.device, sample_bytes: int = 0,
                 panelled: bool | None = None) -> int:
    """How many column strips :func:`symmetric_ghost` cuts a T x T Gram into; ``sample_bytes``:
    the wider factor's size per sample; ``panelled``: whether that factor is read in panels
    (default: wherever :func:`ghost_panel` says so)."""
    block = GHOST_MIN_BLOCK.get(torch.device(device).type, GHOST_MIN_BLOCK["cuda"])
    if panelled is None:
        panelled = ghost_panel(seq, device, sample_bytes) is not None
    if panelled:
        return max(1, min(GHOST_PANEL_MAX_STRIPS, seq // block))
    if sample_bytes > GHOST_WIDE_BYTES:
        return max(1, min(GHOST_WIDE_MAX_STRIPS, seq // max(block, GHOST_WIDE_MIN_BLOCK)))
    return max(1, min(GHOST_MAX_STRIPS, seq // block))


def _panel_strips(x: Tensor, spans: list[tuple[int, int]], panel: int) -> list[Tensor]:
    """The strips X[:hi] X[lo:hi]ᵀ of :func:`symmetric_ghost`, read ``panel`` columns of
    ``x`` [..., T, n] at a time: Σ over panels of the panel's strips (the same sums,
    reordered)."""
    flat = x.reshape(-1, *x.shape[-2:])
    outs = [flat.new_zeros(flat.shape[0], hi, hi - lo) for lo, hi in spans]
    for start in range(0, flat.shape[-1], panel):
        cols = flat[..., start:start + panel]
        for (lo, hi), out in zip(spans, outs):
            out.baddbmm_(cols[:, :hi], cols[:, lo:hi].transpose(1, 2))
    return [out.view(*x.shape[:-2], *out.shape[1:]) for out in outs]


def _gram(x: Tensor, is_ids: bool) -> Tensor:
    """x xᵀ over the last two dims; for ids [.., T] the one-hot Gram 1[x_t = x_s]."""
    if is_ids:
        return x.unsqueeze(-1) == x.unsqueeze(-2)
    return x @ x.transpose(-1, -2)


def _cross_gram(x: Tensor, y: Tensor, is_ids: bool) -> Tensor:
    if is_ids:
        return x.unsqueeze(-1) == y.unsqueeze(-2)
    return x @ y.transpose(-1, -2)


def _gram_dot(x: Tensor, y: Tensor) -> Tensor:
    """Σ_{t,s} x_ts y_ts over the last two dims."""
    lead = y.shape[:-2]
    x = x.to(y.dtype)
    return batched_dot(x.reshape(-1, *x.shape[-2:]), y.reshape(-1, *y.shape[-2:])).view(lead)


class GramCache:
    """The Gram strips of the factors of the last ghost norm, for the next layer that reads
    the same input (Llama's q, k and v projections, its gate and up projections: one
    activation, one Gram). Two entries (a norm's two factors), each holding its factor, so
    that the factor's memory cannot be reused while the entry lives; a hit needs the very
    same memory (storage, offset, shape, strides, dtype) at the version it had when cached
    (no in-place change since). ``hits`` counts the Grams reused."""

    SIZE = 2

    def __init__(self):
        self._entries: list[tuple[Tensor, int, int, list[Tensor]]] = []   # factor, version, k, strips
        self.hits = 0

    @staticmethod
    def _same(a: Tensor, version: int, b: Tensor) -> bool:
        # the data pointer first: it tells most misses apart in one call
        return (a.data_ptr() == b.data_ptr() and a.device == b.device and a.dtype == b.dtype
                and a.shape == b.shape and a.stride() == b.stride()
                and a.storage_offset() == b.storage_offset()
                and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
                and tensor_version(a) == tensor_version(b) == version)

    def strips(self, factor: Tensor, count: int, compute: Callable[[], list[Tensor]]) -> list[Tensor]:
        for entry in self._entries:
            cached, version, k, value = entry
            if k == count and self._same(cached, version, factor):
                self.hits += 1
                self._entries.remove(entry)
                self._entries.append(entry)      # most recently used last
                return value
        value = compute()
        self._entries = (self._entries + [(factor, tensor_version(factor), count, value)])[-self.SIZE:]
        return value


def _strip_plan(left: Tensor, right: Tensor, left_ids: bool, strips: int | None) -> tuple[int, int | None, int | None]:
    """(k, the left factor's panel width, the right's) for :func:`symmetric_ghost`: ``strips`` (or
    :func:`ghost_strips`'s count for these factors) within [1, T], and the wider factor read in
    panels where :func:`ghost_panel` says so (float32/64 only), each capped for rounding."""
    t = right.shape[-2]
    panel_left = panel_right = None
    if strips is None:
        left_bytes = 0 if left_ids else t * left.shape[-1] * left.element_size()
        right_bytes = t * right.shape[-1] * right.element_size()
        wider = left if left_bytes > right_bytes else right
        panel = ghost_panel(t, right.device, max(left_bytes, right_bytes))
        if wider.dtype not in (torch.float32, torch.float64):
            panel = None   # a half-precision panel sum would round at every panel
        if wider is left:
            panel_left = panel
        else:
            panel_right = panel
        strips = ghost_strips(t, right.device, max(left_bytes, right_bytes), panelled=panel is not None)
    strips = max(1, min(int(strips), t))
    return strips, _rounding_panel(panel_left, left, left_ids), _rounding_panel(panel_right, right, False)


def symmetric_ghost(left: Tensor, right: Tensor, left_ids: bool,
                     strips: int | None = None, cache: GramCache | None = None) -> tuple[Tensor, Tensor]:
    """(Σ_{t,s} (L Lᵀ)_{ts} (R Rᵀ)_{ts}, Σ_t (L Lᵀ)_{tt} (R Rᵀ)_{tt}) over the T axis, using
    the symmetry of both Grams.

    Cut the columns s into k strips [lo_j, hi_j) (:func:`ghost_strips`). Strip j of a Gram,
    rows t < hi_j, is one GEMM, X[:hi_j] X[lo_j:hi_j]ᵀ; its rows t < lo_j lie above the
    diagonal and stand for their mirror images too (weight 2), its rows lo_j ≤ t < hi_j are
    the diagonal block (weight 1). So the sum is exact (reordered), and the Gram work is
    (k+1)/(2k) of the plain product: 3/4, 5/8 and 9/16 at k = 2, 4 and 8, in k GEMMs whose rows
    stay whole (the recursive halving this replaced reached the same counts in many smaller
    GEMMs, and measured slower: benchmarks/README.md, "What the engine does for speed"). The second value, the
    atoms' squared sizes Σ_t ||L_t||²||R_t||² that bound the first's round-off
    (:mod:`dpclip.engine.cancellation`), is read off the diagonal blocks for free.
    ``left`` is ``[..., T, m]`` (or ids ``[..., T]``), ``right`` ``[..., T, n]`` -> ``[...]``;
    ``strips`` overrides k (benchmarks/norm_rule.py compares them); ``cache`` lends the Gram
    of a factor a previous call already read (:class:`GramCache`).
    """
    t = right.shape[-2]
    strips, panel_left, panel_right = _strip_plan(left, right, left_ids, strips)
    if strips == 1 and panel_left is None and panel_right is None:
        if cache is None:
            gram_right = _gram(right, False)
        else:
            (gram_right,) = cache.strips(right, 1, lambda: [_gram(right, False)])
        if cache is None or left_ids:
            gram_left = _gram(left, left_ids)
        else:
            (gram_left,) = cache.strips(left, 1, lambda: [_gram(left, False)])
        atoms = (gram_left.diagonal(dim1=-2, dim2=-1).to(gram_right.dtype)
                 * gram_right.diagonal(dim1=-2, dim2=-1)).sum(-1)
        return _gram_dot(gram_left, gram_right), atoms
    rows = (lambda x, lo, hi: x[..., lo:hi]) if left_ids else (lambda x, lo, hi: x[..., lo:hi, :])
    bounds = [j * t // strips for j in range(strips + 1)]
    spans = list(zip(bounds[:-1], bounds[1:]))

    def left_strip(lo: int, hi: int) -> Tensor:   # [..., hi, h]
        return _cross_gram(rows(left, 0, hi), rows(left, lo, hi), left_ids)

    def right_strip(lo: int, hi: int) -> Tensor:
        return _cross_gram(right[..., :hi, :], right[..., lo:hi, :], False)

    def all_strips(x: Tensor, panel: int | None, one: Callable[[int, int], Tensor]) -> list[Tensor] | None:
        """Every strip of x at once: read panel by panel, or kept for a layer reading the
        same input (``cache``); None: strip by strip in the loop below."""
        if panel is not None:
            compute = lambda: _panel_strips(x, spans, panel)   # noqa: E731
        elif cache is not None:
            compute = lambda: [one(lo, hi) for lo, hi in spans]   # noqa: E731
        else:
            return None
        return compute() if cache is None else cache.strips(x, strips, compute)

    rights = all_strips(right, panel_right, right_strip)
    lefts = None if left_ids else all_strips(left, panel_left, left_strip)
    total = atoms = None
    for j, (lo, hi) in enumerate(spans):
        gram_left = lefts[j] if lefts is not None else left_strip(lo, hi)
        gram_right = rights[j] if rights is not None else right_strip(lo, hi)
        product = gram_left.to(gram_right.dtype) * gram_right
        value = product[..., lo:, :].sum((-2, -1))
        if lo:
            value = value + 2 * product[..., :lo, :].sum((-2, -1))
        diagonal = product[..., lo:, :].diagonal(dim1=-2, dim2=-1).sum(-1)
        total = value if total is None else total + value
        atoms = diagonal if atoms is None else atoms + diagonal
    return total, atoms


__all__ = ["GHOST_MAX_STRIPS", "GHOST_MIN_BLOCK", "GHOST_PANEL_COLUMNS", "GHOST_PANEL_MAX_SEQ",
           "GHOST_PANEL_MAX_STRIPS", "GHOST_ROUNDING_MAX_WIDTH", "GHOST_WIDE_BYTES", "GHOST_WIDE_MAX_STRIPS", "GHOST_WIDE_MIN_BLOCK", "GramCache",
           "ghost_panel", "ghost_strips", "symmetric_ghost"]
