"""Per-sample sums of squares and dot products with a rounding bound that does not grow with length.

A clip factor c_i = min(1, C/‖G_i‖) is only as sound as the norm it divides by: a norm
computed too small lets the sample add more than C (docs/formulas.md, "Rounding of a
norm"). torch's reductions sum a long row in a few dozen running float32 accumulators, so
their round-off grows with the row's length and, for entries of near-constant size, in one
direction: the norm² of an instantiated 3072 x 768 gradient with constant entries came out
up to 3.6e-3 too small (``torch.linalg.vector_norm``), and a crafted example then moved the
clipped sum by C·(1 + 1.35e-3) (tests/privacy/test_norm_rounding.py).

Here each row is cut into blocks of :data:`BLOCK` entries. A block is reduced in the
working precision, in whatever order the backend likes: for any order,

    |ŝ_block − s_block| ≤ γ_k · Σ_j |x_j y_j|,   γ_k = k·u / (1 − k·u)

with k = BLOCK for a dot product (BLOCK − 1 additions and one rounding of each product;
Higham, "Accuracy and Stability of Numerical Algorithms", 2nd ed., §3.1) and k = BLOCK + 2
for a sum of squares, which ``vector_norm`` returns as a rounded square root, squared again
(two more roundings). The blocks are summed in float64 (γ over at most 2^24 blocks in
u₆₄ = 2^-53: at most 2^-29), and the total is rounded once to the working precision (one
more u). So a norm² is within :func:`relative_bound` = γ_(BLOCK+3) + 2^-29: 7.8e-6 in
float32, 3.9e-6 on the norm, within the clip invariant's 10^-5 whatever the row's length.
Half-precision rows are reduced in float32 (their squares would round at 2^-8). Pure torch.
"""

from __future__ import annotations

import torch
from torch import Tensor

from dpclip.engine.precision import LOW_PRECISION

#: entries per block: the bound is γ_(BLOCK+3) of the working precision. At 128 the blocked
#: norms of a GPT-2 small block's per-sample gradients took about what the whole-row reduction
#: did on the CPU (benchmarks/norm_rule.py --traffic; shorter blocks were slower).
BLOCK = 128


def _working_dtype(x: Tensor) -> torch.dtype:
    return torch.float32 if x.dtype in LOW_PRECISION else x.dtype


def relative_bound(dtype: torch.dtype) -> float:
    """γ_(BLOCK+3) of ``dtype``'s working precision + 2^-29 (module doc): the relative error
    bound of :func:`sum_of_squares` (against Σ_j x_j² of the same stored x), and of
    :func:`batched_dot` against Σ_j |x_j y_j|."""
    if dtype in LOW_PRECISION:
        dtype = torch.float32
    unit = torch.finfo(dtype).eps / 2
    k = BLOCK + 3
    return k * unit / (1 - k * unit) + 2.0 ** -29


def as_rows(x: Tensor) -> Tensor:
    """x [B, ...] as [B, N] (a view where the layout allows; a 0-dim parameter's [B] as [B, 1])."""
    return x.flatten(1) if x.dim() > 1 else x.unsqueeze(1)


def _blocks(x: Tensor) -> tuple[Tensor, Tensor | None]:
    """x [B, N] as [B, N // BLOCK, BLOCK] and its last N % BLOCK columns (None if none)."""
    batch, n = x.shape
    whole = n - n % BLOCK
    head = x[:, :whole].reshape(batch, whole // BLOCK, BLOCK)
    return head, (x[:, whole:] if whole < n else None)


def sum_of_squares(x: Tensor) -> Tensor:
    """Σ_j x_j² over all but the first dim of ``x`` [B, ...] -> [B], blocked (module doc):
    relative error at most :func:`relative_bound` (3.9e-6 on the norm in float32), whatever
    the row's length. In float64 for float64 ``x``, else float32."""
    dtype = _working_dtype(x)
    flat = as_rows(x)
    if flat.numel() == 0:
        return torch.zeros(flat.shape[0], dtype=dtype, device=x.device)
    if flat.shape[1] <= BLOCK:   # one block: its bound already, in two kernels
        return torch.linalg.vector_norm(flat, dim=-1, dtype=dtype).square()
    head, tail = _blocks(flat)
    # vector_norm of each block, not Σ x²: no [B, N] temporary (and on the CPU 5-10x faster
    # than vecdot(x, x)). The blocks' norms are then summed in float64 by a second
    # vector_norm (its sqrt and the square add a few u₆₄), four kernels in all: on a GPU
    # each is a launch the host pays for. A contiguous row is one [B·N/k, k] reduction: on
    # the CPU as fast as the whole row at B 4, where the [B, N/k, k] form measured up to
    # 1.6x slower.
    if tail is None and flat.is_contiguous():
        blocks = torch.linalg.vector_norm(flat.view(-1, BLOCK), dim=-1, dtype=dtype).view(flat.shape[0], -1)
    else:
        blocks = torch.linalg.vector_norm(head, dim=-1, dtype=dtype)
    if tail is not None:
        blocks = torch.cat([blocks, torch.linalg.vector_norm(tail, dim=-1, dtype=dtype, keepdim=True)], dim=1)
    return torch.linalg.vector_norm(blocks, dim=-1, dtype=torch.float64).square().to(dtype)


def batched_dot(x: Tensor, y: Tensor) -> Tensor:
    """Σ over all but the first dim of x ⊙ y -> [B], blocked (module doc): absolute error at
    most :func:`relative_bound` · Σ_j |x_j y_j|. In float64 if either is float64, else float32.

    ``linalg.vecdot`` per block, not a [1, N] x [N, 1] bmm: on the CPU the bmm form is 10x
    slower (benchmarks/norm_rule.py prints both)."""
    dtype = torch.promote_types(_working_dtype(x), _working_dtype(y))
    fx, fy = as_rows(x), as_rows(y)
    if fx.dtype != dtype or fy.dtype != dtype:
        fx, fy = fx.to(dtype), fy.to(dtype)
    if fx.numel() == 0:
        return torch.zeros(fx.shape[0], dtype=dtype, device=x.device)
    if fx.shape[1] <= BLOCK:   # one block: its bound already, in one kernel
        return torch.linalg.vecdot(fx, fy, dim=-1)
    (hx, tx), (hy, ty) = _blocks(fx), _blocks(fy)
    # three kernels without a tail (a GPU's host pays for each launch): the blocks' dots,
    # their float64 sum, the rounding back
    total = torch.linalg.vecdot(hx, hy, dim=-1).sum(-1, dtype=torch.float64)
    if tx is not None:
        total = total + torch.linalg.vecdot(tx, ty, dim=-1)
    return total.to(dtype)


def running_sum(acc: Tensor | None, total: Tensor) -> Tensor:
    """``acc + total`` for a step's clipped sums across micro-batches, kept in float64 from the
    second micro-batch on (rounded once, in :func:`released_sum`, before the noise).

    A float32 running sum rounds at every add, and the rounding follows the partial sum: an
    adversary who picks the other rows can make two neighbouring data sets' sums round apart
    add after add (Casacuberta et al., CCS 2022). With one-row micro-batches and 3,848 rows one
    row then moved the release by 1.084·C. In float64 the adds drift by at most n·2^-53·Σ|x|;
    the one rounding to float32 by u·|S| per coordinate (docs/formulas.md, "Rounding of the sums")."""
    if acc is None:
        return total
    if acc.dtype != torch.float64:
        acc = acc.to(torch.float64)
    return acc.add_(total)


def released_sum(acc: Tensor, param: Tensor) -> Tensor:
    """A step's running sum in the dtype its noise is drawn in: float32 (float64 for a float64
    parameter), as a step of one micro-batch has it."""
    dtype = torch.float64 if param.dtype == torch.float64 else torch.float32
    return acc.to(dtype) if acc.dtype in (torch.float32, torch.float64) else acc   # (a half sum: as it came)


__all__ = ["BLOCK", "batched_dot", "relative_bound", "released_sum", "running_sum", "sum_of_squares"]
