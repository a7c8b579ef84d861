"""The rounding attack: an example whose per-sample gradient has entries of one size.

An instantiated gradient G_i's norm is a sum of m·n squares. Summed in a few dozen running
float32 accumulators (torch's reduction), the round-off grows with m·n and, when every
entry has the same size, goes one way: with activations and output gradients all 0.7, the
3072 x 768 gradient's norm came out 1.35e-3 too small, and removing that one example moved
the clipped sum by C·(1 + 1.35e-3): past the invariant ‖c_i G_i‖ ≤ C·(1 + 10⁻⁵) that the
noise is calibrated to. The engine sums squares in blocks (dpclip/engine/sums.py;
docs/formulas.md, "Rounding of a norm"). Tested here through the engine's own clipped
sums, on each path an instantiated norm takes: all-layer (the parameter's G_i), layer-wise
one sample at a time (G_i of 2^20 entries and more on the CPU) and in batched chunks, and
the ghost norm beside them, whose Gram entries are sums over a factor's width: wide
factors are read in panels for the same reason.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dpclip.engine import DPEngine
from dpclip.engine.cancellation import CANCELLATION_TOLERANCE, cancellation_flags
from dpclip.engine.factors import Bilinear, param_norm_sq
from tests.privacy.test_norm_cancellation import C, SLACK, group_contributions

# (activation, output gradient) entries: each moved the sum past C with the whole-row norm
# (+1.35e-3, +9.2e-4, +3.8e-4 on the 3072 x 768 weight)
CONSTANTS = [(0.7, 0.7), (0.1, 0.7), (1.1, 1 / 3)]


class ConstantProbe(nn.Module):
    """y = W a; per-sample loss Σ_t ⟨y_t, v⟩ with v constant: G = T·v aᵀ when a is too."""

    def __init__(self, d: int, p: int, v: float):
        super().__init__()
        self.lin = nn.Linear(d, p, bias=False)
        self.register_buffer("v", torch.full((p,), v))

    def forward(self, x):
        return (self.lin(x) * self.v).sum((1, 2))


@pytest.mark.parametrize("a, v", CONSTANTS)
@pytest.mark.parametrize("grouping, method, d, p", [
    ("all-layer", "instantiate", 768, 3072),
    ("layer", "instantiate", 768, 3072),      # one sample at a time
    ("layer", "instantiate", 512, 1024),      # batched chunks
    ("param", "instantiate", 3072, 768),
    ("all-layer", "ghost", 768, 3072),
])
def test_constant_entry_example_moves_no_group_by_more_than_c(grouping, method, d, p, a, v):
    torch.manual_seed(0)
    model = ConstantProbe(d, p, v)
    x = torch.cat([torch.full((1, 4, d), a), 0.01 * torch.randn(3, 4, d)])

    def make_engine():
        return DPEngine(model, {"grouping": grouping, "norm_method": method,
                                "threshold": {"kind": "fixed", "value": C}},
                        gradient_noise_multiplier=0.0, expected_batch_size=4)

    contributions = group_contributions(make_engine, lambda m, batch: m(batch), x, x[1:])
    assert C * 0.5 < max(contributions) <= C * SLACK, contributions


@pytest.mark.parametrize("m, n, t", [(32768, 768, 4), (256, 65536, 2)])
def test_ghost_norm_of_a_wide_constant_factor_is_within_the_tolerance(m, n, t):
    """A Gram entry is a GEMM's sum over the factor's width; on constant rows its round-off
    grows with the width in one direction (4.7e-5 of the norm² at 65536 before the Grams of
    wide factors were read in panels, grams.GHOST_ROUNDING_MAX_WIDTH). Unflagged, a ghost
    norm² must be within CANCELLATION_TOLERANCE of the exact one (docs/formulas.md)."""
    worst = 0.0
    for a in (0.7, 1 / 3, 1.1, 0.1):
        for v in (0.7, 1 / 3, 1.1, 0.1):
            left, right = torch.full((1, 1, t, m), a), torch.full((1, 1, t, n), v)
            got, _, atoms = param_norm_sq([Bilinear(left, right)], torch.Size([m, n]), "ghost", with_atoms=True)
            assert not bool(cancellation_flags([Bilinear(left, right)], got, atoms)[0])
            # G = T·a·v in each of its m·n entries, for the stored float32 a and v: their
            # product is exact in float64, so this is exact to one float64 rounding
            stored = float(left[0, 0, 0, 0].double() * right[0, 0, 0, 0].double())
            exact = m * n * (t * stored) ** 2
            worst = max(worst, 1 - float(got[0]) / exact)
    assert worst <= CANCELLATION_TOLERANCE, worst
