"""Batches split over ranks: sharded Poisson sampling, and shuffled batches (docs/distributed.md).

**Poisson** (:class:`ShardedPoissonSampler`, "The privacy argument" in the docs).

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

**Shuffled** (:class:`ShardedShuffleSampler`): the batches of the one-process
:class:`~dpclip.data.ShuffleSampler`, each split over the ranks. Rank 0 draws every epoch's
permutation from its private generator and broadcasts it; every rank walks the same
permutation and keeps every W-th entry of each batch (entries rank, rank + W, ...). The
logical batch, and so what is released and how it is accounted (as Poisson, with the
statement's caveat that shuffled batches are not covered by that analysis), is the one
process's. Every rank knows the whole permutation, unlike Poisson sharding where a rank
knows only its own examples' draws: the ranks are trusted as the operator is.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from dpclip.data import PoissonSampler, ShuffleSampler


class ShardedPoissonSampler(PoissonSampler):
    """Rank ``rank`` of ``world_size``'s part of each logical batch (global indices, sorted)."""

    def __init__(self, num_examples: int, sample_rate: float, steps: int, *, rank: int, world_size: int,
                 seed: int | None = None, groups: int = 1):
        super().__init__(num_examples, sample_rate, steps, seed=seed, groups=groups)
        self.rank, self.world_size, self.seeded = rank, world_size, seed is not None
        self.owned = torch.arange(rank, num_examples, world_size)

    def __iter__(self) -> Iterator[torch.Tensor]:
        while self.step < self.steps:
            # float64 uniforms, as the one-process sampler (its comment explains why).
            if self.seeded:
                drawn = torch.rand(self.num_examples, generator=self.generator, dtype=torch.float64)[self.owned]
            else:
                drawn = torch.rand(len(self.owned), generator=self.generator, dtype=torch.float64)
            included = self.owned[(drawn < self.sample_rate) & self.in_turn(self.owned)]
            self.step += 1
            yield included

    def state_dict(self) -> dict:
        return {**super().state_dict(), "rank": self.rank, "world_size": self.world_size}


class ShardedShuffleSampler(ShuffleSampler):
    """Rank ``rank`` of ``world_size``'s part of each shuffled batch (module doc).

    ``broadcast_(tensors)`` overwrites each tensor with rank 0's (``World.broadcast_``); it is
    called on every rank at the same steps (construction and each new epoch)."""

    def __init__(self, num_examples: int, batch_size: int, steps: int, *, rank: int, world_size: int,
                 broadcast_: Callable[[list[torch.Tensor]], None], seed: int | None = None):
        self.rank, self.world_size, self.broadcast_ = rank, world_size, broadcast_
        super().__init__(num_examples, batch_size, steps, seed=seed)

    def _draw_permutation(self) -> torch.Tensor:
        # Only rank 0's generator draws: one permutation, as in one process.
        order = super()._draw_permutation() if self.rank == 0 else torch.empty(self.num_examples, dtype=torch.long)
        self.broadcast_([order])
        return order

    def __iter__(self) -> Iterator[torch.Tensor]:
        for batch in super().__iter__():
            yield batch[self.rank::self.world_size]

    def state_dict(self) -> dict:
        return {**super().state_dict(), "rank": self.rank, "world_size": self.world_size}
