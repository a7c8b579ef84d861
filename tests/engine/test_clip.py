"""Clip functions and why finer groups are not a superset of coarser ones."""

import math

import pytest
import torch

from dpclip.engine.clip import abadi, auto, make_clip_fn
from dpclip.errors import EngineError


def test_abadi_clips_to_threshold_and_leaves_small_and_zero_gradients_alone():
    norms = torch.tensor([0.0, 0.5, 2.0, 8.0], dtype=torch.float64)
    c = abadi(norms, torch.tensor(2.0, dtype=torch.float64))
    torch.testing.assert_close(c, torch.tensor([1.0, 1.0, 1.0, 0.25], dtype=torch.float64))


def test_auto_scales_every_gradient_to_just_below_threshold():
    norms = torch.tensor([0.0, 1.0, 100.0], dtype=torch.float64)
    c = auto(norms, torch.tensor(2.0, dtype=torch.float64), gamma=0.01)
    torch.testing.assert_close(c, 2.0 / (norms + 0.01))
    assert (c * norms < 2.0).all()


def test_per_sample_thresholds_broadcast():
    norms = torch.tensor([4.0, 4.0])
    assert abadi(norms, torch.tensor([1.0, 2.0])).tolist() == [0.25, 0.5]


def test_unknown_clip_function_is_refused_with_the_allowed_names():
    with pytest.raises(EngineError) as err:
        make_clip_fn("psac")
    assert "abadi" in err.value.hint and "auto" in err.value.hint


def _clip_groups(g, splits, thresholds):
    out = []
    for (lo, hi), c in zip(splits, thresholds):
        part = g[lo:hi]
        out.append(part * abadi(part.norm().reshape(1), torch.tensor([c]))[0])
    return torch.cat(out)


def test_theorem2_counterexample_no_two_group_split_reproduces_all_layer_clipping():
    # docs/engine.md: g_i = [3, 4], g_j = [6, 0], R = 4.
    gi, gj = torch.tensor([3.0, 4.0], dtype=torch.float64), torch.tensor([6.0, 0.0], dtype=torch.float64)
    flat = [g * abadi(g.norm().reshape(1), torch.tensor([4.0], dtype=torch.float64))[0] for g in (gi, gj)]
    torch.testing.assert_close(flat[0], torch.tensor([2.4, 3.2], dtype=torch.float64))
    torch.testing.assert_close(flat[1], torch.tensor([4.0, 0.0], dtype=torch.float64))
    # Group 1 = first coordinate. Reproducing g_i needs R1 = 2.4, g_j needs R1 = 4.
    best = math.inf
    for r1 in torch.linspace(0.001, 3.999, 4000, dtype=torch.float64):
        r2 = math.sqrt(16 - float(r1) ** 2)
        err = max((_clip_groups(g, [(0, 1), (1, 2)], [float(r1), r2]) - f).abs().max().item()
                  for g, f in zip((gi, gj), flat))
        best = min(best, err)
    assert best > 0.5   # the closest split is still far off (analytically 0.8 at R1 = 3.2)
