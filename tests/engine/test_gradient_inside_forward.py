"""Forwards that differentiate or vmap inside themselves (docs/certificate.md, "What it refuses").

A gradient taken inside the forward through a trained module (``torch.autograd.grad(E, x,
create_graph=True)``: a force -dE/dx, an input-gradient feature) or a trained layer called
inside a torch.func transform (``torch.vmap(functional_call(layer, ...))`` over the batch,
``torch.func.grad`` of an energy) puts into each sample's gradient what the engine's per-sample
factors do not hold: refused naming what was seen, before any noise or charge. Such a gradient
through frozen modules only, or through none, is an ordinary forward: it trains, each clipped
gradient equal to the sample's own gradient clipped (a per-example loop), and one that mixes
samples through it is refused by the certificate.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import dpclip
from dpclip.errors import EngineError

C = 0.05


class TrainedEnergyForce(nn.Module):
    """The head reads the force -dE/dx of a trained energy (a physics-informed network)."""

    def __init__(self):
        super().__init__()
        self.energy = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 1))
        self.head = nn.Linear(5, 3)

    def forward(self, x):
        x = x.detach().requires_grad_()
        (force,) = torch.autograd.grad(-self.energy(x).sum(), x, create_graph=True)
        return self.head(force)


class VmappedLayer(nn.Module):
    """A trained layer called one sample at a time by torch.vmap over the batch."""

    def __init__(self):
        super().__init__()
        self.inner = nn.Linear(5, 6)
        self.head = nn.Linear(6, 3)

    def forward(self, x):
        params = dict(self.inner.named_parameters())
        h = torch.vmap(lambda row: torch.func.functional_call(self.inner, params, (row,)))(x)
        return self.head(torch.tanh(h))


class FuncGradForce(TrainedEnergyForce):
    """The force by torch.func.grad of a trained energy, vmapped over the batch."""

    def forward(self, x):
        params = dict(self.energy.named_parameters())
        force = torch.vmap(torch.func.grad(lambda row: torch.func.functional_call(self.energy, params, (row,)).sum()))(x)
        return self.head(-force)


class FrozenEnergyForce(nn.Module):
    """A trained encoder, the force of a frozen energy on its output, a trained head; ``mix``
    squares the batch's total energy, so that each force carries the batch's sum."""

    def __init__(self, mix: bool = False):
        super().__init__()
        self.pre = nn.Linear(5, 6)
        self.energy = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1)).requires_grad_(False)
        self.head = nn.Linear(6, 3)
        self.mix = mix

    def forward(self, x):
        h = self.pre(x)
        total = self.energy(h).sum()
        (force,) = torch.autograd.grad(total ** 2 if self.mix else total, h, create_graph=True)
        return self.head(torch.tanh(-force))


class ParameterFreeFuncGrad(nn.Module):
    """torch.func.grad of a fixed function, per sample (vmap) or, with ``mix``, over the batch."""

    def __init__(self, mix: bool = False):
        super().__init__()
        self.pre = nn.Linear(5, 6)
        self.head = nn.Linear(6, 3)
        self.mix = mix

    def forward(self, x):
        h = self.pre(x)
        if self.mix:
            return self.head(torch.func.grad(lambda z: z.sin().sum() ** 2)(h))
        return self.head(torch.vmap(torch.func.grad(lambda z: (z ** 3).sin().sum()))(h))


class StackedEnsemble(nn.Module):
    """An ensemble's stacked weights as this module's parameters, vmapped over the members."""

    def __init__(self, members: int = 4):
        super().__init__()
        self.w = nn.Parameter(torch.randn(members, 6, 5) * 0.3)
        self.b = nn.Parameter(torch.zeros(members, 6))
        self.head = nn.Linear(6, 3)

    def forward(self, x):
        h = torch.vmap(lambda w, b: F.linear(x, w, b))(self.w, self.b)
        return self.head(torch.tanh(h).mean(0))


def _private(model: nn.Module):
    data = TensorDataset(torch.randn(60, 5, generator=torch.Generator().manual_seed(0)),
                         torch.randint(0, 3, (60,), generator=torch.Generator().manual_seed(1)))
    trained = [p for p in model.parameters() if p.requires_grad]
    with pytest.warns(UserWarning, match="unsafe_seed"):
        return dpclip.make_private(model, torch.optim.SGD(trained, lr=0.1), DataLoader(data, batch_size=12),
                                   criterion=nn.CrossEntropyLoss(), delta=1e-5, noise_multiplier=1.0, steps=4,
                                   max_grad_norm=C, unsafe_seed=3)


def _clipped_sum_by_sample(model: nn.Module, x, y) -> list:
    """Σ_i min(1, C/‖g_i‖)·g_i, g_i by autograd on row i alone (norms in float64)."""
    trained = [p for p in model.parameters() if p.requires_grad]
    total = [torch.zeros_like(p) for p in trained]
    for i in range(len(x)):
        grads = torch.autograd.grad(F.cross_entropy(model(x[i:i + 1]), y[i:i + 1]), trained)
        norm = float(torch.sqrt(sum((g.double() ** 2).sum() for g in grads)))
        for acc, g in zip(total, grads):
            acc += min(1.0, C / norm) * g
    return total


@pytest.mark.parametrize("make, seen, named", [
    (TrainedEnergyForce, "a gradient was taken inside the model's forward", "energy.2 (Linear)"),
    (VmappedLayer, "is called inside torch.vmap", "inner (Linear)"),
    (FuncGradForce, "is called inside torch.func.grad", "energy.0 (Linear)")])
def test_a_trained_module_differentiated_or_vmapped_inside_the_forward_is_refused_saying_so(make, seen, named):
    torch.manual_seed(0)
    private = _private(make())
    model, optimizer, criterion, loader = private
    before = [p.detach().clone() for p in model.parameters()]
    x, y = next(iter(loader))
    with pytest.raises(EngineError) as err:
        optimizer.zero_grad()
        criterion(model(x), y).backward()
        optimizer.step()
    assert seen in err.value.message and named in err.value.message, err.value.message
    assert "batch in dim 0" not in err.value.hint and "requires_grad_(False)" in err.value.hint
    assert private.epsilon() == 0.0                                             # nothing charged
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))   # nothing released


@pytest.mark.parametrize("make", [FrozenEnergyForce, ParameterFreeFuncGrad, StackedEnsemble])
def test_a_gradient_inside_the_forward_through_no_trained_module_clips_each_sample_own_gradient(make, monkeypatch):
    torch.manual_seed(0)
    model = make()
    reference = make()
    reference.load_state_dict(model.state_dict())
    private = _private(model)
    model, optimizer, criterion, loader = private
    monkeypatch.setattr(private.engine.noise, "add_gaussians", lambda grads, stds: None)
    trained = [p for p in model.parameters() if p.requires_grad]
    captured = {}
    monkeypatch.setattr(private.optimizer.original, "step",
                        lambda: captured.update(grads=[p.grad.clone() for p in trained]))
    x, y = next(iter(loader))
    optimizer.zero_grad()
    criterion(model(x), y).backward()
    optimizer.step()
    for got, want in zip(captured["grads"], _clipped_sum_by_sample(reference, x, y)):
        torch.testing.assert_close(got, want / 12, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("make", [lambda: FrozenEnergyForce(mix=True), lambda: ParameterFreeFuncGrad(mix=True)])
def test_a_gradient_inside_the_forward_that_mixes_samples_is_refused_by_the_certificate(make):
    torch.manual_seed(0)
    private = _private(make())
    model, optimizer, criterion, loader = private
    x, y = next(iter(loader))
    with pytest.raises(EngineError) as err:
        optimizer.zero_grad()
        criterion(model(x), y).backward()
        optimizer.step()
    assert "other outputs alone than in its batch" in err.value.message, err.value.message
    assert private.epsilon() == 0.0
