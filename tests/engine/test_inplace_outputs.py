"""A book-kept layer's output may be changed in place (``h += x``, ``nn.ReLU(inplace=True)``).

Autograd forbids in-place changes to a view made inside a custom Function, and F.linear on
a [B, T, d] input returns such a view: every in-place op after a Linear on 3-D input was an
internal error, and so was all of Falcon (``mlp_output += attention_output``). Each case runs
against the float64 per-example loop.
"""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st
from torch import nn

from dpclip.engine import DPEngine
from tests.engine.conftest import DTYPE, Gate, check_exact


def _add_input(h, x):
    h += x
    return h


def _relu_(h, x):
    return F.relu_(h)


def _relu_module(h, x):
    return nn.ReLU(inplace=True)(h)


def _mul_(h, x):
    return h.mul_(torch.sigmoid(x))


def _first_add(out, x):            # MultiheadAttention returns (output, weights)
    out[0].add_(x)
    return out[0]


class InPlaceAfter(nn.Module):
    """``layer``, an in-place change of its output, then a Linear head on the mean."""

    def __init__(self, layer, change, width):
        super().__init__()
        self.layer, self.change = layer, change
        self.head = nn.Linear(width, 3)

    def forward(self, x):
        h = self.change(self.layer(x), x)
        return self.head(h.reshape(h.shape[0], -1, h.shape[-1]).mean(1))


def _hf_conv1d(n_out, n_in):
    from transformers.pytorch_utils import Conv1D
    return Conv1D(n_out, n_in)


def _falcon_linear(n_in, n_out):
    from transformers.models.falcon.modeling_falcon import FalconLinear
    return FalconLinear(n_in, n_out)


class SelfAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.mha = nn.MultiheadAttention(4, 2, batch_first=True)

    def forward(self, x):
        return self.mha(x, x, x, need_weights=False)


# (id, layer factory, input shape per sample, in-place change, output width, strict)
CASES = [
    ("linear-3d-add", lambda: nn.Linear(4, 4), (3, 4), _add_input, 4, True),
    ("linear-4d-relu_", lambda: nn.Linear(4, 5), (2, 3, 4), _relu_, 5, True),
    ("linear-3d-relu-module", lambda: nn.Linear(4, 5), (3, 4), _relu_module, 5, True),
    ("linear-2d-add", lambda: nn.Linear(4, 4), (4,), _add_input, 4, True),
    ("hf-conv1d-3d-add", lambda: _hf_conv1d(4, 4), (3, 4), _add_input, 4, True),
    ("falcon-linear-3d-mul_", lambda: _falcon_linear(4, 4), (3, 4), _mul_, 4, True),
    ("conv2d-relu_", lambda: nn.Conv2d(2, 3, 3, padding=1), (2, 4, 4), _relu_, 4, True),
    ("layernorm-add", lambda: nn.LayerNorm(4), (3, 4), _add_input, 4, True),
    ("mha-add", SelfAttention, (3, 4), _first_add, 4, True),
    ("fallback-add", lambda: Gate(4), (3, 4), _add_input, 4, False),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("method", ["ghost", "instantiate"])
def test_an_in_place_change_of_a_layer_output_is_exact(case, method):
    _, factory, shape, change, width, strict = case
    g = torch.Generator().manual_seed(7)
    batch = {"x": torch.randn(5, *shape, generator=g, dtype=DTYPE),
             "y": torch.randint(0, 3, (5,), generator=g)}
    check_exact(lambda: InPlaceAfter(factory(), change, width).to(DTYPE),
                lambda m, b: F.cross_entropy(m(b["x"]), b["y"], reduction="none"), batch,
                "layer", norm_method=method, strict=strict)


def test_an_embedding_output_changed_in_place_is_exact():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(7, 4)
            self.head = nn.Linear(4, 3)

        def forward(self, ids):
            h = self.emb(ids)
            h.mul_(2.0)
            return self.head(torch.tanh(h).mean(1))

    g = torch.Generator().manual_seed(8)
    batch = {"x": torch.randint(0, 7, (5, 3), generator=g), "y": torch.randint(0, 3, (5,), generator=g)}
    check_exact(lambda: Net().to(DTYPE),
                lambda m, b: F.cross_entropy(m(b["x"]), b["y"], reduction="none"), batch, "param")


def test_the_linear_output_shares_no_memory_it_should_not():
    """The output is a plain tensor (no copy was made), and the module's input is untouched."""
    lin = nn.Linear(4, 4).to(DTYPE)
    engine = DPEngine(lin, {}, expected_batch_size=2, gradient_noise_multiplier=0.0)
    x = torch.randn(2, 3, 4, dtype=DTYPE)
    kept = x.clone()
    y = lin(x)
    assert not y._is_view()
    y += 1.0
    torch.testing.assert_close(x, kept)
    engine.backward(y.pow(2).sum((1, 2)))
    engine.detach()


@settings(max_examples=25, deadline=None)
@given(batch=st.integers(1, 6), length=st.integers(1, 5), width=st.integers(1, 5),
       seed=st.integers(0, 2**16))
def test_property_linear_with_residual_in_place_is_exact_at_any_shape(batch, length, width, seed):
    """B = 1, B = T, B = T + 1 and generic shapes, feature sizes 1..5."""
    class Residual(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(width, width), nn.Linear(width, width)
            self.head = nn.Linear(width, 2)

        def forward(self, x):
            h = self.a(x)
            h += x
            h = self.b(F.relu_(h))
            h.add_(x)
            return self.head(h.mean(1))

    g = torch.Generator().manual_seed(seed)
    data = {"x": torch.randn(batch, length, width, generator=g, dtype=DTYPE),
            "y": torch.randint(0, 2, (batch,), generator=g)}
    check_exact(lambda: Residual().to(DTYPE),
                lambda m, b: F.cross_entropy(m(b["x"]), b["y"], reduction="none"), data,
                "all-layer", fn="auto" if batch == 1 else "abadi")


# ------------------------------------------------------------------------ Falcon


def _falcon(**overrides):
    from transformers import FalconConfig, FalconForCausalLM
    cfg = FalconConfig(vocab_size=30, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                       hidden_dropout=0.0, attention_dropout=0.0, **overrides)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    return FalconForCausalLM(cfg).to(DTYPE)


def falcon_loss(model, batch):
    ids = batch["ids"]
    logits = model(input_ids=ids, use_cache=False).logits
    return F.cross_entropy(logits[:, :-1].transpose(1, 2), ids[:, 1:], reduction="none").mean(1)


@pytest.mark.parametrize("n,t", [(3, 5), (4, 4), (5, 4), (1, 4)],
                         ids=["B!=T", "B==T", "B==T+1", "B1"])
def test_falcon_is_exact_at_every_batch_shape(n, t):
    g = torch.Generator().manual_seed(10 * n + t)
    batch = {"ids": torch.randint(0, 30, (n, t), generator=g)}
    check_exact(_falcon, falcon_loss, batch, "layer", fn="auto" if n == 1 else "abadi",
                strict=True)    # FalconLinear by the Linear rule: no torch.func fallback


@pytest.mark.parametrize("overrides", [
    {"new_decoder_architecture": True, "num_kv_heads": 1},
    {"alibi": True, "bias": True},
    {"parallel_attn": False},
], ids=["new-arch", "alibi-bias", "sequential"])
def test_falcon_variants_are_exact(overrides):
    g = torch.Generator().manual_seed(11)
    batch = {"ids": torch.randint(0, 30, (4, 5), generator=g)}
    check_exact(lambda: _falcon(**overrides), falcon_loss, batch, "all-layer", strict=True)
