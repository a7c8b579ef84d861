import io
import math

import pytest
import torch

from dpclip.data import PoissonSampler, ShuffleSampler, micro_batches
from dpclip.distributed import ShardedPoissonSampler
from dpclip.errors import DpclipError


def test_poisson_batch_sizes_have_binomial_mean_and_variance():
    num_examples, rate, steps = 1000, 0.05, 2000
    sizes = torch.tensor([len(b) for b in PoissonSampler(num_examples, rate, steps, seed=0)], dtype=torch.float64)
    mean, variance = num_examples * rate, num_examples * rate * (1 - rate)
    # Tolerances: 5 standard errors of the sample mean and of the sample variance
    # (for a near-normal count, Var(s^2) ~ 2 sigma^4 / (n - 1)).
    assert abs(sizes.mean().item() - mean) < 5 * math.sqrt(variance / steps)
    assert abs(sizes.var().item() - variance) < 5 * variance * math.sqrt(2 / (steps - 1))


def test_poisson_includes_each_example_with_probability_q_independently_of_its_index():
    num_examples, rate, steps = 200, 0.1, 3000
    counts = torch.zeros(num_examples)
    for batch in PoissonSampler(num_examples, rate, steps, seed=1):
        counts[batch] += 1
    frequencies = counts / steps
    standard_error = math.sqrt(rate * (1 - rate) / steps)
    # Max over 200 examples: 5 standard errors leaves a ~1e-4 chance of a false alarm.
    assert (frequencies - rate).abs().max() < 5 * standard_error
    # No drift with the index (the first and second halves are sampled alike).
    first, second = frequencies[:100].mean(), frequencies[100:].mean()
    assert abs(first - second) < 5 * standard_error * math.sqrt(2 / 100)


def test_poisson_batches_are_sorted_unique_int64_indices_in_range():
    for batch in PoissonSampler(50, 0.3, 20, seed=2):
        assert batch.dtype == torch.int64 and batch.dim() == 1
        assert torch.equal(batch, torch.unique(batch)) and (batch >= 0).all() and (batch < 50).all()


def test_poisson_yields_empty_batches_as_steps_when_the_rate_is_tiny():
    sampler = PoissonSampler(10, 0.001, 50, seed=3)
    batches = list(sampler)
    assert len(batches) == len(sampler) == 50
    empty = [b for b in batches if len(b) == 0]
    assert len(empty) > 40  # P(empty) = 0.999^10 ~ 0.99 per step
    assert all(b.dtype == torch.int64 and b.shape == (0,) for b in empty)


def test_poisson_same_seed_same_batches_other_seed_other_batches():
    def draw(seed):
        return [b.tolist() for b in PoissonSampler(100, 0.2, 10, seed=seed)]

    assert draw(5) == draw(5) != draw(6)


def roundtrip(state):
    """Through torch.save / torch.load(weights_only=True), as a checkpoint would."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


@pytest.mark.parametrize("make", [lambda seed: PoissonSampler(100, 0.1, 12, seed),
                                  lambda seed: ShuffleSampler(10, 3, 12, seed)], ids=["poisson", "shuffle"])
def test_a_sampler_resumed_from_its_state_dict_draws_the_remaining_batches_exactly(make):
    uninterrupted = [b.tolist() for b in make(7)]
    interrupted = make(7)
    first_part = []
    for batch in interrupted:
        first_part.append(batch.tolist())
        if len(first_part) == 5:
            break
    state = roundtrip(interrupted.state_dict())
    resumed = make(99)  # a different seed: the state alone must decide the draws
    resumed.load_state_dict(state)
    remaining = [b.tolist() for b in resumed]
    assert first_part + remaining == uninterrupted
    assert len(remaining) == 7


def test_shuffle_sampler_gives_fixed_size_batches_that_cover_each_example_once_per_epoch():
    num_examples, batch_size, steps = 10, 3, 20
    batches = list(ShuffleSampler(num_examples, batch_size, steps, seed=0))
    assert all(len(b) == batch_size for b in batches)
    stream = torch.cat(batches)
    for epoch in range(len(stream) // num_examples):
        block = stream[epoch * num_examples:(epoch + 1) * num_examples]
        assert sorted(block.tolist()) == list(range(num_examples))
    epochs = [stream[i:i + num_examples].tolist() for i in (0, num_examples)]
    assert epochs[0] != epochs[1], "each epoch is reshuffled"


def test_samplers_refuse_impossible_settings():
    with pytest.raises(DpclipError):
        PoissonSampler(100, 0.0, 10, seed=0)
    with pytest.raises(DpclipError):
        PoissonSampler(100, 1.5, 10, seed=0)
    with pytest.raises(DpclipError):
        ShuffleSampler(5, 6, 10, seed=0)


def test_micro_batches_split_a_logical_batch_into_ordered_chunks_of_at_most_the_size():
    indices = torch.arange(10) * 3
    chunks = list(micro_batches(indices, 4))
    assert [len(c) for c in chunks] == [4, 4, 2]
    assert torch.equal(torch.cat(chunks), indices)
    assert [len(c) for c in micro_batches(indices, 64)] == [10]


def test_micro_batches_of_an_empty_logical_batch_are_none_at_all():
    assert list(micro_batches(torch.empty(0, dtype=torch.int64), 4)) == []


# ------------------------------------------------------------- cyclic Poisson (banded MF)

def test_one_group_draws_the_batches_of_plain_poisson_sampling():
    plain = [b.clone() for b in PoissonSampler(500, 0.05, 20, seed=4)]
    cyclic = [b.clone() for b in PoissonSampler(500, 0.05, 20, seed=4, groups=1)]
    assert all(torch.equal(a, b) for a, b in zip(plain, cyclic))


def test_cyclic_sampling_draws_each_step_from_its_group_alone_and_separates_participations():
    bands, n, steps, rate = 4, 400, 40, 0.3
    last_seen: dict[int, int] = {}
    counts = torch.zeros(n)
    sampler = PoissonSampler(n, rate, steps, seed=1, groups=bands)
    group_of = sampler.group_of.clone()
    for t, batch in enumerate(sampler):
        assert bool((group_of[batch] == t % bands).all())   # only the group whose turn it is
        for i in batch.tolist():
            assert t - last_seen.get(i, -bands) >= bands       # b-min-separation
            last_seen[i] = t
        counts[batch] += 1
    # Each example has steps/b = 10 turns, included with probability 0.3 in each: over all
    # 400 examples the count has mean 400·10·0.3 = 1200 and variance 400·10·0.3·0.7 = 840;
    # 5 standard deviations is about 145.
    assert abs(float(counts.sum()) - 1200) < 5 * math.sqrt(840)


def test_the_ranks_cyclic_parts_together_are_the_one_process_batch():
    one = [b.clone() for b in PoissonSampler(301, 0.2, 12, seed=7, groups=3)]
    ranks = [[b.clone() for b in ShardedPoissonSampler(301, 0.2, 12, rank=r, world_size=2, seed=7, groups=3)]
             for r in range(2)]
    for t in range(12):
        assert torch.equal(torch.sort(torch.cat([ranks[0][t], ranks[1][t]])).values, one[t])


def test_more_groups_than_examples_is_refused_with_a_hint():
    with pytest.raises(DpclipError, match="cannot be cut into 11 groups") as caught:
        PoissonSampler(10, 0.5, 5, groups=11)
    assert caught.value.hint


def test_cyclic_groups_are_drawn_privately_and_uniformly():
    """Each example's group is its own private draw (not i mod b): two unseeded samplers disagree,
    and over 16,000 examples each of 4 groups holds about a quarter (Binomial(16000, 1/4): std 55).
    Unseeded: 6 standard deviations fail with probability 8e-9 over the 4 groups (5 of them over
    4000 examples, a wider band, failed with probability 2.6e-6)."""
    a, b = PoissonSampler(16_000, 0.1, 8, groups=4), PoissonSampler(16_000, 0.1, 8, groups=4)
    assert not torch.equal(a.group_of, b.group_of)
    assert not torch.equal(a.group_of, torch.arange(16_000) % 4)
    sizes = torch.bincount(a.group_of, minlength=4)
    assert bool(((sizes - 4000).abs() < 6 * math.sqrt(16_000 * 0.25 * 0.75)).all()), sizes


def test_a_resumed_cyclic_sampler_keeps_its_groups_and_batches():
    whole = PoissonSampler(300, 0.2, 12, groups=3)
    first = PoissonSampler(300, 0.2, 12, groups=3)
    first.load_state_dict(whole.state_dict())
    expected = [b.clone() for b in whole]
    got = []
    for t, batch in enumerate(first):
        got.append(batch.clone())
        if t == 4:
            break
    resumed = PoissonSampler(300, 0.2, 12, groups=3)
    resumed.load_state_dict(first.state_dict())
    got += [b.clone() for b in resumed]
    assert torch.equal(resumed.group_of, whole.group_of)
    assert len(got) == len(expected) and all(torch.equal(x, y) for x, y in zip(got, expected))


def test_a_checkpoint_with_index_assigned_groups_is_refused_with_a_hint():
    sampler = PoissonSampler(50, 0.2, 10, groups=2)
    state = sampler.state_dict()
    del state["group_of"]
    with pytest.raises(DpclipError, match="group i mod b") as caught:
        PoissonSampler(50, 0.2, 10, groups=2).load_state_dict(state)
    assert "start the run again" in caught.value.hint
