"""A model wrapped in DistributedDataParallel (Opacus's DPDDP habit) is refused when the engine is
built, with the fix: dpclip is data-parallel without the wrapper (docs/python-api.md, "Several
processes"). Before, it ran until the first backward, where DDP's reducer had put autograd's raw
gradients in ``p.grad`` (all-reduced over the ranks) and the refusal blamed the model's forward."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import dpclip
from dpclip.engine import DPEngine
from dpclip.errors import DpclipError
from dpclip.torch_compat import import_dynamo


@pytest.fixture
def one_rank_group():
    """A gloo process group of one rank in this process (DDP needs one), left after the test."""
    import_dynamo()   # before the group, as joined_world does (dpclip/distributed/world.py)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_a_model_wrapped_in_ddp_is_refused_when_the_engine_is_built_with_the_unwrapped_fix(one_rank_group):
    torch.manual_seed(0)
    wrapped = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2)))
    with pytest.raises(DpclipError) as refused:
        DPEngine(wrapped, {"grouping": "all-layer", "threshold": {"kind": "fixed", "value": 1.0}},
                 gradient_noise_multiplier=1.0, expected_batch_size=4)
    assert "DistributedDataParallel" in refused.value.message
    assert "ddp.module" in refused.value.hint
    data = TensorDataset(torch.randn(8, 4), torch.randint(0, 2, (8,)))
    with pytest.raises(DpclipError) as refused:   # the user's path: nothing was drawn, nothing charged
        dpclip.make_private(wrapped, torch.optim.SGD(wrapped.parameters(), lr=0.1), DataLoader(data, batch_size=4),
                            criterion=nn.CrossEntropyLoss(), delta=1e-5, noise_multiplier=1.0, steps=2,
                            max_grad_norm=1.0)
    assert "DistributedDataParallel" in refused.value.message


def test_a_model_wrapped_in_ddp_after_make_private_is_refused_with_the_unwrapped_hint(one_rank_group):
    """accelerate's prepare wraps the model after make_private built the engine: refused at the first
    backward (nothing released, nothing charged), and the hint says what to do."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2))
    data = TensorDataset(torch.randn(8, 4), torch.randint(0, 2, (8,)))
    private = dpclip.make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), DataLoader(data, batch_size=4),
                                  criterion=nn.CrossEntropyLoss(), delta=1e-5, noise_multiplier=1.0, steps=2,
                                  max_grad_norm=1.0)
    model, optimizer, criterion, loader = private
    wrapped = nn.parallel.DistributedDataParallel(model)
    x, y = next(iter(loader))
    with pytest.raises(DpclipError) as refused:
        criterion(wrapped(x), y).backward()
    assert "DistributedDataParallel" in refused.value.hint and private.ledger.steps == 0
