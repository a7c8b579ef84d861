"""Parametrized weights: per-sample gradients of the originals through the parametrization
(dpclip/engine/parametrized.py; docs/layer-rules.md, "Parametrized weights")."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.nn.utils import parametrizations, parametrize

import dpclip.engine.bookkeeping as bookkeeping
from dpclip.engine import DPEngine, build_groups, trainable_params
from dpclip.errors import EngineError
from tests.engine.conftest import (DTYPE, check_exact, classify_loss, clip_reference, group_norms, mlp_batch,
                                   per_example_grads, run_engine)


class Symmetric(nn.Module):
    """A user's own parametrization: W = triu(X) + triu(X, 1)ᵀ."""

    def forward(self, x):
        return x.triu() + x.triu(1).transpose(-1, -2)


class Scaled(nn.Module):
    """A parametrization with a trainable parameter of its own (refused)."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self, x):
        return x * self.scale


class TwiceThrough(nn.Module):
    """One symmetric Linear called twice (two uses of one W per forward, one per call)."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(6, 8)
        self.sym = nn.Linear(8, 8)
        parametrize.register_parametrization(self.sym, "weight", Symmetric())
        self.out = nn.Linear(8, 3)

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        return self.out(torch.tanh(self.sym(torch.tanh(self.sym(h)))))


class EinsumParametrized(nn.Module):
    """A module without a layer rule (the torch.func fallback) whose weight is weight-normed."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(8, 6) * 0.3)

    def forward(self, x):
        return torch.einsum("bd,kd->bk", x, self.weight)


class ConvNet(nn.Module):
    """wav2vec2's positional convolution: weight_norm over dim 2 of a grouped Conv1d."""

    def __init__(self):
        super().__init__()
        self.conv = parametrizations.weight_norm(nn.Conv1d(4, 4, 3, padding=1, groups=2), dim=2)
        self.head = nn.Linear(4, 3)

    def forward(self, x):
        return self.head(torch.tanh(self.conv(x)).mean(-1))


def _head(first: nn.Module, width: int = 8) -> nn.Module:
    return nn.Sequential(first, nn.Tanh(), nn.Linear(width, 3))


FACTORIES = {
    "weight_norm": lambda: _head(parametrizations.weight_norm(nn.Linear(6, 8))),
    "weight_norm_dim1": lambda: _head(parametrizations.weight_norm(nn.Linear(6, 8), dim=1)),
    "spectral_norm": lambda: _head(parametrizations.spectral_norm(nn.Linear(6, 8))).eval(),
    "orthogonal": lambda: _head(parametrizations.orthogonal(nn.Linear(6, 8))),
    "weight_and_bias": lambda: _head(parametrize.register_parametrization(
        parametrizations.weight_norm(nn.Linear(6, 8)), "bias", nn.Tanh())),
    "user_symmetric_called_twice": TwiceThrough,
    "torch_func_fallback": lambda: _head(parametrizations.weight_norm(EinsumParametrized())),
}


def _factory(name):
    def build():
        torch.manual_seed(0)
        return FACTORIES[name]().to(DTYPE)
    return build


@pytest.mark.parametrize("grouping", ["all-layer", "layer", "param"])
@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_parametrized_weight_clips_like_the_per_example_loop(name, grouping):
    engine, _, _ = check_exact(_factory(name), classify_loss, mlp_batch(n=5), grouping=grouping)
    assert engine.certificate.checks == 1


@pytest.mark.parametrize("norm_method", ["ghost", "instantiate"])
def test_weight_normed_grouped_conv_matches_the_per_example_loop(norm_method):
    g = torch.Generator().manual_seed(3)
    batch = {"x": torch.randn(5, 4, 7, generator=g, dtype=DTYPE), "y": torch.randint(0, 3, (5,), generator=g)}

    def build():
        torch.manual_seed(1)
        return ConvNet().to(DTYPE)
    check_exact(build, classify_loss, batch, grouping="param", norm_method=norm_method)


def _engine(model, batch):
    return DPEngine(model, {"threshold": {"kind": "fixed", "value": 1.0}}, gradient_noise_multiplier=0.0,
                    expected_batch_size=batch)


def _step(engine, model, batch):
    engine.backward(classify_loss(model, batch))
    return engine.privatize()


@pytest.mark.parametrize("sabotage", ["rows rolled", "originals dropped"])
def test_parametrization_attribution_switched_off_is_refused_by_the_certificate(monkeypatch, sabotage):
    """The fix's sabotage: the originals' gradients given to the wrong samples, or left out
    (what the engine did before it followed parametrizations) are refused at the first step."""
    real = bookkeeping.original_uses

    def broken(weight, originals, use):
        uses = real(weight, originals, use)
        if sabotage == "rows rolled":
            return [type(u)(u.grad.roll(1, dims=0)) for u in uses]
        return [type(u)(torch.zeros_like(u.grad)) for u in uses]
    monkeypatch.setattr(bookkeeping, "original_uses", broken)
    model = _factory("weight_norm")()
    batch = mlp_batch(n=6)
    batch["x"][0] *= 30   # one sample far above the others, so rolled rows show in its norms
    with pytest.raises(EngineError, match="certificate refused") as err:
        _step(_engine(model, 6), model, batch)
    assert "original" in err.value.message


def test_spectral_norm_power_iteration_advances_once_per_forward_as_without_the_engine():
    torch.manual_seed(0)
    model = _head(parametrizations.spectral_norm(nn.Linear(6, 8))).to(DTYPE)
    plain = copy.deepcopy(model)
    batch = mlp_batch(n=5)
    engine = _engine(model, 5)
    _step(engine, model, batch)   # the certificate's replays too leave u as the forward left it
    plain(batch["x"])
    u = "0.parametrizations.weight.0._u"
    torch.testing.assert_close(model.state_dict()[u], plain.state_dict()[u], rtol=0, atol=0)


def test_spectral_norm_in_training_mode_is_checked_from_the_buffers_its_forward_started_with():
    """Its forward advances the power iteration (buffers u, v) before it computes the weight: each
    sample's own gradient is replayed from the buffers the batch's forward found, not from the
    advanced ones (refused by the certificate before, at 10⁻³ relative)."""
    torch.manual_seed(0)
    model = _head(parametrizations.spectral_norm(nn.Linear(6, 8))).to(DTYPE)
    batch = mlp_batch(n=5)
    alone = [per_example_grads(copy.deepcopy(model), classify_loss, {k: v[i:i + 1] for k, v in batch.items()})[0]
             for i in range(5)]
    groups = build_groups(model, "all-layer")
    thresholds = [float(group_norms(alone, groups).median(dim=0).values[0])]
    ref = clip_reference(groups, alone, thresholds, "abadi", 7)
    run_engine(model, classify_loss, batch, {"threshold": {"kind": "fixed", "value": thresholds}}, 7)
    for info in trainable_params(model):
        torch.testing.assert_close(info.param.grad, ref.grads[info.name], rtol=1e-9, atol=1e-12)


def test_parametrization_with_trainable_parameters_of_its_own_is_refused():
    lin = nn.Linear(6, 8)
    parametrize.register_parametrization(lin, "weight", Scaled())
    with pytest.raises(EngineError, match="parametrization of 'weight' has trainable parameters"):
        _engine(_head(lin), 4)


def test_frozen_original_is_left_alone():
    model = _factory("weight_norm")()
    model[0].parametrizations.weight.original0.requires_grad_(False)   # the magnitude g frozen
    batch = mlp_batch(n=5)
    check_exact(lambda: model, classify_loss, batch)
    assert model[0].parametrizations.weight.original0.grad is None


def test_no_gradient_reaches_the_originals_outside_the_engine():
    """p.grad of an original holds the privatized sum only: nothing from autograd's own pass."""
    model = _factory("weight_norm")()
    batch = mlp_batch(n=5)
    engine = _engine(model, 5)
    engine.backward(classify_loss(model, batch))
    assert all(p.grad is None for p in model.parameters())


def _cached_loss(model, batch):
    with parametrize.cached():
        return classify_loss(model, batch)


@pytest.mark.parametrize("name", ["weight_norm", "user_symmetric_called_twice", "torch_func_fallback"])
def test_a_forward_under_parametrize_cached_clips_like_the_per_example_loop(name):
    """The probes ran inside the user's cached() block and left their W in its cache: the training
    forward read it, and its backward ran into the probe's graph (refused as an engine failure)."""
    engine, _, _ = check_exact(_factory(name), _cached_loss, mlp_batch(n=5))
    assert engine.certificate.checks == 1


def test_a_backward_inside_parametrize_cached_is_checked_against_the_replays_own_weights():
    """The certificate's replays read the training forward's cached W, which their own originals
    never reach: every sample was refused (relative error 1e+29) though the engine was exact."""
    model = _factory("weight_norm")()
    reference = copy.deepcopy(model)
    batch = mlp_batch(n=5)
    engine = DPEngine(model, {"threshold": {"kind": "fixed", "value": 1e9}}, gradient_noise_multiplier=0.0,
                      expected_batch_size=5)
    with parametrize.cached():
        engine.backward(classify_loss(model, batch))
    engine.privatize()
    classify_loss(reference, batch).sum().backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad / 5, rtol=1e-9, atol=1e-12, msg=name)
