"""A forward hook on the model itself, registered before the engine, as the attacker: a pre-hook
that centres the batch (``x - x.mean(0)``) mixes every sample into every other's gradient. The
certificate records the rows before any hook of the user's runs and replays them without hooks,
so such a hook is refused before any noise, and make_private charges and releases nothing
(docs/certificate.md)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import dpclip
from dpclip.engine import DPEngine
from dpclip.errors import EngineError
from tests.privacy.conftest import counted_releases


def centre(module, args):
    return (args[0] - args[0].mean(0),)


class SharedDraw(nn.Module):
    """One random number for the whole batch: the check replays the batch, not samples alone."""

    def forward(self, x):
        return x + 0.1 * torch.rand(1)


def _model(shared_draw: bool) -> nn.Sequential:
    torch.manual_seed(0)
    layers = [nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3)]
    model = nn.Sequential(*([SharedDraw()] if shared_draw else []), *layers)
    model.register_forward_pre_hook(centre)
    return model


@pytest.mark.parametrize("shared_draw", [False, True], ids=["plain", "random forward"])
def test_a_pre_hook_on_the_model_that_centres_the_batch_is_refused_before_noise(shared_draw):
    model = _model(shared_draw)
    engine = DPEngine(model, {"threshold": {"kind": "fixed", "value": 1.0}}, gradient_noise_multiplier=1.0,
                      expected_batch_size=6)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(6, 5, generator=g) + 3, torch.randint(0, 3, (6,), generator=g)
    with pytest.raises(EngineError, match="mixes samples") as caught:
        engine.backward(F.cross_entropy(model(x), y, reduction="none"))
    assert "the model itself has forward hooks" in caught.value.hint
    assert all(p.grad is None for p in model.parameters())


def test_make_private_refuses_a_centring_pre_hook_on_the_model_and_charges_nothing():
    model = _model(False)
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(200, 5, generator=g) + 3, torch.randint(0, 3, (200,), generator=g))
    with pytest.warns(UserWarning, match="unsafe_seed"):
        private = dpclip.make_private(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                      DataLoader(data, batch_size=40), criterion=nn.CrossEntropyLoss(),
                                      delta=1e-5, noise_multiplier=1.0, steps=20, max_grad_norm=1.0, unsafe_seed=3)
    released = counted_releases(private)
    model, optimizer, criterion, loader = private
    x, y = next(iter(loader))
    with pytest.raises(EngineError, match="mixes samples"):
        criterion(model(x), y).backward()
    assert released == [] and private.ledger.steps == 0


def test_a_centring_pre_hook_prepended_after_the_engine_is_refused():
    """prepend=True after the engine puts the hook before the engine's own: refused at the forward."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3))
    engine = DPEngine(model, {"threshold": {"kind": "fixed", "value": 1.0}}, gradient_noise_multiplier=1.0,
                      expected_batch_size=6)
    model.register_forward_pre_hook(centre, prepend=True)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(6, 5, generator=g) + 3, torch.randint(0, 3, (6,), generator=g)
    with pytest.raises(EngineError, match="prepend=True"):
        engine.backward(F.cross_entropy(model(x), y, reduction="none"))
    assert all(p.grad is None for p in model.parameters())
