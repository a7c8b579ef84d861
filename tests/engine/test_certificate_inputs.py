"""A forward that changes its inputs in place (``x.mul_(2)``) is per sample, and passes the
certificate: the check copies a checked forward's inputs before it runs, and its replays run on
copies of those rows, the rows the real forward saw (docs/certificate.md). The engine's probes of
the batch axis run on copies too, so the training forward sees its rows unchanged by them. One
that mixes the batch in place is still refused."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dpclip.engine import DPEngine
from dpclip.errors import EngineError


class Doubling(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(5, 3)

    def forward(self, x):
        x.mul_(2)
        return self.lin(x)


class CenteringInPlace(Doubling):
    def forward(self, x):
        x.sub_(x.mean(0))   # every row moved by the batch's mean
        return self.lin(x)


def _data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(6, 5, generator=g, dtype=torch.float64), torch.randint(0, 3, (6,), generator=g)


def _engine(model):
    return DPEngine(model, {"threshold": {"kind": "fixed", "value": 1.0}}, gradient_noise_multiplier=0.0,
                    expected_batch_size=6)


def _sum_of_clipped(model, x, y):
    """The per-example reference: each sample's gradient on its own row (doubled, as the forward
    does), clipped to 1, summed."""
    total = [torch.zeros_like(p) for p in model.parameters()]
    for i in range(len(x)):
        model.zero_grad()
        F.cross_entropy(model.lin(2 * x[i:i + 1]), y[i:i + 1]).backward()
        norm = torch.cat([p.grad.flatten() for p in model.parameters()]).norm()
        for t, p in zip(total, model.parameters()):
            t += p.grad * min(1.0, 1.0 / float(norm))
    model.zero_grad()
    return total


def test_a_forward_that_doubles_its_input_in_place_passes_the_check_and_clips_each_row_exactly():
    torch.manual_seed(0)
    model = Doubling().double()
    x, y = _data()
    expected = _sum_of_clipped(model, x.clone(), y)
    engine = _engine(model)
    given = x.clone()
    engine.backward(F.cross_entropy(model(x), y, reduction="none"))
    engine.privatize()
    assert engine.certificate.checks == 1
    torch.testing.assert_close(x, 2 * given)   # the forward's own change, once: the probes changed nothing
    for p, e in zip(model.parameters(), expected):
        torch.testing.assert_close(p.grad * 6, e)   # privatize's mean over the expected batch of 6


def test_a_forward_that_centres_its_input_in_place_is_still_refused_as_mixing():
    torch.manual_seed(0)
    model = CenteringInPlace().double()
    x, y = _data()
    engine = _engine(model)
    with pytest.raises(EngineError, match="mixes samples"):
        engine.backward(F.cross_entropy(model(x), y, reduction="none"))
