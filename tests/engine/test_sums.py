"""Blocked per-sample sums: their round-off is bounded by γ_(BLOCK+3), whatever the length.

The exact value is the float64 sum of the stored (float32 or half) entries: every product of
two float32 numbers is exact in float64, and a float64 sum of up to 10^7 such terms is
within 10^-9 of exact, far below the float32 bound under test.
"""

from __future__ import annotations

import pytest
import torch

from dpclip.engine.groupwise import concatenated_norm_sq
from dpclip.engine.sums import BLOCK, batched_dot, relative_bound, sum_of_squares

CONSTANTS = [1 / 3, 0.7, 1.1, 0.1]
LENGTHS = [3072 * 768, 4097, BLOCK + 1, BLOCK, 7]


def _exact_sq(x: torch.Tensor) -> torch.Tensor:
    return x.double().flatten(1).square().sum(1)


@pytest.mark.parametrize("value", CONSTANTS)
@pytest.mark.parametrize("length", LENGTHS)
def test_sum_of_squares_of_a_constant_row_is_within_the_blocked_bound(value, length):
    """Constant entries are the worst case of a running accumulator (every rounding goes one
    way): torch's whole-row vector_norm was 1.7e-3 off on the 3072·768 row."""
    x = torch.full((2, length), value)
    x[1] *= 3
    got = sum_of_squares(x)
    exact = _exact_sq(x)
    assert got.dtype == torch.float32
    assert torch.all((got.double() - exact).abs() <= relative_bound(torch.float32) * exact)


def test_sum_of_squares_takes_any_shape_and_layout_and_keeps_rows_apart():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 40, 77, generator=g)
    strided = x.transpose(1, 2)                    # not contiguous
    got = sum_of_squares(strided)
    exact = _exact_sq(x)
    assert torch.all((got.double() - exact).abs() <= relative_bound(torch.float32) * exact)
    for i in range(3):
        assert float(sum_of_squares(x[i:i + 1])[0]) == pytest.approx(float(exact[i]), rel=relative_bound(torch.float32))
    assert sum_of_squares(torch.zeros(2, 0)).tolist() == [0.0, 0.0]
    assert sum_of_squares(torch.zeros(0, 300)).shape == (0,)                 # an empty batch
    assert batched_dot(torch.zeros(0, 300), torch.zeros(0, 300)).shape == (0,)
    assert sum_of_squares(torch.tensor([3.0, -4.0])).tolist() == [9.0, 16.0]   # [B]: one entry each


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_rows_are_summed_in_float32(dtype):
    """A half-precision result would round the norm² at 2^-8 (bf16); the sum is float32."""
    x = torch.full((1, 3072 * 4), 0.7).to(dtype)
    got = sum_of_squares(x)
    exact = _exact_sq(x)
    assert got.dtype == torch.float32
    assert abs(float(got[0]) - float(exact[0])) <= relative_bound(dtype) * float(exact[0])
    assert relative_bound(dtype) == relative_bound(torch.float32)


def test_float64_rows_stay_float64_with_their_own_bound():
    x = torch.full((1, 10_000), 1 / 3, dtype=torch.float64)
    got = sum_of_squares(x)
    assert got.dtype == torch.float64
    assert relative_bound(torch.float64) < 2e-9     # the float64 sum of up to 2^24 blocks
    assert abs(float(got[0]) - 10_000 / 9) <= 1e-9


@pytest.mark.parametrize("length", [3072 * 768, 1000, BLOCK, 5])
def test_batched_dot_error_is_bounded_by_the_absolute_products(length):
    """Signed terms may cancel: the bound is γ·Σ|x_j y_j|, not relative to the result."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, length, generator=g).abs() * 0.7 + 0.1
    y = torch.full((2, length), 1 / 3)
    y[1, ::2] = -1 / 3
    got = batched_dot(x, y)
    exact = (x.double() * y.double()).sum(1)
    scale = (x.double() * y.double()).abs().sum(1)
    assert got.dtype == torch.float32
    assert torch.all((got.double() - exact).abs() <= relative_bound(torch.float32) * scale)


def test_batched_dot_promotes_to_the_wider_dtype():
    x = torch.ones(2, 300, dtype=torch.bfloat16)
    y = torch.ones(2, 300, dtype=torch.float64)
    assert batched_dot(x, y).dtype == torch.float64
    assert batched_dot(x, x.float()).dtype == torch.float32
    assert batched_dot(x, y).tolist() == [300.0, 300.0]


def test_a_groups_concatenated_small_gradients_get_the_blocked_norm():
    """The small instantiated gradients of a group (biases, LayerNorm affines) are normed
    together as one long row: the same bound must hold there."""
    grads = [torch.full((2, 3072 * 64), 0.7), torch.full((2, 3072 * 64, 1), 1 / 3)]
    flat, sq = concatenated_norm_sq(grads)
    exact = _exact_sq(flat)
    assert torch.all((sq.double() - exact).abs() <= relative_bound(torch.float32) * exact)


def _kernels(fn) -> int:
    """aten operations a call makes that are not views (on a GPU each is a launch)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    views = {"view", "_unsafe_view", "slice", "unsqueeze", "reshape", "alias", "detach", "promote_types"}
    count = 0

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            nonlocal count
            count += func.__name__.split(".")[0] not in views
            return func(*args, **(kwargs or {}))

    with Count():
        fn()
    return count


def test_blocked_sums_launch_few_kernels():
    """A GPU step is bound by its host: each kernel is a launch it pays for, one per
    parameter and step (docs/performance.md). A row of one block is one reduction (a dot
    product on the CPU is a product and its sum); a long contiguous row four kernels,
    whatever its length."""
    short, long_ = torch.ones(4, BLOCK), torch.ones(4, 512 * BLOCK)
    assert _kernels(lambda: sum_of_squares(short)) <= 2
    assert _kernels(lambda: batched_dot(short, short)) <= 2
    assert _kernels(lambda: sum_of_squares(long_)) <= 4
    assert _kernels(lambda: batched_dot(long_, long_)) <= 4
