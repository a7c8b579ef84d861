"""The attacker of a sharded run holds the recipe (its seed), the model (so every parameter's
shape and, with W, each rank's rows: ``shard_rows``) and the released gradient.

Each rank of a sharded run noises its own rows (docs/distributed.md, "Sharded training"). Were
the ranks' noise streams the same, rank 1's k-th draw would be rank 0's k-th draw: lining up
the two ranks' rows in the order they were drawn, their difference cancels the noise and
leaves the difference of the clipped sums. Each attack runs against the released gradient of
2 gloo ranks (it must fail) and against a leaky release built with one stream for both ranks
(it must work: the attack has the power to detect the leak).

The ranks run tests/distributed/fsdp_case.py's noise case: no rank holds an example, so the
release is the noise alone (std σC/B on every coordinate)."""

from __future__ import annotations

import math

import pytest
import torch

from dpclip.distributed.sharded import ShardReducer, shard_rows
from dpclip.distributed.world import World
from dpclip.engine.noise import NoiseSource
from tests.distributed import fsdp_case
from tests.distributed.fsdp_case import NOISE_B, NOISE_SIGMA, draw_order
from tests.distributed.ranks import run_ranks

SIZE = 2
STD = NOISE_SIGMA * 1.0 / NOISE_B       # global allocation, all-layer, C = 1
SEEDS = [None, 0]                       # OS entropy (the default), and the recipe's seed 0
Z = 5.0


@pytest.fixture(scope="module")
def released(tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp-noise")
    assert run_ranks(fsdp_case.noise_only, str(out), SEEDS, ["global"], size=SIZE) == []
    saved = torch.load(out / f"noise-{SIZE}.pt", weights_only=False)
    for key, found in saved.items():
        assert "error" not in found, f"{key}: {found['error']}"
    return {seed: saved[("global", seed)]["grads"] for seed in SEEDS}


def _leaky_release(shapes: dict[str, torch.Size], seed: int) -> dict[str, torch.Tensor]:
    """What the ranks would release if both drew from rank 0's stream: each rank's rows of each
    parameter, in parameter order, from one NoiseSource seeded alike."""
    whole = {name: torch.zeros(shape, dtype=torch.float64) for name, shape in shapes.items()}
    for rank in range(SIZE):
        source = NoiseSource(seed, ShardReducer(World(0, SIZE)).noise_stream)
        rows = []
        for g in whole.values():
            start, stop = shard_rows(g.shape[0] if g.dim() else 1, rank, SIZE)
            rows.append((g if g.dim() else g.reshape(1))[start:stop])
        source.add_gaussians([r for r in rows if r.numel()], [STD] * sum(1 for r in rows if r.numel()))
    return whole


def _cancels(grads: dict[str, torch.Tensor]) -> bool:
    """The difference attack: rank 1's draws minus rank 0's, lined up. With independent streams
    the difference of m pairs is N(0, 2s²) per pair, so its mean square over 2s² is 1 within
    5·sqrt(2/m) (the variance of a sample variance, tests/distributed/test_fsdp_engine.py);
    it cancels when it falls far below."""
    a, b = (draw_order(grads, rank, SIZE) for rank in range(SIZE))
    m = min(a.numel(), b.numel())
    ratio = float((b[:m] - a[:m]).pow(2).mean()) / (2 * STD ** 2)
    if abs(ratio - 1) <= Z * math.sqrt(2 / m):
        return False
    assert ratio < 1e-12, f"neither independent nor identical streams: mean square ratio {ratio}"
    return True


@pytest.mark.slow   # two sharded ranks (README: the slow tests)
@pytest.mark.parametrize("seed", SEEDS, ids=["entropy", "seeded"])
def test_rows_of_two_ranks_do_not_cancel(released, seed):
    assert not _cancels(released[seed])


@pytest.mark.slow   # the two sharded ranks of `released`
def test_the_difference_attack_detects_shared_streams(released):
    shapes = {name: g.shape for name, g in released[0].items()}
    assert _cancels(_leaky_release(shapes, seed=0))


def _regenerated(grads: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """The attacker's guess of the whole noise from the recipe's seed: each rank's stream
    (``rank-r-of-W``, as the ShardReducer names it) drawn over that rank's rows."""
    guess = {name: torch.zeros_like(g) for name, g in grads.items()}
    for rank in range(SIZE):
        source = NoiseSource(seed, ShardReducer(World(rank, SIZE)).noise_stream)
        rows = []
        for g in guess.values():
            start, stop = shard_rows(g.shape[0] if g.dim() else 1, rank, SIZE)
            rows.append((g if g.dim() else g.reshape(1))[start:stop])
        rows = [r for r in rows if r.numel()]
        source.add_gaussians(rows, [STD] * len(rows))
    return guess


@pytest.mark.slow   # the two sharded ranks of `released`
def test_the_seed_regenerates_the_noise_only_of_a_seeded_run(released):
    """The documented price of privacy.unsafe_seeded_randomness, per rank: from the seed the
    attacker regenerates every rank's noise exactly, and a default run's noise not at all
    (its residual is the difference of two independent noises, N(0, 2s²) per coordinate:
    its mean square over 2s² is 1 within 5·sqrt(2/n))."""
    seeded = released[0]
    guess = _regenerated(seeded, 0)
    for name in seeded:
        torch.testing.assert_close(seeded[name], guess[name], rtol=0, atol=1e-12)
    default = released[None]
    n = sum(g.numel() for g in default.values())
    mean_square = sum(float((default[k] - guess[k]).pow(2).sum()) for k in default) / n
    assert abs(mean_square / (2 * STD ** 2) - 1) <= Z * math.sqrt(2 / n)


def test_each_rank_has_its_own_seeded_stream():
    """Without spawning: the ShardReducers of ranks 0 and 1 name different streams, and the same
    seed draws differently in them."""
    streams = [ShardReducer(World(rank, SIZE)).noise_stream for rank in range(SIZE)]
    assert streams[0] != streams[1]
    draws = []
    for stream in streams:
        x = torch.zeros(1000, dtype=torch.float64)
        NoiseSource(0, stream).add_gaussians([x], [1.0])
        draws.append(x)
    assert abs(float(torch.corrcoef(torch.stack(draws))[0, 1])) <= Z / math.sqrt(1000)
