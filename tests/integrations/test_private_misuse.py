"""make_private under loops that misuse it: refused with a hint before anything is released,
where torch's own error (or a misleading one) came before (docs/python-api.md, "What the loop
must do")."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import dpclip
from dpclip.errors import DpclipError


def _private():
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(64, 5), torch.randint(0, 3, (64,)))
    model = nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 3))
    return dpclip.make_private(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                               criterion=nn.CrossEntropyLoss(), data_loader=DataLoader(data, batch_size=16),
                               steps=3, noise_multiplier=1.0, max_grad_norm=1.0, delta=1e-5)


def test_a_backward_of_a_loss_from_a_forward_without_gradients_is_refused_with_a_hint():
    private = _private()
    model, optimizer, criterion, loader = private
    x, y = next(iter(loader))
    with torch.no_grad():
        outputs = model(x)
    loss = criterion(outputs, y)
    with pytest.raises(DpclipError, match="without gradients") as refused:
        loss.backward()
    assert "gradients on" in refused.value.hint
    assert private.ledger.steps == 0


def test_a_loop_going_on_after_the_engine_was_detached_is_refused_and_leaves_no_raw_gradient():
    private = _private()
    model, optimizer, criterion, loader = private
    batches = iter(loader)
    x, y = next(batches)
    criterion(model(x), y).backward()
    optimizer.step()
    private.engine.detach()
    optimizer.zero_grad()
    x, y = next(batches)
    loss = criterion(model(x), y)
    with pytest.raises(DpclipError, match="detached") as refused:
        loss.backward()
    assert "make_private" in refused.value.hint
    assert all(p.grad is None for p in model.parameters())
    assert private.ledger.steps == 1
