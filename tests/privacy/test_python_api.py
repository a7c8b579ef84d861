"""An attacker holding the code and every argument of make_private cannot regenerate its
batches or its noise (docs/python-api.md, docs/accounting.md "Randomness")."""

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import dpclip


def _first_draw_and_noise(**kwargs):
    torch.manual_seed(0)   # the model's initialisation: public, and the same for both runs
    model = nn.Linear(4, 2)
    data = TensorDataset(torch.arange(400.0).reshape(100, 4), torch.zeros(100, dtype=torch.int64))
    private = dpclip.make_private(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                  DataLoader(data, batch_size=20), criterion=nn.CrossEntropyLoss(), delta=1e-5,
                                  noise_multiplier=1.0, steps=2, max_grad_norm=1.0, **kwargs)
    model, optimizer, criterion, loader = private
    x, y = next(iter(loader))
    optimizer.zero_grad()
    criterion(model(x), y).backward()
    optimizer.step()
    return x[:, 0].tolist(), model.weight.detach().clone(), private


def test_two_identical_calls_draw_other_batches_and_other_noise():
    rows_a, weight_a, private = _first_draw_and_noise()
    rows_b, weight_b, _ = _first_draw_and_noise()
    # 100 examples at q = 0.2: the chance two independent draws agree is below 1e-20
    assert rows_a != rows_b
    assert not torch.equal(weight_a, weight_b)
    assert not any("seed" in line and "derived" in line for line in private.statement())


def test_a_seed_reproduces_them_only_when_asked_and_then_warns_and_says_so():
    with pytest.warns(UserWarning, match="voids the guarantee"):
        rows_a, weight_a, private = _first_draw_and_noise(unsafe_seed=7)
    with pytest.warns(UserWarning):
        rows_b, weight_b, _ = _first_draw_and_noise(unsafe_seed=7)
    assert rows_a == rows_b and torch.equal(weight_a, weight_b)
    assert private.plan.plan.seeded_randomness
    assert any(line.startswith("noise and batch sampling:") and "seed" in line for line in private.statement())
