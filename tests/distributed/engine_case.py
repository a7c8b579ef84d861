"""One batch through DPEngine at noise 0, whole or split over ranks (tests/distributed)."""

from __future__ import annotations

import torch
from torch import nn

from dpclip.engine import DPEngine
from dpclip.train.step import PrivateStep

CLIPPING = {
    "all-layer": {"grouping": "all-layer", "threshold": {"kind": "fixed", "value": 0.5}},
    "layer": {"grouping": "layer", "threshold": {"kind": "fixed", "value": 0.5}},
    "quantile": {"grouping": "layer", "threshold": {"kind": "quantile", "initial": 0.5, "sigma": 1e-9}},
    # the histogram's noise is drawn by rank 0 from the one-process stream (seed 0): the same values
    "dcsgd-p": {"grouping": "layer", "threshold": {"kind": "dcsgd-p", "sigma_hist": 1.0, "bins": 8, "range": 4.0}},
    # ranks the whole batch's norms (gathered over ranks); the cut falls inside the batch
    "top-fraction": {"grouping": "layer", "threshold": {"kind": "discriminative", "small": 0.05, "large": 0.5,
                                                        "tail_rule": "top_fraction", "top_fraction": 0.25}},
}


def grads_for(name: str, rank: int = 0, size: int = 1, reducer=None, steps: int = 2) -> dict:
    """p.grad after ``steps`` privatize calls on a fixed batch of 24, of which this rank holds
    rows rank, rank + size, ...; with the quantile and dcsgd-p policies, the thresholds of the
    second step depend on the first step's statistic (summed over ranks, noised once)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    x = torch.randn(24, 6, dtype=torch.float64)
    y = torch.randint(0, 3, (24,))
    engine = DPEngine(model, CLIPPING[name], gradient_noise_multiplier=0.0, expected_batch_size=24, seed=0,
                      reducer=reducer)
    out = {}
    for step in range(steps):
        rows = torch.arange(rank, 24, size)
        losses = nn.functional.cross_entropy(model(x[rows]), y[rows], reduction="none")
        engine.backward(losses)
        report = engine.privatize()
        out[step] = {"grads": [p.grad.clone() for p in model.parameters()], "thresholds": report.thresholds.clone(),
                     "clip_fraction": report.clip_fraction.clone(), "samples": report.samples_seen}
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.5 * p.grad
    engine.detach()
    return out


def step_grads(rank: int = 0, size: int = 1, reducer=None) -> list[torch.Tensor]:
    """p.grad after one PrivateStep under the top-fraction rule, with the whole batch of 24 on
    rank 0 and NONE on the other ranks (an empty Poisson part still joins the norm exchange)."""
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    train = {"x": torch.randn(24, 6, dtype=torch.float64), "y": torch.randint(0, 3, (24,))}
    engine = DPEngine(model, CLIPPING["top-fraction"], gradient_noise_multiplier=0.0, expected_batch_size=24, seed=0,
                      reducer=reducer)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)

    def loss_fn(m, rows):
        return nn.functional.cross_entropy(m(rows["x"]), rows["y"], reduction="none")

    step = PrivateStep(model, loss_fn, engine, optimizer, train, micro_batch_size=None)
    grads = []
    step(torch.arange(24) if rank == 0 else torch.zeros(0, dtype=torch.long),
         before_update=lambda report: grads.extend(p.grad.clone() for p in model.parameters()))
    engine.detach()
    return grads
