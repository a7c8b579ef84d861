"""A model with the engine attached, copied whole (``copy.deepcopy(model)`` for an EMA model,
``torch.save(model)``), would take the engine along through its hooks, the noise generator's
state included: refused with a hint to copy the weights (it was a TypeError about a lock)."""

from __future__ import annotations

import copy
import io

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import dpclip
from dpclip.errors import DpclipError


def _one_step():
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(64, 5), torch.randint(0, 3, (64,)))
    model = nn.Sequential(nn.Linear(5, 4), nn.ReLU(), nn.Linear(4, 3))
    ema = copy.deepcopy(model)   # before make_private: the way the hint says
    private = dpclip.make_private(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                  criterion=nn.CrossEntropyLoss(), data_loader=DataLoader(data, batch_size=16),
                                  steps=3, noise_multiplier=1.0, max_grad_norm=1.0, delta=1e-5)
    model, optimizer, criterion, loader = private
    x, y = next(iter(loader))
    criterion(model(x), y).backward()
    optimizer.step()
    return model, ema


@pytest.mark.parametrize("copy_whole", [copy.deepcopy, lambda model: torch.save(model, io.BytesIO())],
                         ids=["deepcopy", "torch.save"])
def test_a_model_with_the_engine_attached_copied_whole_is_refused_with_a_hint(copy_whole):
    model, _ = _one_step()
    with pytest.raises(DpclipError, match="copied or pickled whole") as refused:
        copy_whole(model)
    assert "state_dict" in refused.value.hint


def test_a_copy_made_before_make_private_takes_the_trained_weights():
    model, ema = _one_step()
    ema.load_state_dict(model.state_dict())
    x = torch.randn(3, 5)
    assert torch.equal(ema(x), model(x))


def test_a_private_loss_squared_stays_per_sample():
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(32, 5), torch.randint(0, 3, (32,)))
    model = nn.Linear(5, 3)
    model, optimizer, criterion, loader = dpclip.make_private(
        model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), criterion=nn.CrossEntropyLoss(),
        data_loader=DataLoader(data, batch_size=8), steps=2, noise_multiplier=1.0, max_grad_norm=1.0, delta=1e-5)
    x, y = next(iter(loader))
    loss = criterion(model(x), y)
    squared = loss ** 2
    assert torch.equal(squared.per_sample, loss.per_sample ** 2)
