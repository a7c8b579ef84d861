"""What each spawned rank runs in tests/distributed/test_refusal_ranks.py (importable by name)."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn


class MixesOnThisRank(nn.Module):
    """A ReLU that adds the batch's mean to every row: it mixes samples (rank 1's model only)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x + x.mean(0, keepdim=True))


def mixing_on_rank_one(world, out: str) -> None:
    """Data-parallel training whose model, on rank 1 only, mixes the samples of its part of the
    batch: the certificate refuses rank 1's first private batch, and rank 0 must stop too."""
    import dpclip.train.parts as parts
    from dpclip.train.workflow import train
    from tests.distributed.workers import small_recipe

    if world.rank == 1:
        real = parts.build_model

        def mixing(*args, **kwargs):
            model, loss_fn = real(*args, **kwargs)
            model[2] = MixesOnThisRank()
            return model, loss_fn

        parts.build_model = mixing
    train(small_recipe(Path(out) / "runs", "layer"), world=world, run_dir=Path(out) / "run")
