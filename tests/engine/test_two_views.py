"""Views concatenated on the batch (issue 52): a layer input of [c·B, ...] rows, every sample's
first view then every sample's second, is read batch-inner by the probes and clipped as the
per-example reference (docs/layer-rules.md, "The batch axis")."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dpclip.engine import DPEngine
from dpclip.engine.batch_axis import layout
from dpclip.errors import EngineError
from tests.engine.conftest import DTYPE, check_exact


class TwoViews(nn.Module):
    def __init__(self):
        super().__init__()
        self.enc, self.head = nn.Linear(6, 8), nn.Linear(16, 3)

    def forward(self, x):
        views = torch.cat([x, torch.tanh(x.flip(-1))], 0)            # [2B, T, d]
        z = torch.relu(self.enc(views)).mean(1)                       # [2B, 8]
        first, second = z.unflatten(0, (2, -1))
        return self.head(torch.cat([first, second], -1))              # [B, 3]: each sample's own views


def _model():
    torch.manual_seed(0)
    return TwoViews().to(DTYPE)


def _loss(model, batch):
    return F.cross_entropy(model(batch["x"]), batch["y"], reduction="none")


def _batch(n=5, seed=7):
    g = torch.Generator().manual_seed(seed)
    return {"x": torch.randn(n, 4, 6, generator=g, dtype=DTYPE), "y": torch.randint(0, 3, (n,), generator=g)}


@pytest.mark.parametrize("grouping, norm_method", [("all-layer", "auto"), ("layer", "ghost"), ("param", "instantiate")])
def test_two_views_on_the_batch_clip_as_the_per_example_reference(grouping, norm_method):
    check_exact(_model, _loss, _batch(), grouping=grouping, norm_method=norm_method, micro=[2, 3])


def test_views_read_batch_outer_by_mistake_are_refused_by_the_certificate(monkeypatch):
    """Sabotage: the [2B] rows unflattened as [B, 2] (the batch-outer reading): row i of the
    engine is then another sample's view, which only the check can tell."""
    real = layout.to_batch_first

    def outer(t, lay, batch, feature_dims, label):
        if lay.merged and lay.outer > 1:
            lay = layout.Layout(lay.ndim, lay.dim, merged=True)
        return real(t, lay, batch, feature_dims, label)
    monkeypatch.setattr(layout, "to_batch_first", outer)
    import dpclip.engine.batch_axis.site as site
    monkeypatch.setattr(site, "to_batch_first", outer)
    model = _model()
    batch = _batch(6)
    batch["x"][0] *= 20   # one sample's norm far above the others'
    engine = DPEngine(model, {"grouping": "layer", "threshold": {"kind": "fixed", "value": 0.1}},
                      gradient_noise_multiplier=0.0, expected_batch_size=6)
    with pytest.raises(EngineError, match="certificate refused"):
        engine.backward(_loss(model, batch))
