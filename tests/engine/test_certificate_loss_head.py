"""The loss head reads the model through its returned tensors only (dpclip/engine/certificate/head.py,
docs/certificate.md): a loss term taken from the model another way (an auxiliary loss kept on the
model, a feature a hook took out) is refused before any noise, however small; losses over returned
dicts, dataclasses and frozen teachers' outputs keep training exactly."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dpclip.engine import DPEngine
from dpclip.errors import EngineError

B = 16


def _data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(B, 5, generator=g), torch.randint(0, 3, (B,), generator=g)


def _engine(model, noise=1.0):
    return DPEngine(model, {"grouping": "all-layer", "threshold": {"kind": "fixed", "value": 1.0}},
                    gradient_noise_multiplier=noise, expected_batch_size=B)


class MoEKeepingItsAuxLoss(nn.Module):
    """A router over three experts; the load-balancing loss over the batch kept on the model."""

    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(5, 3)
        self.experts = nn.ModuleList(nn.Linear(5, 3) for _ in range(3))

    def forward(self, x):
        p = F.softmax(self.gate(x), -1)
        self.aux = 3 * (p.mean(0) ** 2).sum()          # mixes samples, and is not returned
        return sum(p[:, i:i + 1] * e(x) for i, e in enumerate(self.experts))


def test_an_auxiliary_loss_kept_on_the_model_is_refused_before_any_noise_even_below_the_rounding_bound():
    # weighted 1e-4 the term moves each row's gradient by ~1e-4 relative: under float32's bound
    # (1e-3), so the comparison with the samples' own gradients alone let it train
    torch.manual_seed(0)
    model = MoEKeepingItsAuxLoss()
    x, y = _data()
    engine = _engine(model)
    with pytest.raises(EngineError, match=r"read module gate \(Linear\) other than through the tensors") as err:
        engine.backward(F.cross_entropy(model(x), y, reduction="none") + 1e-4 * model.aux)
    assert "auxiliary loss" in err.value.hint
    assert all(p.grad is None for p in model.parameters())


def test_a_feature_taken_out_by_a_forward_hook_into_the_loss_is_refused():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3))
    taken = {}
    model[1].register_forward_hook(lambda m, a, out: taken.update(h=out))
    x, y = _data()
    engine = _engine(model)
    with pytest.raises(EngineError, match=r"read module 0 \(Linear\) other than through"):
        engine.backward(F.cross_entropy(model(x), y, reduction="none") + 1e-5 * taken["h"].pow(2).sum(1))


@dataclasses.dataclass
class Out:
    logits: torch.Tensor
    hidden: torch.Tensor


class ReturnsADataclass(nn.Module):
    def __init__(self):
        super().__init__()
        self.f, self.h = nn.Linear(5, 8), nn.Linear(8, 3)
        self.teacher = nn.Linear(5, 3).requires_grad_(False)

    def forward(self, x):
        h = torch.tanh(self.f(x))
        return Out(self.h(h), h), {"teacher": self.teacher(x)}


def _own_gradient(model, x, y, loss):
    model.zero_grad(set_to_none=True)
    loss(model, x, y).sum().backward()
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.requires_grad])


def test_losses_over_returned_dataclasses_dicts_and_a_frozen_teacher_train_exactly():
    def loss(m, x, y):
        out, extra = m(x)
        out.logits.mul_(1.0)                                   # in place on a returned tensor
        kd = F.kl_div(F.log_softmax(out.logits, -1), F.softmax(extra["teacher"], -1), reduction="none").sum(-1)
        return F.cross_entropy(out.logits, y, reduction="none") + kd + 0.1 * out.hidden.pow(2).sum(1)

    torch.manual_seed(0)
    model = ReturnsADataclass().double()
    x, y = _data()
    x = x.double()
    own = [_own_gradient(model, x[i:i + 1], y[i:i + 1], loss) for i in range(B)]
    model.zero_grad(set_to_none=True)
    engine = _engine(model, noise=0.0)
    engine.backward(loss(model, x, y))
    got = engine.debug_clipped()
    want = sum(g * min(1.0, 1.0 / float(g.norm())) for g in own)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    flat = torch.cat([got.sums[n].flatten() for n in names])
    assert torch.allclose(flat, want, rtol=1e-9, atol=1e-12)
