"""The Linear rule (dpclip/engine/layers/linear.py) against a per-example loop."""

import torch
from hypothesis import given, settings, strategies as st
from torch import nn

from tests.engine.conftest import DTYPE, check_exact, classify_loss


class _OneLayer(nn.Module):
    def __init__(self, layer, head_in):
        super().__init__()
        self.layer, self.head = layer, nn.Linear(head_in, 3)

    def forward(self, x):
        h = torch.tanh(self.layer(x))
        return self.head(h.flatten(1, -2).mean(1) if h.dim() > 2 else h)


@settings(max_examples=6, deadline=None)
@given(lead=st.lists(st.integers(1, 3), max_size=2), d=st.integers(1, 4), p=st.integers(1, 4),
       bias=st.booleans(), method=st.sampled_from(["auto", "ghost", "instantiate"]))
def test_linear_with_any_leading_dims_matches_per_example_loop(lead, d, p, bias, method):
    gen = torch.Generator().manual_seed(len(lead) * 100 + d * 10 + p)
    batch = {"x": torch.randn(4, *lead, d, generator=gen, dtype=DTYPE),
             "y": torch.randint(0, 3, (4,), generator=gen)}
    check_exact(lambda: _OneLayer(nn.Linear(d, p, bias=bias), p).to(DTYPE), classify_loss, batch,
                "param", norm_method=method)
