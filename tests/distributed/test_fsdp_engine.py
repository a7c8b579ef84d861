"""DPEngine on a model sharded with FSDP2 over gloo ranks gives what one process gives
(docs/distributed.md, "Sharded training"; the ranks run tests/distributed/fsdp_case.py).

Each rank holds 1/W of every parameter; a block's whole weights are gathered for its forward
and backward, so each example's norms are complete on the rank that holds it, and the clipped
sums are reduce-scattered to the ranks' rows. With noise off, the whole gradient
(``p.grad.full_tensor()``) must be the one-process clipped sum, for GPT-2 (tied
embedding/head), Llama and BERT and every grouping, with uneven splits, a rank without
examples (it still runs a padded backward: every sharded backward is a collective) and a
step of two micro-batches; the adaptive thresholds must adapt as in one process; and with
noise on and no examples, ``p.grad`` is pure noise of std σ·C/B per coordinate, drawn once
per coordinate, independently on each rank's rows.

One spawn per world size runs every case (process start-up is the cost): 2 ranks in the
default run (about 20 to 40 s on 2 cores), 4 ranks under ``slow`` (about 40 s).
"""

from __future__ import annotations

import math
import os
from contextlib import contextmanager

import pytest
import torch

from dpclip.distributed.world import TIMEOUT_ENV, World
from dpclip.engine import build_groups, trainable_params
from dpclip.errors import DpclipError
from tests.distributed import fsdp_case
from tests.distributed.fsdp_case import (GROUPINGS, MODELS, NOISE_B, NOISE_SIGMA, POLICIES, SPLITS, batch_size,
                                         draw_order, read_results)
from tests.distributed.ranks import run_ranks

NOISE_SEEDS = [0, 1]
# The bar; float64 sums over ranks differ from one process's by ~1e-16 (another order).
TOLERANCE = 1e-6


@contextmanager
def short_collective_timeout(seconds: int):
    """Ranks whose collectives stopped pairing up (one rank failed a case the others passed)
    wait this long, not the default 30 minutes, before they fail."""
    before = os.environ.get(TIMEOUT_ENV)
    os.environ[TIMEOUT_ENV] = str(seconds)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(TIMEOUT_ENV, None)
        else:
            os.environ[TIMEOUT_ENV] = before


def _spawn(tmp_path_factory, size: int):
    """Every case on ``size`` ranks. A rank that crashes (exits other than 0) fails
    test_no_rank_fails; each case's test still reads what the ranks wrote before."""
    out = tmp_path_factory.mktemp(f"fsdp{size}")
    with short_collective_timeout(120):
        try:
            errors = run_ranks(fsdp_case.all_cases, str(out), NOISE_SEEDS, size=size)
        except RuntimeError as exc:   # run_ranks: "rank r exited with c"
            errors = [("crash", str(exc))]
    return {"out": out, "size": size, "errors": errors}


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return _spawn(tmp_path_factory, 2)


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    return _spawn(tmp_path_factory, 4)


@pytest.fixture
def ranks(request):
    return request.getfixturevalue({2: "two_ranks", 4: "four_ranks"}[request.param])


def _sizes(*sizes):
    """The world sizes as parameters, all under ``slow``: each is one launch of that many
    processes (2 ranks about 15 s, 4 about a minute)."""
    return pytest.mark.parametrize("ranks", [pytest.param(s, marks=[pytest.mark.slow], id=f"{s}ranks")
                                             for s in sizes], indirect=True)


def _cases():
    return [f"{m}/{g}/{s}" for s in SPLITS[2] for m in MODELS for g in GROUPINGS]


def _found(ranks, name: str, key: str) -> list[dict]:
    per_rank = read_results(ranks["out"], f"{name}-{ranks['size']}", ranks["size"])
    for rank, found in enumerate(per_rank):
        assert key in found, f"rank {rank} never reached {key} (errors: {ranks['errors']})"
        assert "error" not in found[key], f"rank {rank}: {found[key]['error']}"
    return [found[key] for found in per_rank]


def _noise(ranks) -> dict:
    saved = torch.load(ranks["out"] / f"noise-{ranks['size']}.pt", weights_only=False)
    for key, found in saved.items():
        assert "error" not in found, f"{key}: {found['error']}"
    return saved


# ------------------------------------------------------------------ the clipped sum


@_sizes(2, 4)
def test_no_rank_fails(ranks):
    assert ranks["errors"] == []


@_sizes(2, 4)
@pytest.mark.parametrize("case", _cases())
def test_sharded_clipped_sum_is_the_one_process_sum(ranks, case):
    """Every model × grouping × split (case = model/grouping/split; the splits' names are
    those of 2 ranks, with 4 ranks' own cuts: fsdp_case.SPLITS)."""
    n = batch_size(ranks["size"])
    split = SPLITS[ranks["size"]][case.split("/")[2]]
    for found in _found(ranks, "equivalence", case):
        assert found["sharded"]                                   # every parameter was a shard
        assert found["diff"] <= TOLERANCE, found
        assert found["scale"] > 100 * TOLERANCE                   # the sum is not ~0 either way
        assert found["samples"] == n                              # the counts summed over ranks
        assert found["backwards"] == max(len(counts) for counts in split)
        # the same examples clipped, and some of them but not all (the thresholds are medians)
        assert found["clip_fraction"] == found["ref_clip_fraction"]
        assert any(0 < f < 1 for f in found["clip_fraction"])


def test_the_comparison_detects_a_missing_rank():
    """The test can fail: without the last rank's example (the uneven 2-rank split), the sum
    moves far beyond the tolerance."""
    make, loss_fn, make_batch = MODELS["gpt2"]
    batch = make_batch(5)
    clipping = {"grouping": "layer",
                "threshold": {"kind": "fixed", "value": fsdp_case.median_thresholds(make, loss_fn, batch, "layer")}}
    (whole, _), = fsdp_case.one_process(make, loss_fn, batch, clipping, 5)
    (missing, _), = fsdp_case.one_process(make, loss_fn, fsdp_case.take(batch, range(4)), clipping, 5)
    assert fsdp_case.max_diff(whole, missing) > 1000 * TOLERANCE


# ------------------------------------------------------------------ adaptive thresholds


@_sizes(2, 4)
@pytest.mark.parametrize("policy", list(POLICIES))
def test_adaptive_thresholds_adapt_sharded_as_in_one_process(ranks, policy):
    """Two steps (SGD between), seed 0 on both sides: the second step's thresholds come from
    the first step's statistic, summed over the ranks (noise near zero: fsdp_case.POLICIES)."""
    for found in _found(ranks, "policies", policy):
        steps = found["steps"]
        assert len(steps) == 2
        for step in steps:
            torch.testing.assert_close(torch.tensor(step["thresholds"]), torch.tensor(step["ref_thresholds"]),
                                       rtol=TOLERANCE, atol=TOLERANCE)
            assert step["diff"] <= TOLERANCE
        assert steps[1]["thresholds"] != steps[0]["thresholds"]   # they did adapt


# ------------------------------------------------------------------ the noise
#
# For n independent N(0, s²) coordinates, v = Σx²/n is unbiased for s² and, as E[x⁴] = 3s⁴,
# Var(v) = (3s⁴ - s⁴)/n = 2s⁴/n: v/s² - 1 has standard deviation sqrt(2/n). The mean
# m = Σx/n has standard deviation s/sqrt(n). The bounds are 5 of these standard deviations
# (a false failure has probability below 1e-6 per check; the seeds are fixed anyway). With
# n = 104,320 coordinates, v/s² is within 0.022 of 1: a coordinate noised by two ranks
# (v/s² = 2 where it happens), a rank's rows left without noise, or a std off by the √W of
# a wrong division all fall far outside.

Z = 5.0


def _check_std(x: torch.Tensor, std: float | torch.Tensor) -> None:
    z = (x / std).reshape(-1)
    n = z.numel()
    assert abs(float(z.mean())) <= Z / math.sqrt(n)
    assert abs(float(z.pow(2).mean()) - 1) <= Z * math.sqrt(2 / n)


@_sizes(2, 4)
@pytest.mark.parametrize("seed", NOISE_SEEDS)
def test_noise_of_a_step_without_examples_has_std_sigma_C_over_B(ranks, seed):
    """All-layer grouping, global allocation, C = 1: every coordinate gets N(0, (σC/B)²)."""
    found = _noise(ranks)[("global", seed)]
    assert found["samples"] == 0
    flat = torch.cat([g.reshape(-1) for g in found["grads"].values()])
    assert flat.numel() > 100_000
    _check_std(flat, NOISE_SIGMA * 1.0 / NOISE_B)


@pytest.mark.slow
def test_different_seeds_draw_different_noise(two_ranks):
    noise = _noise(two_ranks)
    a, b = (torch.cat([g.reshape(-1) for g in noise[("global", s)]["grads"].values()]) for s in NOISE_SEEDS)
    assert not torch.equal(a, b)


def _layer_groups():
    model = fsdp_case.noise_model()
    groups = build_groups(model, "layer", trainable_params(model))
    names = [[groups.params[i].name for i in members] for members in groups.members]
    return names, [float(sum(groups.params[i].param.numel() for i in members)) for members in groups.members]


def _expected_stds(allocation: str, thresholds: list[float], sizes: list[float]) -> list[float]:
    """docs/engine.md's allocations, written out: group k gets σ·S·w_k/B with
    S = sqrt(Σ C_k²/w_k²); equal-budget w_k = C_k (S = sqrt(K)), weighted w_k = C_k/sqrt(d_k)
    (S = sqrt(Σ d_k))."""
    if allocation == "equal-budget":
        return [NOISE_SIGMA * math.sqrt(len(thresholds)) * c / NOISE_B for c in thresholds]
    total = sum(sizes)
    return [NOISE_SIGMA * math.sqrt(total) * c / math.sqrt(d) / NOISE_B for c, d in zip(thresholds, sizes)]


@_sizes(2, 4)
@pytest.mark.parametrize("allocation", ["equal-budget", "weighted"])
def test_noise_allocations_give_each_group_its_std(ranks, allocation):
    """Layer grouping with distinct thresholds: each group's coordinates have its own std
    (each group checked with its own sqrt(2/d_k), and all groups pooled, standardised)."""
    names, sizes = _layer_groups()
    thresholds = fsdp_case.layer_thresholds(len(names))
    stds = _expected_stds(allocation, thresholds, sizes)
    assert max(stds) / min(stds) > 1.5          # the groups' stds differ: a shared std would fail
    for seed in NOISE_SEEDS:
        found = _noise(ranks)[(allocation, seed)]
        grads = found["grads"]
        assert sorted(grads) == sorted(n for members in names for n in members)
        torch.testing.assert_close(found["noise_std_grad"], torch.tensor(stds, dtype=torch.float64))
        pooled = []
        for members, std in zip(names, stds):
            x = torch.cat([grads[n].reshape(-1) for n in members])
            _check_std(x, std)
            pooled.append(x / std)
        _check_std(torch.cat(pooled), 1.0)


@_sizes(2, 4)
def test_rows_of_different_ranks_carry_uncorrelated_noise(ranks):
    """Each rank draws its rows' noise from its own stream: two ranks' draws, lined up in the
    order they were drawn, are not copies. Under independence the sample correlation of m
    pairs has standard deviation about 1/sqrt(m); the bound is 5 of them (m ≈ 26,000 with 4
    ranks: |corr| ≤ 0.031). Identical streams would give corr = 1 on the common prefix."""
    size = ranks["size"]
    for seed in NOISE_SEEDS:
        grads = _noise(ranks)[("global", seed)]["grads"]
        rows = [draw_order(grads, r, size) for r in range(size)]
        assert sum(r.numel() for r in rows) == sum(g.numel() for g in grads.values())
        for a in range(size):
            for b in range(a + 1, size):
                m = min(rows[a].numel(), rows[b].numel())
                corr = torch.corrcoef(torch.stack([rows[a][:m], rows[b][:m]]))[0, 1]
                assert abs(float(corr)) <= Z / math.sqrt(m), (a, b, float(corr))


# ------------------------------------------------------------------ refusals


def test_sharding_refuses_one_process():
    make, _, _ = MODELS["gpt2"]
    with pytest.raises(DpclipError) as caught:
        fsdp_case.Shards(make(), World())
    assert "one process" in caught.value.message
    assert "--nproc" in caught.value.hint


@_sizes(2)
def test_a_probe_needed_after_sharding_is_refused(ranks):
    """GPT-2 probed with positions shared over the batch ([1, T]), then fed one row of
    positions per example ([b, T]): the position embedding's call needs a new probe, which a
    rank of a sharded model cannot run alone."""
    for found in _found(ranks, "refusal", "positions-per-example"):
        raised = found["raised"]
        assert raised is not None and raised["type"] == "EngineError"
        assert "probed again" in raised["message"] and "sharded" in raised["message"]
        assert raised["hint"]
