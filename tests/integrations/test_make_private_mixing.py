"""make_private refuses models that mix samples, naming the module, before any noise or charge
(the certificate: docs/certificate.md)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import dpclip
from dpclip.errors import EngineError
from tests.engine.mixing_models import Center, CopyRow, FunctionalBatchNorm


@pytest.mark.parametrize("mixer, named", [(Center, "1 (Center)"),
                                          (lambda: FunctionalBatchNorm(16), "1 (FunctionalBatchNorm)"),
                                          (lambda: CopyRow(16), "buffer 1.row")])
def test_make_private_refuses_a_mixing_model_at_its_first_step(mixer, named):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), mixer(), nn.ReLU(), nn.Linear(16, 3))
    data = TensorDataset(torch.randn(200, 8), torch.randint(0, 3, (200,)))
    private = dpclip.make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), DataLoader(data, batch_size=20),
                                  criterion=nn.CrossEntropyLoss(), target_epsilon=4.0, delta=1e-5, steps=5,
                                  max_grad_norm=1.0)
    model, optimizer, criterion, loader = private
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(EngineError) as err:
        for x, y in loader:
            if len(x) < 3:
                continue
            optimizer.zero_grad()
            criterion(model(x), y).backward()
            optimizer.step()
    assert named in err.value.message and err.value.hint
    assert private.epsilon() == 0.0                      # nothing charged
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))   # nothing released
