"""One batch through DPEngine at noise 0, whole or split over ranks (tests/distributed)."""

from __future__ import annotations

import torch
from torch import nn

from dpclip.engine import DPEngine

CLIPPING = {
    "all-layer": {"grouping": "all-layer", "threshold": {"kind": "fixed", "value": 0.5}},
    "layer": {"grouping": "layer", "threshold": {"kind": "fixed", "value": 0.5}},
    "quantile": {"grouping": "layer", "threshold": {"kind": "quantile", "initial": 0.5, "sigma": 1e-9}},
    # the histogram's noise is drawn by rank 0 from the one-process stream (seed 0): the same values
    "dcsgd-p": {"grouping": "layer", "threshold": {"kind": "dcsgd-p", "sigma_hist": 1.0, "bins": 8, "range": 4.0}},
}


def grads_for(name: str, rank: int = 0, size: int = 1, reducer=None, steps: int = 2) -> dict:
    """p.grad after ``steps`` privatize calls on a fixed batch of 24, of which this rank holds
    rows rank, rank + size, ...; with the quantile and dcsgd-p policies, the thresholds of the
    second step depend on the first step's statistic (summed over ranks, noised once)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    x = torch.randn(24, 6, dtype=torch.float64)
    y = torch.randint(0, 3, (24,))
    engine = DPEngine(model, CLIPPING[name], noise_multiplier=0.0, expected_batch_size=24, seed=0,
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
