"""The sharded samplers: Poisson shards whose union is a Poisson sample at rate q, and
shuffled batches split over ranks whose union is the one-process batch."""

from __future__ import annotations

import math

import torch

from dpclip.data import PoissonSampler, ShuffleSampler
from dpclip.distributed import ShardedPoissonSampler, ShardedShuffleSampler


def _ranks(n, q, steps, world, seed=None):
    return [ShardedPoissonSampler(n, q, steps, rank=r, world_size=world, seed=seed) for r in range(world)]


def test_each_rank_draws_only_the_examples_it_owns():
    for rank, sampler in enumerate(_ranks(101, 0.3, 20, 3)):
        for batch in sampler:
            assert torch.all(batch % 3 == rank)


def test_seeded_ranks_union_to_the_one_process_batch():
    one = list(PoissonSampler(257, 0.1, 15, seed=4))
    ranks = [list(s) for s in _ranks(257, 0.1, 15, 2, seed=4)]
    for step, batch in enumerate(one):
        union = torch.sort(torch.cat([ranks[0][step], ranks[1][step]])).values
        assert torch.equal(union, batch)
        assert set(ranks[0][step].tolist()).isdisjoint(ranks[1][step].tolist())


def test_union_of_independent_ranks_is_poisson_at_rate_q():
    """Entropy mode: each rank its own stream (here fixed seeds, one per rank). Every example's
    inclusion frequency is q and the batch size is Binomial(N, q): mean N·q, variance N·q(1−q);
    tolerances are 5 standard deviations of each estimate."""
    n, q, steps, world = 60, 0.2, 4000, 2
    samplers = _ranks(n, q, steps, world)
    for rank, sampler in enumerate(samplers):
        sampler.generator.manual_seed(1234 + rank)
    counts = torch.zeros(n)
    sizes = []
    for batches in zip(*samplers):
        union = torch.cat(batches)
        assert len(union) == len(set(union.tolist()))  # no example twice
        counts[union] += 1
        sizes.append(len(union))
    per_example_sd = math.sqrt(q * (1 - q) / steps)
    assert torch.all((counts / steps - q).abs() < 5 * per_example_sd)
    sizes = torch.tensor(sizes, dtype=torch.float64)
    mean_sd = math.sqrt(n * q * (1 - q) / steps)
    assert abs(sizes.mean().item() - n * q) < 5 * mean_sd
    # the variance of a sample variance of a near-normal count: ≈ 2σ⁴/(steps − 1)
    var = n * q * (1 - q)
    assert abs(sizes.var().item() - var) < 5 * var * math.sqrt(2 / (steps - 1))


def test_a_resumed_rank_draws_what_it_would_have_drawn():
    first = ShardedPoissonSampler(50, 0.3, 10, rank=1, world_size=2)
    it = iter(first)
    [next(it) for _ in range(4)]
    saved = first.state_dict()
    rest = list(it)
    again = ShardedPoissonSampler(50, 0.3, 10, rank=1, world_size=2)
    again.load_state_dict(saved)
    assert all(torch.equal(a, b) for a, b in zip(rest, list(again)))
    assert saved["rank"] == 1 and saved["world_size"] == 2


class _Broadcast:
    """Rank 0's permutations, handed to the other ranks in order (a broadcast, one process)."""

    def __init__(self):
        self.sent: list[torch.Tensor] = []
        self.received = 0

    def rank0(self, tensors):
        self.sent.append(tensors[0].clone())

    def other(self, tensors):
        tensors[0].copy_(self.sent[self.received])
        self.received += 1


def _shuffled(n, batch, steps, seed=None):
    link = _Broadcast()
    ranks = [ShardedShuffleSampler(n, batch, steps, rank=r, world_size=2, seed=seed,
                                   broadcast_=link.rank0 if r == 0 else link.other) for r in range(2)]
    return ranks, link


def test_shuffled_parts_union_to_the_one_process_batch_across_epochs():
    """Seeded: rank 0 draws the one-process sampler's permutations (4 epochs in 10 steps of 13
    from 37 examples); the ranks take alternate entries of each batch."""
    one = list(ShuffleSampler(37, 13, 10, seed=5))
    ranks, link = _shuffled(37, 13, 10, seed=5)
    first = list(ranks[0])
    second = list(ranks[1])  # after rank 0: its permutations are then all sent
    assert len(link.sent) == 4 and link.received == 4
    for step, batch in enumerate(one):
        assert torch.equal(first[step], batch[0::2]) and torch.equal(second[step], batch[1::2])


def test_only_rank_0_draws_the_permutation():
    ranks, link = _shuffled(20, 5, 8)
    before = ranks[1].generator.get_state()
    list(ranks[0])
    list(ranks[1])
    assert torch.equal(ranks[1].generator.get_state(), before)  # rank 1's generator never drew
    assert len(link.sent) == 2  # 40 draws of 20 examples: two epochs, both rank 0's
    assert torch.equal(ranks[1].permutation, ranks[0].permutation)


def test_a_resumed_shuffled_rank_draws_what_it_would_have_drawn():
    ranks, link = _shuffled(30, 7, 12)
    it = iter(ranks[0])
    [next(it) for _ in range(5)]
    saved = ranks[0].state_dict()
    rest = list(it)
    again = ShardedShuffleSampler(30, 7, 12, rank=0, world_size=2, broadcast_=lambda tensors: None)
    again.load_state_dict(saved)
    assert all(torch.equal(a, b) for a, b in zip(rest, list(again)))
    assert saved["rank"] == 0 and saved["world_size"] == 2
