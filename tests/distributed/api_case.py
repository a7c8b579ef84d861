"""make_private in a torchrun-style loop, run as one rank of a data-parallel world
(tests/distributed/test_python_api.py spawns the ranks)."""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import dpclip

N, FEATURES, CLASSES, STEPS = 48, 5, 3, 4


def data() -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(N, FEATURES, generator=generator),
                         torch.randint(0, CLASSES, (N,), generator=generator))


def train(out: Path, per_rank_batch: int, seed_model: int, compile: bool = False) -> None:
    """Seeded make_private (the ranks' draws then union to the one-process batch), STEPS steps;
    the weights and the ledger go to ``out`` (rank 0 writes). ``compile``: through
    ``private.train_step`` with make_private(compile=True) (traced with aot_eager)."""
    torch.manual_seed(seed_model)   # ranks start from different weights: make_private broadcasts rank 0's
    model = nn.Sequential(nn.Linear(FEATURES, 8), nn.Tanh(), nn.Linear(8, CLASSES))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # the unsafe_seed warning: seeded on purpose, to compare
        private = dpclip.make_private(model, torch.optim.SGD(model.parameters(), lr=0.5),
                                      DataLoader(data(), batch_size=per_rank_batch), criterion=nn.CrossEntropyLoss(),
                                      delta=1e-5, noise_multiplier=1.0, steps=STEPS, max_grad_norm=0.5,
                                      clipping={"grouping": "layer"}, unsafe_seed=5,
                                      compile=compile, compile_backend="aot_eager")
    model, optimizer, criterion, loader = private
    for x, y in loader:
        if compile:
            private.train_step(x, y)
            continue
        optimizer.zero_grad()
        criterion(model(x), y).backward()
        optimizer.step()
    private.save(out)
    if private.account.writes:
        save_file({name: p.detach().contiguous() for name, p in model.named_parameters()}, str(out / "weights.st"))


def rank_main(world, out: str, compile: bool = False) -> None:
    train(Path(out), per_rank_batch=6, seed_model=world.rank + 100, compile=compile)
