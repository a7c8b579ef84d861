"""What the integration tests compare against: the clipped per-example sum by autograd on
each example alone, the gradient a private step writes with its noise removed, and a
shipped example run as a script."""

from __future__ import annotations

import json
import re
import runpy
import sys
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import TensorDataset

REPO = Path(__file__).resolve().parents[2]


#: the small classification task of the make_private tests: N examples, FEATURES inputs, CLASSES labels
N, FEATURES, CLASSES = 60, 5, 3


def small_data(n: int = N) -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(n, FEATURES, generator=generator), torch.randint(0, CLASSES, (n,),
                                                                                        generator=generator))


def small_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(FEATURES, 8), nn.Tanh(), nn.Linear(8, CLASSES))


def clipped_per_example_sum(model: nn.Module, x: torch.Tensor, y: torch.Tensor, threshold: float) -> list:
    """Σ_i min(1, C/‖g_i‖)·g_i over the rows, g_i the cross-entropy gradient of row i alone
    (norms in float64)."""
    total = [torch.zeros_like(p) for p in model.parameters()]
    for i in range(len(x)):
        model.zero_grad()
        nn.functional.cross_entropy(model(x[i:i + 1]), y[i:i + 1]).backward()
        grads = [p.grad.detach().clone() for p in model.parameters()]
        factor = min(1.0, threshold / float(torch.sqrt(sum((g.double() ** 2).sum() for g in grads))))
        for acc, grad in zip(total, grads):
            acc += factor * grad
    return total


def noiseless_step_gradient(private, x: torch.Tensor, y: torch.Tensor, monkeypatch) -> list:
    """The p.grad one private step of ``make_private``'s objects writes on (x, y), with the noise
    removed and the wrapped optimizer's own step left out."""
    model, optimizer, criterion, _ = private
    monkeypatch.setattr(private.engine.noise, "add_gaussians", lambda grads, stds: None)
    captured = {}
    monkeypatch.setattr(private.optimizer.original, "step",
                        lambda: captured.update(grads=[p.grad.clone() for p in model.parameters()]))
    optimizer.zero_grad()
    criterion(model(x), y).backward()
    optimizer.step()
    return captured["grads"]


def run_example(name: str, out: Path, monkeypatch, capsys) -> tuple[float, dict]:
    """examples/NAME run as ``python examples/NAME OUT``: (its printed held-out accuracy, its
    privacy.json)."""
    monkeypatch.setattr(sys, "argv", [name, str(out)])
    runpy.run_path(str(REPO / "examples" / name), run_name="__main__")
    accuracy = float(re.search(r"held-out accuracy ([0-9.]+)", capsys.readouterr().out).group(1))
    return accuracy, json.loads((out / "privacy.json").read_text())
