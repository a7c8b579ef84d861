"""Trainable tensors outside the model the engine clips, as the attacker: a classifier head or a
learnable temperature applied to the model's output in the loss. autograd would put the whole
batch's raw gradient into their ``.grad`` and the user's optimizer would step it, unclipped and
unnoised: ``engine.backward`` refuses such losses before any backward (docs/engine.md)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dpclip.engine import DPEngine
from dpclip.errors import EngineError


def _setup():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 6), nn.Tanh())
    engine = DPEngine(model, {"threshold": {"kind": "fixed", "value": 1.0}}, gradient_noise_multiplier=1.0,
                      expected_batch_size=8)
    g = torch.Generator().manual_seed(1)
    return model, engine, torch.randn(8, 5, generator=g), torch.randint(0, 3, (8,), generator=g)


OUTSIDE = {
    "a head outside the model": lambda head, temp, out: head(out),
    "a learnable temperature": lambda head, temp, out: out[:, :3] * temp.exp(),
}


@pytest.mark.parametrize("use", OUTSIDE.values(), ids=list(OUTSIDE))
def test_losses_through_a_trainable_tensor_outside_the_model_are_refused_before_backward(use):
    model, engine, x, y = _setup()
    head, temp = nn.Linear(6, 3), nn.Parameter(torch.zeros(()))
    with pytest.raises(EngineError, match="outside the model the engine clips") as caught:
        engine.backward(F.cross_entropy(use(head, temp, model(x)), y, reduction="none"))
    assert "requires_grad=False" in caught.value.hint
    assert head.weight.grad is None and temp.grad is None
    assert all(p.grad is None for p in model.parameters())


def test_a_frozen_head_outside_the_model_passes():
    model, engine, x, y = _setup()
    head = nn.Linear(6, 3).requires_grad_(False)
    engine.backward(F.cross_entropy(head(model(x)), y, reduction="none"))
    engine.privatize()
    assert all(p.grad is not None for p in model.parameters()) and head.weight.grad is None


def test_a_head_outside_the_model_inside_a_reentrant_checkpoint_is_refused_too():
    """The checkpoint's parameters are not leaves of the losses' graph: its function is looked into."""
    model, engine, x, y = _setup()
    head = nn.Linear(6, 3)
    logits = torch.utils.checkpoint.checkpoint(head, model(x), use_reentrant=True)
    with pytest.raises(EngineError, match="outside the model the engine clips"):
        engine.backward(F.cross_entropy(logits, y, reduction="none"))
    assert head.weight.grad is None


def test_an_activation_made_a_leaf_by_an_input_gradient_hook_passes():
    """HF's enable_input_require_grads (on under gradient checkpointing, e.g. with LoRA) makes a frozen
    embedding's output a leaf that requires grad: an activation, not a parameter anyone steps."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(10, 6), nn.Tanh(), nn.Flatten(), nn.Linear(18, 3))
    model[0].requires_grad_(False)
    model[0].register_forward_hook(lambda module, args, out: out.requires_grad_(True))
    engine = DPEngine(model, {"threshold": {"kind": "fixed", "value": 1.0}}, gradient_noise_multiplier=1.0,
                      expected_batch_size=8)
    g = torch.Generator().manual_seed(1)
    ids, y = torch.randint(0, 10, (8, 3), generator=g), torch.randint(0, 3, (8,), generator=g)
    engine.backward(F.cross_entropy(model(ids), y, reduction="none"))
    engine.privatize()
    assert model[3].weight.grad is not None
