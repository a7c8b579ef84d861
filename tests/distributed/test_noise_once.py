"""Data-parallel ranks add the gradient noise once (docs/distributed.md, "The noise is drawn
once, by rank 0"): with OS entropy on both ranks, the released sum holds N(0, σ²C²) per
coordinate, not 2σ²C² (each rank adding its own) nor 0 (none, or two draws that cancel), and
every rank holds the same released gradient."""

from __future__ import annotations

import math

import pytest
import torch

from tests.distributed.noise_case import C, IN, OUT, SIGMA, pure_noise
from tests.distributed.ranks import run_ranks


@pytest.mark.slow   # two spawned ranks
def test_two_unseeded_ranks_release_the_noise_once_with_variance_sigma_squared_c_squared(tmp_path):
    assert run_ranks(pure_noise, str(tmp_path)) == []
    zero, one = (torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1))
    n = IN * OUT + OUT
    for step in range(2):
        assert torch.equal(zero[step], one[step])   # one release, the same on every rank
        variance = zero[step].var().item()
        # the sample variance of n normal draws has relative std sqrt(2/(n-1)) (0.0099 here): 5 of them
        assert abs(variance / (SIGMA * C) ** 2 - 1) < 5 * math.sqrt(2 / (n - 1)), (step, variance)
        assert abs(zero[step].mean().item()) < 5 * SIGMA * C / math.sqrt(n)
    assert not torch.equal(zero[0], zero[1])   # a fresh draw each step
