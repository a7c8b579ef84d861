"""What each spawned rank runs in tests/distributed/test_noise_once.py (importable by name)."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from dpclip.engine import DPEngine

#: 200·100 + 100 coordinates; the noise multiplier, the clip bound and the expected batch size
IN, OUT, SIGMA, C, B = 200, 100, 1.5, 0.8, 16


def pure_noise(world, out: str) -> None:
    """Two steps of DPEngine with the world's reducer, no seed (OS entropy), every rank's examples
    contributing exactly 0 (their losses times 0): ``B·p.grad`` is the released noise. Each rank
    saves its own."""
    torch.manual_seed(0)   # the model's weights only; the engine's generators are unseeded
    model = nn.Linear(IN, OUT).double()
    engine = DPEngine(model, {"grouping": "all-layer", "threshold": {"kind": "fixed", "value": C}},
                      gradient_noise_multiplier=SIGMA, expected_batch_size=B, reducer=world.reducer)
    released = []
    for _ in range(2):
        x = torch.randn(4, IN, dtype=torch.float64)
        engine.backward(0.0 * model(x).sum(1))
        engine.privatize()
        released.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]) * B)
    engine.detach()
    torch.save(released, Path(out) / f"rank{world.rank}.pt")
