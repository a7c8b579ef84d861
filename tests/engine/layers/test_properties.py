"""Property tests for every layer rule: the engine's clipped sums and per-sample group norms
(``DPEngine.debug_clipped()``, noise 0) equal a float64 per-example autograd loop.

For each registered rule (``registered_rules()``: Linear, transformers' Conv1D, Conv1d/Conv2d,
Embedding, EmbeddingBag, FalconLinear, LayerNorm/GroupNorm/RMSNorm/InstanceNorm,
MultiheadAttention) and for the torch.func
fallback (a custom module with its own nn.Parameters, nn.LSTM / nn.GRU), hypothesis draws the
layer's sizes and options, then (:func:`_drawn_run`) the micro-batch size b — always among 1,
T and T + 1 (T the layer's sequence or spatial length: where a batch axis guessed from a size
goes wrong) or a generic value —, one or two micro-batches of b samples, the grouping, the
norm method and the model's dtype. The check itself, its tolerances and their derivation from
the dtype are tests/engine/layers/property_check.py's.

The unmarked tests run a fixed, derandomized profile (``FAST``, a few seconds each); the
``slow`` twins run the same properties with many more examples (``THOROUGH``).
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings, strategies as st
from torch import nn
from transformers.models.falcon.modeling_falcon import FalconLinear
from transformers.pytorch_utils import Conv1D as HFConv1D

from dpclip.engine.layers import registered_rules
from dpclip.engine.factors import Bilinear
from dpclip.engine.layers.linear import LinearRule
from tests.engine.layers.property_check import (DTYPES, GROUPINGS, METHODS, Case, CustomLayer, Run,
                                                check_case)

_COMMON = dict(derandomize=True, database=None, deadline=None,
               suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
FAST = settings(max_examples=30, **_COMMON)
THOROUGH = settings(max_examples=200, **_COMMON)

sizes = st.integers


def _randn(gen, *shape):
    return torch.randn(*shape, generator=gen, dtype=torch.float64)


def _drawn_run(draw, length: int) -> Run:
    kind = draw(st.sampled_from(["1", "T", "T+1", "generic"]), label="batch size is")
    batch = {"1": 1, "T": length, "T+1": length + 1}.get(kind) or draw(sizes(2, 6), label="generic b")
    return Run(batch=batch, micro_batches=draw(st.sampled_from([1, 2]), label="micro-batches"),
               grouping=draw(st.sampled_from(GROUPINGS), label="grouping"),
               method=draw(st.sampled_from(METHODS), label="norm_method"),
               dtype=draw(st.sampled_from(DTYPES), label="dtype"),
               seed=draw(st.integers(0, 2 ** 16), label="seed"))


# ------------------------------------------------------------------ the layers


def linear_case(draw) -> Case:
    """nn.Linear, transformers' Conv1D or FalconLinear on [b, d], [b, T, d] or [b, T, 2, d]."""
    d, p, t = draw(sizes(1, 5)), draw(sizes(1, 5)), draw(sizes(1, 5))
    lead = draw(st.sampled_from([(), (t,), (t, 2)]), label="leading dims")
    kind = draw(st.sampled_from(["linear", "conv1d", "falcon"]), label="linear kind")
    if kind == "conv1d":
        layer = HFConv1D(p, d)
    elif kind == "falcon":
        layer = FalconLinear(d, p, bias=draw(st.booleans(), label="bias"))
    else:
        layer = nn.Linear(d, p, bias=draw(st.booleans(), label="bias"))
    return Case(layer, lambda n, g: {"x": _randn(g, n, *lead, d)}, lambda m, b: m(b["x"]), t)


def conv_case(draw) -> Case:
    """nn.Conv1d / nn.Conv2d: groups, stride, dilation, padding (int, 'same', reflect, circular)."""
    dims = draw(st.sampled_from([1, 2]), label="spatial dims")
    groups = draw(sizes(1, 3), label="groups")
    c_in, c_out = groups * draw(sizes(1, 2)), groups * draw(sizes(1, 2))
    kernel = tuple(draw(sizes(1, 3)) for _ in range(dims))
    dilation = draw(sizes(1, 2), label="dilation")
    mode = draw(st.sampled_from(["zeros", "reflect", "circular", "same"]), label="padding")
    stride = 1 if mode == "same" else draw(sizes(1, 2), label="stride")
    pad = "same" if mode == "same" else draw(sizes(0, 2), label="padding size")
    reach = max(dilation * (k - 1) + 1 for k in kernel)
    spatial = tuple(max(draw(sizes(1, 6)), reach, 0 if mode == "same" else pad + 1) for _ in range(dims))
    cls = nn.Conv1d if dims == 1 else nn.Conv2d
    layer = cls(c_in, c_out, kernel, stride=stride, padding=pad, dilation=dilation, groups=groups,
                bias=draw(st.booleans(), label="bias"), padding_mode="zeros" if mode == "same" else mode)
    return Case(layer, lambda n, g: {"x": _randn(g, n, c_in, *spatial)}, lambda m, b: m(b["x"]), spatial[0])


def embedding_case(draw) -> Case:
    """Every sample repeats a token (the ids Gram's off-diagonal); padding_idx tokens occur."""
    vocab, dim, t = draw(sizes(2, 6), label="vocab"), draw(sizes(1, 4)), draw(sizes(1, 6))
    padding_idx = draw(st.sampled_from([None, 0, vocab - 1]), label="padding_idx")
    lead = draw(st.sampled_from([(t,), (t, 2)]), label="id dims")

    def make(n, g):
        ids = torch.randint(0, vocab, (n, *lead), generator=g)
        if t > 1:
            ids[:, -1] = ids[:, 0]
        if padding_idx is not None:
            ids[0, 0] = padding_idx
        return {"ids": ids}

    return Case(nn.Embedding(vocab, dim, padding_idx=padding_idx), make, lambda m, b: m(b["ids"]), t)


def embedding_bag_case(draw) -> Case:
    """nn.EmbeddingBag, one bag per sample: [b, L] ids, or a flat input with offsets built
    from per-sample lengths (bags of 0..L ids); sum, mean or max; per-sample weights (sum)."""
    vocab, dim, length = draw(sizes(2, 6), label="vocab"), draw(sizes(1, 4)), draw(sizes(1, 5))
    mode = draw(st.sampled_from(["sum", "mean", "max"]), label="bag mode")
    flat = draw(st.booleans(), label="1-D input with offsets")
    weighted = mode == "sum" and draw(st.booleans(), label="per_sample_weights")
    padding_idx = draw(st.sampled_from([None, 0]), label="bag padding_idx")
    layer = nn.EmbeddingBag(vocab, dim, mode=mode, padding_idx=padding_idx)

    def make(n, g):
        ids = torch.randint(0, vocab, (n, length), generator=g)
        ids[:, -1] = ids[:, 0]                                   # a repeated id in every bag
        low = 1 if (mode == "max" or not flat) else 0            # max of an empty bag is undefined
        return {"ids": ids, "lengths": torch.randint(low, length + 1, (n,), generator=g),
                "weights": _randn(g, n, length)}

    def run(m, b):
        weights = b["weights"].to(m.weight.dtype) if weighted else None
        if not flat:
            return m(b["ids"], per_sample_weights=weights)
        keep = torch.arange(length).unsqueeze(0) < b["lengths"].unsqueeze(1)
        offsets = torch.cat([b["lengths"].new_zeros(1), b["lengths"].cumsum(0)[:-1]])
        return m(b["ids"][keep], offsets, per_sample_weights=None if weights is None else weights[keep])

    return Case(layer, make, run, length)


def norm_case(draw) -> Case:
    kind = draw(st.sampled_from(["LayerNorm", "RMSNorm", "GroupNorm", "InstanceNorm"]), label="norm")
    t = draw(sizes(1, 5))
    if kind in ("LayerNorm", "RMSNorm"):
        shape = tuple(draw(st.lists(sizes(1, 4), min_size=1, max_size=2), label="normalized_shape"))
        layer = (nn.LayerNorm(shape, bias=draw(st.booleans(), label="bias")) if kind == "LayerNorm"
                 else nn.RMSNorm(shape, eps=draw(st.sampled_from([None, 1e-5]), label="eps")))
        full = (t, *shape)
    elif kind == "GroupNorm":
        groups, per_group = draw(sizes(1, 3), label="num_groups"), draw(sizes(1, 2))
        spatial = draw(st.lists(sizes(1, 4), max_size=2), label="spatial")
        if per_group * math.prod(spatial) == 1:     # torch needs more than one value per group
            per_group = 2
        channels = groups * per_group
        layer = nn.GroupNorm(groups, channels)
        full, t = (channels, *spatial), channels
    else:
        dims = draw(sizes(1, 3), label="spatial dims")
        channels = draw(sizes(1, 3))
        spatial = [t] + [draw(sizes(1, 3)) for _ in range(dims - 1)]
        spatial[0] = max(spatial[0], 2)                 # torch needs more than one spatial element
        layer = (nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d)[dims - 1](channels, affine=True)
        full, t = (channels, *spatial), spatial[0]
    return Case(layer, lambda n, g: {"x": _randn(g, n, *full)}, lambda m, b: m(b["x"]), t)


def attention_case(draw) -> Case:
    """nn.MultiheadAttention: self-attention, shared key/value, separate k/v (kdim/vdim);
    key padding masks, causal / float / per-sample masks; need_weights; batch_first or not."""
    heads, head_dim = draw(sizes(1, 2), label="heads"), draw(sizes(1, 3), label="head dim")
    embed = heads * head_dim
    length = draw(sizes(1, 5), label="L")
    form = draw(st.sampled_from(["self", "shared kv", "separate kv"]), label="inputs")
    source = length if form == "self" else draw(sizes(1, 5), label="S")
    kdim = vdim = embed
    if form == "separate kv":
        kdim, vdim = draw(sizes(1, 4), label="kdim"), draw(sizes(1, 4), label="vdim")
    batch_first = draw(st.booleans(), label="batch_first")
    layer = nn.MultiheadAttention(embed, heads, bias=draw(st.booleans(), label="bias"), kdim=kdim,
                                  vdim=vdim, batch_first=batch_first)
    padded = draw(st.booleans(), label="key_padding_mask")
    mask_kind = draw(st.sampled_from(["none", "float", "per-sample"] + (["causal"] if form == "self" else [])),
                     label="attn_mask")
    need_weights = draw(st.booleans(), label="need_weights")
    average = draw(st.booleans(), label="average_attn_weights")
    causal = torch.ones(length, length, dtype=torch.bool).triu(1)
    shared_mask = torch.linspace(-1, 1, length * source, dtype=torch.float64).view(length, source)

    def make(n, g):
        out = {"q": _randn(g, n, length, embed), "k": _randn(g, n, source, kdim),
               "v": _randn(g, n, source, vdim)}
        if padded:   # a random half of the keys, never key 0 (a row with no key is NaN)
            pad = torch.rand(n, source, generator=g) < 0.5
            pad[:, 0] = False
            out["pad"] = pad
        if mask_kind == "per-sample":
            out["mask"] = _randn(g, n, heads, length, source)
        return out

    def run(m, b):
        dtype = b["q"].dtype
        mask = {"none": None, "causal": causal, "float": shared_mask.to(dtype)}.get(mask_kind)
        if mask_kind == "per-sample":                                  # [b·heads, L, S]
            mask = b["mask"].reshape(-1, length, source)
        q = b["q"]
        k = q if form == "self" else b["k"]
        v = k if form != "separate kv" else b["v"]
        if not batch_first:
            q, k, v = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
            if form == "self":
                k = v = q
            elif form == "shared kv":
                v = k
        pad = b.get("pad")
        if pad is not None and mask is not None and mask.is_floating_point():  # torch wants one mask type
            pad = torch.zeros(pad.shape, dtype=dtype).masked_fill(pad, float("-inf"))
        out, weights = m(q, k, v, key_padding_mask=pad, attn_mask=mask,
                         need_weights=need_weights, average_attn_weights=average)
        out = out if batch_first else out.transpose(0, 1)
        return out.flatten(1) if weights is None else torch.cat([out.flatten(1), weights.flatten(1)], 1)

    return Case(layer, make, run, length)


def fallback_case(draw) -> Case:
    """No rule: a custom module with its own nn.Parameters, or an nn.LSTM / nn.GRU."""
    kind = draw(st.sampled_from(["custom", "LSTM", "GRU"]), label="module")
    d, t = draw(sizes(1, 4)), draw(sizes(1, 5))
    if kind == "custom":
        layer = CustomLayer(d, draw(sizes(1, 4)))
        return Case(layer, lambda n, g: {"x": _randn(g, n, t, d)}, lambda m, b: m(b["x"]), t)
    batch_first = draw(st.booleans(), label="batch_first")
    layer = getattr(nn, kind)(d, draw(sizes(1, 3), label="hidden"), num_layers=draw(sizes(1, 2)),
                              bias=draw(st.booleans(), label="bias"), batch_first=batch_first,
                              bidirectional=draw(st.booleans(), label="bidirectional"))

    def run(m, b):
        x = b["x"] if batch_first else b["x"].transpose(0, 1)
        out, state = m(x)
        out = out if batch_first else out.transpose(0, 1)
        states = state if isinstance(state, tuple) else (state,)          # [layers·dirs, b, h]
        return torch.cat([out.flatten(1)] + [s.transpose(0, 1).flatten(1) for s in states], 1)

    return Case(layer, lambda n, g: {"x": _randn(g, n, t, d)}, run, t)


# ------------------------------------------------------------------ the tests

BUILDERS = {"linear": linear_case, "conv": conv_case, "embedding": embedding_case,
            "embedding_bag": embedding_bag_case,
            "norm": norm_case, "attention": attention_case, "fallback": fallback_case}
#: the registered module types each builder draws (test_every_registered_rule_is_drawn)
DRAWN_TYPES = {nn.Linear, HFConv1D, FalconLinear, nn.Conv1d, nn.Conv2d, nn.Embedding, nn.EmbeddingBag,
               nn.LayerNorm, nn.RMSNorm,
               nn.GroupNorm, nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d,
               nn.MultiheadAttention}


def _batch_kind(batch: int, length: int) -> str:
    named = {1: "b = 1", length: "b = T", length + 1: "b = T + 1"}
    return named.get(batch, "b generic")


def _property(builder, profile, slow=False):
    @profile
    @given(data=st.data())
    def test(data):
        case = builder(data.draw)
        run = _drawn_run(data.draw, case.length)
        for what in (type(case.layer).__name__, _batch_kind(run.batch, case.length), run.grouping,
                     run.method, str(run.dtype), f"{run.micro_batches} micro-batch(es)"):
            event(what)   # coverage, shown by pytest --hypothesis-show-statistics
        check_case(case, run)

    return pytest.mark.slow(test) if slow else test


test_linear_and_conv1d_rules_match_per_sample_loop = _property(linear_case, FAST)
test_conv_rule_matches_per_sample_loop = _property(conv_case, FAST)
test_embedding_rule_matches_per_sample_loop = _property(embedding_case, FAST)
test_embedding_bag_rule_matches_per_sample_loop = _property(embedding_bag_case, FAST)
test_norm_rules_match_per_sample_loop = _property(norm_case, FAST)
test_attention_rule_matches_per_sample_loop = _property(attention_case, FAST)
test_torch_func_fallback_matches_per_sample_loop = _property(fallback_case, FAST)

test_linear_and_conv1d_rules_thoroughly = _property(linear_case, THOROUGH, slow=True)
test_conv_rule_thoroughly = _property(conv_case, THOROUGH, slow=True)
test_embedding_rule_thoroughly = _property(embedding_case, THOROUGH, slow=True)
test_embedding_bag_rule_thoroughly = _property(embedding_bag_case, THOROUGH, slow=True)
test_norm_rules_thoroughly = _property(norm_case, THOROUGH, slow=True)
test_attention_rule_thoroughly = _property(attention_case, THOROUGH, slow=True)
test_torch_func_fallback_thoroughly = _property(fallback_case, THOROUGH, slow=True)


def test_every_registered_rule_is_drawn():
    assert set(registered_rules()) <= DRAWN_TYPES, set(registered_rules()) - DRAWN_TYPES


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_check_fails_for_a_rule_off_by_a_little(monkeypatch, dtype):
    """The property can fail: a Linear rule whose weight factor is 2·tolerance too large (1e-3
    in float32, 1e-8 in float64) is caught, in the norms and in the sums."""
    scale = 1 + (1e-3 if dtype == torch.float32 else 1e-8)
    uses = LinearRule.uses

    def scaled(self, m, x, gy, info):
        out = uses(self, m, x, gy, info)
        out["weight"] = Bilinear(out["weight"].left * scale, out["weight"].right)
        return out

    monkeypatch.setattr(LinearRule, "uses", scaled)
    case = Case(nn.Linear(3, 2), lambda n, g: {"x": _randn(g, n, 4, 3)}, lambda m, b: m(b["x"]), 4)
    with pytest.raises(AssertionError, match="off by"):
        check_case(case, Run(batch=4, micro_batches=2, grouping="param", method="ghost", dtype=dtype, seed=0))
