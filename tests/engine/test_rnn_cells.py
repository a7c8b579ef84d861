"""nn.LSTMCell / nn.GRUCell / nn.RNNCell stepped in a Python loop: T uses of one cell.

The cells have no layer rule (torch.func fallback). The first step gets hx=None and builds
its zero state inside the forward, which vmap cannot write into; the later steps vmap
fine. The fallback used to learn "vmap works" from the first call it saw and then
re-raise the other kind's error. Each case runs against the float64 per-example loop.
"""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st
from torch import nn

from tests.engine.conftest import DTYPE, check_exact

CELLS = ["LSTMCell", "GRUCell", "RNNCell"]


class CellLoop(nn.Module):
    def __init__(self, kind, d_in, hidden, given_state=False, bias=True):
        super().__init__()
        self.cell = getattr(nn, kind)(d_in, hidden, bias=bias)
        self.head = nn.Linear(hidden, 3)
        self.given_state, self.hidden, self.kind = given_state, hidden, kind

    def forward(self, x):                                   # x: [B, T, d_in]
        state = None
        if self.given_state:                                # a state built by the caller
            h0 = torch.tanh(x[:, 0, :1]).expand(-1, self.hidden) * 0.5
            state = (h0, h0 * 0.3) if self.kind == "LSTMCell" else h0
        for t in range(x.shape[1]):
            state = self.cell(x[:, t], state)
        h = state[0] if isinstance(state, tuple) else state
        return self.head(h)


def cell_loss(model, batch):
    return F.cross_entropy(model(batch["x"]), batch["y"], reduction="none")


def cell_batch(n, t, d, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"x": torch.randn(n, t, d, generator=g, dtype=DTYPE),
            "y": torch.randint(0, 3, (n,), generator=g)}


@pytest.mark.parametrize("kind", CELLS)
@pytest.mark.parametrize("given_state", [False, True], ids=["hx-None", "hx-given"])
@pytest.mark.parametrize("grouping", ["all-layer", "param"])
def test_a_cell_stepped_in_a_loop_is_exact(kind, given_state, grouping):
    check_exact(lambda: CellLoop(kind, 3, 4, given_state).to(DTYPE), cell_loss,
                cell_batch(5, 3, 3), grouping)


@pytest.mark.parametrize("kind", CELLS)
@pytest.mark.parametrize("method", ["ghost", "instantiate"])
def test_a_cell_loop_is_exact_over_two_micro_batches(kind, method):
    check_exact(lambda: CellLoop(kind, 3, 4).to(DTYPE), cell_loss, cell_batch(5, 4, 3, seed=1),
                "layer", norm_method=method, micro=[2, 3])


@settings(max_examples=25, deadline=None)
@given(kind=st.sampled_from(CELLS), batch=st.integers(1, 5), steps=st.integers(1, 5),
       d_in=st.integers(1, 5), hidden=st.integers(1, 5), bias=st.booleans(),
       seed=st.integers(0, 2**16))
def test_property_cell_loops_are_exact_at_any_shape(kind, batch, steps, d_in, hidden, bias, seed):
    """B = 1, B = T, B = T + 1, B = hidden size and generic shapes."""
    check_exact(lambda: CellLoop(kind, d_in, hidden, bias=bias).to(DTYPE), cell_loss,
                cell_batch(batch, steps, d_in, seed), "all-layer",
                fn="auto" if batch == 1 else "abadi")
