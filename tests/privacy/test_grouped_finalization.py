"""An attacker's example in a step whose groups are finalized several at a time.

On a GPU the engine finalizes groups four at a time (dpclip/engine/microbatch.py,
FINALIZE_BATCH): their norms are one [b, K'] tensor, clipped by one call against their
thresholds, and the small instantiated gradients of a group (biases) are normed and summed
from one concatenation. A misaligned column (group j clipped at group j'’s threshold, or with
another group's factors) or a dropped row mask would let one example move a group's sum by
more than its C_k, which the printed ε does not allow. The attacker holds the recipe and the
model: here it adds one example with a huge gradient, or a NaN, and every group's clipped
sum must move by at most that group's own C_k (zero for the NaN), with each group's C_k
different so that a swap shows. Run on the CPU with the GPU's batch forced."""

import copy

import pytest
import torch

import dpclip.engine.microbatch as microbatch_module
from dpclip.engine import DPEngine, trainable_params
from dpclip.engine.groups import build_groups
from tests.engine.conftest import DTYPE, classify_loss, mlp, mlp_batch

GROUPINGS = ["layer", "param", {"uniform": 3}]


def _group_sums(model, clipping, batch, micro):
    """Each group's clipped sum Σ_i c_i g_i (σ = 0, expected batch size 1)."""
    engine = DPEngine(model, clipping, gradient_noise_multiplier=0.0, expected_batch_size=1)
    start = 0
    for size in micro:
        engine.backward(classify_loss(model, {k: v[start:start + size] for k, v in batch.items()})
                        * batch["w"][start:start + size])
        start += size
    report = engine.privatize()
    flat = [info.param.grad.flatten() for info in trainable_params(model)]
    engine.detach()
    return flat, report


@pytest.mark.parametrize("finalize_batch", [4, 2])
@pytest.mark.parametrize("grouping", GROUPINGS, ids=str)
@pytest.mark.parametrize("attack", ["huge", "nan"])
def test_one_example_moves_each_group_by_at_most_its_own_threshold(monkeypatch, grouping, attack,
                                                                   finalize_batch):
    monkeypatch.setitem(microbatch_module.FINALIZE_BATCH, "cpu", finalize_batch)
    torch.manual_seed(4)
    model = mlp()
    groups = build_groups(model, grouping)
    k = len(groups.members)
    assert k >= 3
    thresholds = [0.05 * (1 + 3 * (j % 4)) for j in range(k)]   # distinct neighbours: a swap shows
    clipping = {"grouping": grouping, "threshold": {"kind": "fixed", "value": thresholds}}
    batch = mlp_batch(n=6, seed=2)
    batch["w"] = torch.ones(6, dtype=DTYPE)
    attacked = {key: value.clone() for key, value in batch.items()}
    if attack == "huge":
        attacked["w"][-1] = 1e8
    else:
        attacked["x"][-1, 0] = float("nan")   # NaN through every layer: every group's norm
    without, _ = _group_sums(copy.deepcopy(model), clipping, {key: v[:5] for key, v in batch.items()}, [5])
    with_it, report = _group_sums(copy.deepcopy(model), clipping, attacked, [4, 2])
    moved = []
    for j, members in enumerate(groups.members):
        delta = torch.cat([with_it[i] - without[i] for i in members]).norm()
        assert torch.isfinite(delta)
        assert float(delta) <= thresholds[j] * (1 + 1e-9), (j, float(delta), thresholds[j])
        moved.append(float(delta))
    if attack == "huge":   # the huge example is clipped in every group: it reaches each C_k
        assert moved == pytest.approx(thresholds, rel=1e-6)
    else:                  # and the NaN one is dropped from every group
        assert max(moved) < 1e-12
        assert report.nonfinite.tolist() == [1] * k
