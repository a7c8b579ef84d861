"""A model the engine cannot vouch for: `dpclip train` says so before any noise or ε.

The model reads a learned [1, R, d] query through a Linear and indexes `[0]`: the result is
shared by every sample, so no per-sample gradient of that Linear can be told apart (the
whole batch's would land on one sample). The engine must refuse it as a user sees it: an
`error:` line naming the module's class and path, a `hint:` line, exit code 2, no
traceback, and no step in the ledger (nothing released, nothing charged).
"""

from __future__ import annotations

import json
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
QUICKSTART = REPO / "recipes" / "quickstart.yaml"

MODEL = '''
import torch
from torch import nn


class QueryPick(nn.Module):
    def __init__(self, num_classes):
        super().__init__()
        self.query = nn.Parameter(torch.randn(1, 4, 64) * 0.1)
        self.lin = nn.Linear(64, 64)
        self.head = nn.Linear(64, num_classes)

    def forward(self, x):
        key = self.lin(self.query)[0]          # [4, 64]: shared by all samples
        return self.head(x.flatten(1) * key.mean(0))


def make(num_classes):
    return QueryPick(num_classes)
'''


def _refused_custom_model(cli, tmp_path, monkeypatch, module: str, source: str,
                          kwargs: str = "{}") -> tuple[list[str], str]:
    """Train the quickstart with the custom model ``module:make(**kwargs)`` written from ``source``:
    exit 2; (stderr's lines, the error line)."""
    (tmp_path / f"{module}.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    result = cli("train", QUICKSTART, f"output_dir={tmp_path / 'runs'}", "training.epochs=null",
                 "training.steps=2", f"model={{kind: custom, target: '{module}:make', kwargs: {kwargs}}}")
    assert result.code == 2, (result.out, result.err)
    assert "Traceback" not in result.err
    lines = [line for line in result.err.splitlines() if line.strip()]
    return lines, next(line for line in lines if line.startswith("error:"))


def test_train_refuses_a_shared_learned_query_before_any_noise(cli, tmp_path, monkeypatch):
    lines, error = _refused_custom_model(cli, tmp_path, monkeypatch, "querypick", MODEL)
    assert "lin" in error and "Linear" in error, error
    assert any(line.startswith("hint:") for line in lines), lines
    for ledger in (tmp_path / "runs").rglob("ledger.json"):
        assert json.loads(ledger.read_text())["steps"] == 0


MIXING = '''
import torch
import torch.nn.functional as F
from torch import nn


class Center(nn.Module):
    def forward(self, x):
        return x - x.mean(0)


class FunctionalBatchNorm(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.register_buffer("running_mean", torch.zeros(width))
        self.register_buffer("running_var", torch.ones(width))

    def forward(self, x):
        return F.batch_norm(x, self.running_mean, self.running_var, training=True)


class CopyRow(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.register_buffer("row", torch.zeros(width))

    def forward(self, x):
        self.row.copy_(x[0].detach())
        return x


def make(num_classes, kind):
    mixer = {"center": Center(), "batchnorm": FunctionalBatchNorm(32), "buffer": CopyRow(32)}[kind]
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 32), mixer, nn.ReLU(), nn.Linear(32, num_classes))
'''


import pytest  # noqa: E402


@pytest.mark.parametrize("kind, named", [("center", "2 (Center)"), ("batchnorm", "2 (FunctionalBatchNorm)"),
                                         ("buffer", "buffer 2.row")])
def test_train_refuses_a_model_that_mixes_samples_naming_the_module(cli, tmp_path, monkeypatch, kind, named):
    lines, error = _refused_custom_model(cli, tmp_path, monkeypatch, "mixing", MIXING, f"{{kind: {kind}}}")
    assert named in error, error
    assert any(line.startswith("hint:") for line in lines), lines
    for ledger in (tmp_path / "runs").rglob("ledger.json"):
        assert json.loads(ledger.read_text())["steps"] == 0


ENERGY = '''
import torch
from torch import nn


class EnergyForce(nn.Module):
    def __init__(self, num_classes):
        super().__init__()
        self.energy = nn.Sequential(nn.Flatten(), nn.Linear(64, 16), nn.Tanh(), nn.Linear(16, 1))
        self.head = nn.Linear(64, num_classes)

    def forward(self, x):
        x = x.detach().requires_grad_()
        (force,) = torch.autograd.grad(-self.energy(x).sum(), x, create_graph=True)
        return self.head(force.flatten(1))


def make(num_classes):
    return EnergyForce(num_classes)
'''


def test_train_refuses_a_gradient_taken_inside_the_forward_saying_so(cli, tmp_path, monkeypatch):
    """-dE/dx of a trained energy as the head's input: refused naming the gradient inside the
    forward (not the batch-axis probe), before any noise."""
    lines, error = _refused_custom_model(cli, tmp_path, monkeypatch, "energy", ENERGY)
    assert "a gradient was taken inside the model's forward" in error and "energy.3 (Linear)" in error, error
    hint = next(line for line in lines if line.startswith("hint:"))
    assert "requires_grad_(False)" in hint and "batch in dim 0" not in hint, hint
    for ledger in (tmp_path / "runs").rglob("ledger.json"):
        assert json.loads(ledger.read_text())["steps"] == 0
