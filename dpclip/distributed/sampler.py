"""Poisson sampling split over ranks (docs/distributed.md, "Why the sharded sampler is Poisson").

Every example i has one owning rank, i mod W. At every step, each rank includes each of
ITS examples independently with probability q. Inclusions of different examples are then
independent Bernoulli(q) draws whoever makes them, so the union over ranks is exactly a
Poisson sample of all N examples at rate q: the accountant's q = B/N and its
amplification by subsampling are unchanged, and every example is in at most one rank's
part of a batch (the shards are disjoint).

Randomness, as for :class:`dpclip.data.PoissonSampler` (:mod:`dpclip.rng`):

- default (OS entropy): each rank's generator state comes from its own ``os.urandom``:
  the ranks' draws are independent and nobody can regenerate them; each rank draws only
  for its own examples;
- ``privacy.unsafe_seeded_randomness``: every rank uses the one-process sampler's seeded
  stream, draws the whole vector of N uniforms and keeps its own examples, so the union
  is EXACTLY the batch a one-process run draws (what the equivalence tests rely on).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from dpclip.data import PoissonSampler


class ShardedPoissonSampler(PoissonSampler):
    """Rank ``rank`` of ``world_size``'s part of each logical batch (global indices, sorted)."""

    def __init__(self, num_examples: int, sample_rate: float, steps: int, *, rank: int, world_size: int,
                 seed: int | None = None):
        super().__init__(num_examples, sample_rate, steps, seed=seed)
        self.rank, self.world_size, self.seeded = rank, world_size, seed is not None
        self.owned = torch.arange(rank, num_examples, world_size)

    def __iter__(self) -> Iterator[torch.Tensor]:
        while self.step < self.steps:
            # float64 uniforms, as the one-process sampler (its comment explains why).
            if self.seeded:
                included = self.owned[torch.rand(self.num_examples, generator=self.generator,
                                                 dtype=torch.float64)[self.owned] < self.sample_rate]
            else:
                included = self.owned[torch.rand(len(self.owned), generator=self.generator,
                                                 dtype=torch.float64) < self.sample_rate]
            self.step += 1
            yield included

    def state_dict(self) -> dict:
        return {**super().state_dict(), "rank": self.rank, "world_size": self.world_size}
