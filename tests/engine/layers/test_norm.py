"""The LayerNorm rule (dpclip/engine/layers/norm.py): its fused path and its two-step path
against a per-example loop, and which inputs take which."""

import pytest
import torch
from torch import nn

from dpclip.engine.layers.norm import LayerNormRule
from tests.engine.conftest import DTYPE, check_exact, classify_loss


class _Normed(nn.Module):
    def __init__(self, norm, norm_first=False):
        super().__init__()
        self.inner, self.norm, self.head = nn.Linear(4 if not norm_first else 6, 6), norm, nn.Linear(6, 3)
        self.norm_first = norm_first

    def forward(self, x):
        if self.norm_first:   # the input needs no gradient: the backward forms none for it
            return self.head(torch.tanh(self.inner(self.norm(x))).mean(1))
        return self.head(torch.tanh(self.norm(self.inner(x))).mean(1))


@pytest.mark.parametrize("norm_first", [False, True])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("path", ["per-sample", "batched", "two-step"])
def test_layernorm_paths_match_per_example_loop(monkeypatch, path, bias, norm_first):
    from dpclip.engine.layers import norm as norm_rules

    calls = []
    real = LayerNormRule._fused
    monkeypatch.setattr(LayerNormRule, "_fused", staticmethod(
        lambda m, x: calls.append(real(m, x)) or (real(m, x) and path != "two-step")))
    if path == "batched":   # the fused input gradient of the whole batch, as off the CPU
        monkeypatch.setattr(norm_rules, "PER_SAMPLE_BACKWARD_DEVICES", ())
    per_sample = []
    real_per_sample = LayerNormRule._per_sample_backward
    monkeypatch.setattr(LayerNormRule, "_per_sample_backward", staticmethod(
        lambda *a: per_sample.append(1) or real_per_sample(*a)))
    gen = torch.Generator().manual_seed(3 + bias)
    batch = {"x": torch.randn(5, 7, 6 if norm_first else 4, generator=gen, dtype=DTYPE),
             "y": torch.randint(0, 3, (5,), generator=gen)}
    factory = lambda: _Normed(nn.LayerNorm(6, bias=bias), norm_first).to(DTYPE)   # noqa: E731
    check_exact(factory, classify_loss, batch, "param")
    # The inner Linear's input gradient flows through the norm's backward, so a wrong input
    # gradient fails check_exact on inner.weight; and the path under test did run.
    assert calls and all(calls)
    assert bool(per_sample) == (path == "per-sample" and not norm_first)


def test_layernorm_takes_the_fused_path_only_for_full_precision_outside_autocast():
    norm = nn.LayerNorm(6)
    assert LayerNormRule._fused(norm, torch.zeros(2, 6))
    assert LayerNormRule._fused(norm.double(), torch.zeros(2, 6, dtype=torch.float64))
    assert not LayerNormRule._fused(norm.float(), torch.zeros(2, 6, dtype=torch.bfloat16))
    assert not LayerNormRule._fused(norm.float(), torch.zeros(2, 6, dtype=torch.float64))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not LayerNormRule._fused(norm, torch.zeros(2, 6))


def test_fused_layernorm_saves_no_normalised_copy_of_its_input():
    # The two-step path kept x̂ for the affine's backward beside the x autograd's norm kept;
    # the fused path keeps x and two statistics per position.
    from dpclip.engine import DPEngine

    model = _Normed(nn.LayerNorm(6))
    engine = DPEngine(model, {"grouping": "all-layer"}, gradient_noise_multiplier=0.0,
                      expected_batch_size=4, seed=0)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.shape) or t, lambda t: t):
        model(torch.randn(4, 7, 4))
    engine.detach()
    full = [s for s in saved if tuple(s) == (4, 7, 6)]
    # the norm's input (x), the tanh's output: no third [4, 7, 6] for x̂
    assert len(full) == 2, saved


class _SeqFirst(nn.Module):
    """A [T, B, d] activation: the norm's output gradient reaches its backward batch-first
    as a view that is not contiguous."""

    def __init__(self):
        super().__init__()
        self.inner, self.norm, self.head = nn.Linear(4, 6), nn.LayerNorm(6), nn.Linear(6, 3)

    def forward(self, x):
        h = self.inner(x).transpose(0, 1)            # [T, B, 6]
        return self.head(torch.tanh(self.norm(h)).mean(0))


@pytest.mark.parametrize("path", ["per-sample", "batched"])
def test_fused_layernorm_with_a_non_contiguous_output_gradient_matches_per_example_loop(monkeypatch, path):
    from dpclip.engine.layers import norm as norm_rules

    if path == "batched":
        monkeypatch.setattr(norm_rules, "PER_SAMPLE_BACKWARD_DEVICES", ())
    gen = torch.Generator().manual_seed(11)
    batch = {"x": torch.randn(5, 7, 4, generator=gen, dtype=DTYPE),
             "y": torch.randint(0, 3, (5,), generator=gen)}
    check_exact(lambda: _SeqFirst().to(DTYPE), classify_loss, batch, "param")
