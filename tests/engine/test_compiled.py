"""A model compiled with ``torch.compile`` (issue 52): dynamo compiles what it can trace and the
engine's book-kept calls run eagerly between its graphs; the clipping is the per-example
reference's. (One compiled graph for the whole private step is issue 54's.)"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.engine.conftest import DTYPE, check_exact


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp, self.norm, self.out = nn.Linear(5, 8), nn.LayerNorm(8), nn.Linear(8, 3)

    def forward(self, x):
        return self.out(torch.tanh(self.norm(self.inp(x))).mean(1))


def _loss(model, batch):
    return F.cross_entropy(model(batch["x"]), batch["y"], reduction="none")


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_a_compiled_model_clips_as_the_per_example_reference(backend):
    def make():
        torch.manual_seed(0)
        return torch.compile(Net().to(DTYPE), backend=backend)
    g = torch.Generator().manual_seed(1)
    batch = {"x": torch.randn(6, 4, 5, generator=g, dtype=DTYPE), "y": torch.randint(0, 3, (6,), generator=g)}
    check_exact(make, _loss, batch, grouping="layer", micro=[2, 4])
