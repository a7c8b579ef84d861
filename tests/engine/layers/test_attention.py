"""nn.MultiheadAttention (dpclip/engine/layers/attention.py) against a per-example loop."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dpclip.engine import DPEngine
from tests.engine.conftest import DTYPE, check_exact, classify_loss

E, HEADS, T = 8, 2, 5


def _batch(n=5, t=T, seed=0, pad=False):
    g = torch.Generator().manual_seed(seed)
    batch = {"x": torch.randn(n, t, E, generator=g, dtype=DTYPE),
             "y": torch.randint(0, 3, (n,), generator=g)}
    if pad:   # sample 1 has 2 padded keys, sample 3 one: per-sample masks
        mask = torch.zeros(n, t, dtype=torch.bool)
        mask[1, -2:] = True
        mask[3, -1] = True     # the last: with a causal mask every query keeps a key
        batch["pad"] = mask
    return batch


class AttentionNet(nn.Module):
    """x [B, T, E] -> MultiheadAttention -> mean over T -> Linear head."""

    def __init__(self, batch_first=True, need_weights=True, cross=False, causal=False, **kw):
        super().__init__()
        torch.manual_seed(0)
        self.attn = nn.MultiheadAttention(E, HEADS, batch_first=batch_first, **kw)
        self.memory = nn.Linear(E, E) if cross else None
        self.head = nn.Linear(E, 3)
        self.batch_first, self.need_weights, self.causal = batch_first, need_weights, causal

    def forward(self, x, pad=None):
        q = x if self.batch_first else x.transpose(0, 1)
        kv = q if self.memory is None else torch.tanh(self.memory(q))
        mask = None
        if self.causal:
            mask = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool).triu(1)
        out, _ = self.attn(q, kv, kv, key_padding_mask=pad, need_weights=self.need_weights,
                           attn_mask=mask)
        out = out if self.batch_first else out.transpose(0, 1)
        return self.head(torch.tanh(out).mean(1))


def attention_loss(model, batch):
    return F.cross_entropy(model(batch["x"], batch.get("pad")), batch["y"], reduction="none")


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("need_weights", [True, False])
def test_self_attention_matches_per_example_loop_both_layouts(batch_first, need_weights):
    check_exact(lambda: AttentionNet(batch_first, need_weights).to(DTYPE), attention_loss,
                _batch(), "all-layer", strict=True)


@pytest.mark.parametrize("need_weights", [True, False])
def test_key_padding_mask_and_causal_mask_match_per_example_loop(need_weights):
    check_exact(lambda: AttentionNet(need_weights=need_weights, causal=True).to(DTYPE),
                attention_loss, _batch(pad=True), "layer", strict=True)
    check_exact(lambda: AttentionNet(need_weights=need_weights, bias=False).to(DTYPE),
                attention_loss, _batch(pad=True, seed=1), "param", norm_method="ghost")


@pytest.mark.parametrize("method", ["ghost", "instantiate"])
def test_cross_attention_uses_of_the_packed_weight_match_per_example_loop(method):
    # query and key/value differ: two uses of in_proj_weight (rows q, rows k and v)
    check_exact(lambda: AttentionNet(cross=True).to(DTYPE), attention_loss, _batch(seed=2),
                "all-layer", norm_method=method, strict=True)


def test_frozen_in_projection_still_routes_out_proj_through_its_rule():
    def factory():
        model = AttentionNet().to(DTYPE)
        model.attn.in_proj_weight.requires_grad_(False)
        model.attn.in_proj_bias.requires_grad_(False)
        return model
    check_exact(factory, attention_loss, _batch(seed=3), "all-layer", strict=True)


class EncoderClassifier(nn.Module):
    def __init__(self, layers=1, dropout=0.0):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(11, E)
        layer = nn.TransformerEncoderLayer(E, HEADS, dim_feedforward=16, dropout=dropout,
                                           batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(E, 3)

    def forward(self, ids, pad=None):
        return self.head(self.encoder(self.embed(ids), src_key_padding_mask=pad).mean(1))


def encoder_loss(model, batch):
    return F.cross_entropy(model(batch["ids"], batch.get("pad")), batch["y"], reduction="none")


def _ids_batch(n=5, seed=4):
    g = torch.Generator().manual_seed(seed)
    pad = torch.zeros(n, T, dtype=torch.bool)
    pad[2, -1] = True
    return {"ids": torch.randint(0, 11, (n, T), generator=g), "pad": pad,
            "y": torch.randint(0, 3, (n,), generator=g)}


@pytest.mark.parametrize("grouping", ["all-layer", "layer"])
def test_transformer_encoder_layer_matches_per_example_loop(grouping):
    check_exact(lambda: EncoderClassifier().to(DTYPE), encoder_loss, _ids_batch(), grouping,
                strict=True, micro=[3, 2])


def test_engine_trains_a_transformer_encoder_classifier():
    model = EncoderClassifier(layers=2, dropout=0.1).to(DTYPE)
    before = copy.deepcopy(model.state_dict())
    engine = DPEngine(model, {"grouping": "all-layer", "strict": True}, gradient_noise_multiplier=0.5,
                      expected_batch_size=8, seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        batch = _ids_batch(n=8, seed=10 + step)
        engine.backward(encoder_loss(model, batch))
        report = engine.privatize()
        opt.step()
        opt.zero_grad()
        assert bool(torch.isfinite(report.norm_quantiles["max"]).all())
    for name, value in model.state_dict().items():
        assert torch.isfinite(value).all(), name
        assert not torch.equal(value, before[name]), name
    engine.detach()


@pytest.mark.parametrize("need_weights", [True, False])
def test_attention_dropout_draws_the_same_mask_as_torch(need_weights):
    model = AttentionNet(need_weights=need_weights, dropout=0.3).to(DTYPE).train()
    reference = copy.deepcopy(model)
    x = _batch(seed=5)["x"]
    torch.manual_seed(123)
    expected = reference(x)
    engine = DPEngine(model, {}, expected_batch_size=5)
    torch.manual_seed(123)
    got = model(x)
    torch.testing.assert_close(got, expected)
    torch.manual_seed(124)
    assert not torch.allclose(model(x), expected)    # the mask does depend on the RNG
    engine.detach()
