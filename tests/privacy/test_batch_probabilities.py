"""A random mask drawn with probabilities computed over the batch (``bernoulli(sigmoid(h.mean(0)))``,
``bernoulli_(p)``, ``multinomial(p)``) makes every sample's mask, and so its clipped gradient,
depend on every other sample: replacing one row moves the others' contributions, and the clipped
sum's sensitivity is no longer C. The certificate's replay of one sample alone gets that sample's
part of the recorded outcome, which hid this; it now compares the probabilities the draw was
handed in the batch with the sample's own and refuses before any noise (docs/certificate.md)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dpclip.engine import DPEngine
from dpclip.errors import EngineError


def _bernoulli(h, p):
    return h * torch.bernoulli(p)


def _bernoulli_in_place(h, p):
    return h * torch.empty_like(h).bernoulli_(p.contiguous())


def _multinomial(h, p):
    picked = torch.multinomial(p / p.sum(1, keepdim=True), 2, replacement=True)
    return h * F.one_hot(picked, h.shape[1]).sum(1).to(h.dtype)


class MaskedNet(nn.Module):
    """A hidden layer masked at random; ``over_batch``: the keep probabilities come from the
    batch's mean activation (detached), else from each sample's own."""

    def __init__(self, draw, over_batch: bool):
        super().__init__()
        self.inner, self.head = nn.Linear(6, 6), nn.Linear(6, 3)
        self.draw, self.over_batch = draw, over_batch

    def forward(self, x):
        h = torch.tanh(self.inner(x))
        source = h.mean(0, keepdim=True).expand_as(h) if self.over_batch else h
        return self.head(self.draw(h, torch.sigmoid(20 * source).detach()))


def _losses(model, x, y, seed):
    torch.manual_seed(seed)
    return F.cross_entropy(model(x), y, reduction="none")


def _engine(model):
    return DPEngine(model, {"grouping": "all-layer", "threshold": {"kind": "fixed", "value": 1.0}},
                    gradient_noise_multiplier=1.0, expected_batch_size=8)


def _batch():
    g = torch.Generator().manual_seed(3)
    return torch.randn(8, 6, generator=g, dtype=torch.float64), torch.randint(0, 3, (8,), generator=g)


def test_probabilities_over_the_batch_make_one_rows_mask_move_anothers():
    torch.manual_seed(0)
    model = MaskedNet(_bernoulli, over_batch=True).double()
    x, y = _batch()
    replaced = x.clone()
    replaced[0] = torch.randn(6, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    row = [torch.autograd.grad(_losses(model, inputs, y, seed=5)[3], model.head.weight)[0]
           for inputs in (x, replaced)]
    assert not torch.equal(row[0], row[1])   # row 3's gradient moved with row 0: the coupling is real


@pytest.mark.parametrize("draw", [_bernoulli, _bernoulli_in_place, _multinomial])
def test_a_mask_drawn_with_probabilities_over_the_batch_is_refused_before_any_noise(draw):
    torch.manual_seed(0)
    model = MaskedNet(draw, over_batch=True).double()
    engine = _engine(model)
    noise = engine.noise.generator(torch.device("cpu"))
    before = noise.get_state().clone()
    x, y = _batch()
    with pytest.raises(EngineError, match="random draw .* other probabilities") as refused:
        engine.backward(_losses(model, x, y, seed=5))
    assert "own values" in refused.value.hint
    assert torch.equal(noise.get_state(), before)
    engine.detach()


@pytest.mark.parametrize("draw", [_bernoulli, _bernoulli_in_place, _multinomial])
def test_a_mask_drawn_with_each_samples_own_probabilities_trains(draw):
    torch.manual_seed(0)
    model = MaskedNet(draw, over_batch=False)
    engine = _engine(model)
    x, y = _batch()
    engine.backward(_losses(model, x.float(), y, seed=5))
    engine.privatize()
    assert engine.certificate.last.mode == "alone"
    engine.detach()
