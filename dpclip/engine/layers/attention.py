"""``nn.MultiheadAttention``: its projections book-kept like Linear layers (docs/layer-rules.md).

torch's own forward reads ``out_proj.weight`` without calling ``out_proj`` and uses the
raw parameters ``in_proj_weight`` / ``in_proj_bias``, so the generic capture cannot see
them. This rule recomputes the module's forward, the same operations in the same order
as ``F.multi_head_attention_forward``:

    q, k, v = in-projection(query, key, value)      book-kept: Bilinear (grad, input)
    o = softmax(q kᵀ / sqrt(d_h) + mask) v           no parameters: plain autograd
    y = out_proj(o)                                 a call of the child: the Linear rule

In-projection of the packed ``in_proj_weight`` (3E x E): self-attention (``query is key
is value``, as in ``nn.TransformerEncoderLayer``) is one Linear of width 3E. Distinct
query / key / value inputs are separate calls of one parameter, each a Bilinear use
whose left factor (the output gradient) is zero outside its E rows: their sum is the
per-sample gradient ``[b_qᵀ q; b_kᵀ k; b_vᵀ v]``, so the uses concatenate exactly along T
(:mod:`dpclip.engine.factors`). With ``kdim``/``vdim`` ≠ E the three weights are separate
parameters (one use each); the bias is still packed.

Dropout inside attention draws from the global RNG through the same calls as torch
(``F.dropout`` on the weights when ``need_weights``, else ``scaled_dot_product_attention``),
so a seeded run gives torch's own output. Masks per sample, dropout per element: samples
stay apart, and the book-kept factors are those of the realised forward.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dpclip.engine.batch_axis import BATCH_HINT, expand_shared
from dpclip.engine.factors import Bilinear, Dense
from dpclip.engine.layers import (Capture, Example, LayerRule, example_tensor,
                                  register_layer_rule, seeded)
from dpclip.engine.precision import autocast_input, widened
from dpclip.errors import EngineError
from dpclip.torch_compat import canonical_attention_masks, qkv_packed

_SLOTS = {"q": 0, "k": 1, "v": 2}


class _InProjection:
    """One book-kept in-projection; ``info`` = (slots, weight name). ``slots`` are the
    E-row blocks of the packed weight/bias it produces ("qkv", "kv", "q", ...)."""

    @staticmethod
    def _weight_bias(m, info):
        slots, weight_name = info
        e = m.embed_dim
        rows = slice(_SLOTS[slots[0]] * e, (_SLOTS[slots[-1]] + 1) * e)
        weight = getattr(m, weight_name)
        if weight_name == "in_proj_weight":
            weight = weight[rows]
        bias = None if m.in_proj_bias is None else m.in_proj_bias[rows]
        return weight, bias, rows

    def forward(self, m, x, info):
        weight, bias, _ = self._weight_bias(m, info)
        return F.linear(x, weight, bias)

    def input_grad(self, m, x, gy, info):
        weight, _, _ = self._weight_bias(m, info)
        return gy @ weight.to(gy.dtype)

    def uses(self, m, x, gy, info):
        _, weight_name = info
        _, _, rows = self._weight_bias(m, info)
        b = gy.reshape(gy.shape[0], -1, gy.shape[-1])
        a = x.reshape(x.shape[0], -1, x.shape[-1])
        uses = {}
        if weight_name == "in_proj_weight" and rows.stop - rows.start < 3 * m.embed_dim:
            # The gradient's rows outside this call's block are zero.
            full = b.new_zeros(*b.shape[:2], 3 * m.embed_dim)
            full[..., rows] = b
            uses[weight_name] = Bilinear(full.unsqueeze(1), a.unsqueeze(1))
        else:
            uses[weight_name] = Bilinear(b.unsqueeze(1), a.unsqueeze(1))
        if m.in_proj_bias is not None:
            bias = widened(b).new_zeros(b.shape[0], 3 * m.embed_dim)
            bias[:, rows] = widened(b).sum(1)
            uses["in_proj_bias"] = Dense(bias)
        return uses


_IN_PROJECTION = _InProjection()


def _arguments(query, key, value, key_padding_mask=None, need_weights=True, attn_mask=None,
               average_attn_weights=True, is_causal=False):
    """nn.MultiheadAttention.forward's signature."""
    return (query, key, value, key_padding_mask, need_weights, attn_mask, average_attn_weights,
            is_causal)


@register_layer_rule(nn.MultiheadAttention)
class MultiheadAttentionRule(LayerRule):
    name = "multihead_attention"
    wrap_frozen = True   # out_proj must be called as a module even if in_proj is frozen

    def check(self, m: nn.Module, label: str) -> None:
        if m.bias_k is not None or m.add_zero_attn:
            raise EngineError(f"module {label} uses add_bias_kv or add_zero_attn, which the "
                              "MultiheadAttention rule does not book-keep",
                              "construct it with add_bias_kv=False, add_zero_attn=False")

    def _project(self, m, capture: Capture, inputs: list[tuple[str, Tensor]]) -> dict:
        """{slot: projected [B, T, E]} for (slots, batch-first input) pairs."""
        trainable = {name for name, _ in capture.params}
        out = {}
        for slots, x in inputs:
            weight_name = ("in_proj_weight" if qkv_packed(m)
                           else f"{slots}_proj_weight")
            names = [n for n in (weight_name, "in_proj_bias") if n in trainable]
            y = capture.op(_IN_PROJECTION, autocast_input(x), (slots, weight_name), names)
            for slot, part in zip(slots, y.chunk(len(slots), dim=-1)):
                out[slot] = part
        return out

    def call(self, m, capture: Capture, args: tuple, kwargs: dict):
        (query, key, value, key_padding_mask, need_weights, attn_mask, average_attn_weights,
         is_causal) = _arguments(*args, **kwargs)
        if query.dim() != 3:
            raise EngineError(f"module {capture.label} got an unbatched query",
                              "pass batched [B, T, E] inputs (batch_first=True)")
        # torch's own mask conversion (bool -> -inf), so that masks mean the same here
        key_padding_mask, attn_mask = canonical_attention_masks(key_padding_mask, attn_mask, query.dtype)

        axis = 0 if m.batch_first else 1
        layouts = {name: capture.layout_of(t) for name, t in
                   (("query", query), ("key", key), ("value", value))}
        if all(lay.dim is None for lay in layouts.values()):
            raise EngineError(f"module {capture.label} got a query, key and value shared by all "
                              "samples: its output has no batch", BATCH_HINT)

        def batch_first(t: Tensor, what: str) -> Tensor:
            # The batch axis the engine established must be the one batch_first names; a
            # tensor shared by all samples (a learned query [1, L, E]) is expanded over it.
            lay = layouts[what]
            if lay.dim is None and lay.error is None and t.dim() == 3 and t.shape[axis] == 1:
                t = t.movedim(axis, 0)
                t = expand_shared(t, True, capture.batch_size).movedim(0, axis)
            elif lay.error is not None or lay.merged or lay.dim != axis:
                if lay.error is not None:
                    where = lay.error
                elif lay.dim is None:
                    where = "nowhere: it is shared by all samples"
                else:
                    where = f"in axis {lay.dim}" + (" merged with positions" if lay.merged else "")
                raise EngineError(
                    f"module {capture.label} (batch_first={m.batch_first}) expects the batch in "
                    f"axis {axis} of its {what}, shape {tuple(t.shape)}; the engine found it "
                    f"{where}", "construct it with the batch_first its inputs use, or pass a "
                    "shared tensor with size 1 in the batch axis")
            return t if m.batch_first else t.transpose(0, 1)

        if query is key and key is value:
            proj = self._project(m, capture, [("qkv", batch_first(query, "query"))])
        elif key is value and qkv_packed(m):
            proj = self._project(m, capture, [("q", batch_first(query, "query")),
                                             ("kv", batch_first(key, "key"))])
        else:
            proj = self._project(m, capture, [("q", batch_first(query, "query")),
                                             ("k", batch_first(key, "key")),
                                             ("v", batch_first(value, "value"))])
        out, weights = _attention_core(m, proj["q"], proj["k"], proj["v"], key_padding_mask,
                                       attn_mask, need_weights, average_attn_weights, is_causal)
        with capture.children_batch_first():   # out_proj gets the batch-first [B, L, E]
            out = m.out_proj(out)     # a module call: book-kept by the Linear rule
        return (out if m.batch_first else out.transpose(0, 1)), weights

    def examples(self):
        def self_attention(module, x):
            return module(x, x, x, need_weights=False)[0]

        def masked_cross(module, x, memory, pad):
            return module(x, memory, memory, key_padding_mask=pad)[0]

        pad = torch.zeros(5, 4, dtype=torch.bool)
        pad[1, 2:] = True
        pad[3, 0] = True
        return [
            Example(seeded(nn.MultiheadAttention(4, 2, batch_first=True), 20),
                    (example_tensor(5, 3, 4, seed=20),), self_attention),
            Example(seeded(nn.MultiheadAttention(4, 2, batch_first=True, bias=False), 21),
                    (example_tensor(5, 3, 4, seed=21), example_tensor(5, 4, 4, seed=22), pad),
                    masked_cross),
            Example(seeded(nn.MultiheadAttention(4, 2, batch_first=True, kdim=3, vdim=2), 23),
                    (example_tensor(5, 3, 4, seed=23), example_tensor(5, 4, 3, seed=24),
                     example_tensor(5, 4, 2, seed=25)),
                    lambda module, q, k, v: module(q, k, v)[0]),
        ]


def _attention_core(m, q: Tensor, k: Tensor, v: Tensor, key_padding_mask, attn_mask,
                    need_weights: bool, average_attn_weights: bool, is_causal: bool):
    """softmax(q kᵀ/sqrt(d_h) + mask) v per head, batch first: [B, L, E] -> [B, L, E].

    Follows F.multi_head_attention_forward step by step (mask merging, the is_causal
    hint, the need_weights path) with [B, H, ...] in place of its [B·H, ...] layout."""
    batch, tgt_len, embed = q.shape
    src_len = k.shape[1]
    heads = m.num_heads
    head_dim = embed // heads
    if is_causal and attn_mask is None:
        raise RuntimeError("Need attn_mask if specifying the is_causal hint.")
    if is_causal and key_padding_mask is None and not need_weights:
        attn_mask = None
    elif key_padding_mask is not None:
        is_causal = False
    if attn_mask is not None and attn_mask.dim() == 2:
        attn_mask = attn_mask.unsqueeze(0)                         # [1, L, S]
    if key_padding_mask is not None:
        kpm = (key_padding_mask.view(batch, 1, 1, src_len).expand(-1, heads, -1, -1)
               .reshape(batch * heads, 1, src_len))
        attn_mask = kpm if attn_mask is None else attn_mask + kpm
    dropout_p = m.dropout if m.training else 0.0

    def heads_first(t: Tensor) -> Tensor:                           # [B, T, E] -> [B, H, T, d]
        return t.view(batch, t.shape[1], heads, head_dim).transpose(1, 2)

    q4, k4, v4 = heads_first(q), heads_first(k), heads_first(v)
    if need_weights:
        q3 = q4.reshape(batch * heads, tgt_len, head_dim) * math.sqrt(1.0 / float(head_dim))
        k3 = k4.reshape(batch * heads, src_len, head_dim)
        if attn_mask is not None:
            weights = torch.baddbmm(attn_mask, q3, k3.transpose(-2, -1))
        else:
            weights = torch.bmm(q3, k3.transpose(-2, -1))
        weights = F.softmax(weights, dim=-1)
        if dropout_p > 0.0:
            weights = F.dropout(weights, p=dropout_p)
        out = torch.bmm(weights, v4.reshape(batch * heads, src_len, head_dim))
        out = out.view(batch, heads, tgt_len, head_dim).transpose(1, 2).reshape(batch, tgt_len, embed)
        weights = weights.view(batch, heads, tgt_len, src_len)
        return out, (weights.mean(dim=1) if average_attn_weights else weights)
    if attn_mask is not None:
        if attn_mask.size(0) == 1 and attn_mask.dim() == 3:
            attn_mask = attn_mask.unsqueeze(0)
        else:
            attn_mask = attn_mask.view(batch, heads, -1, src_len)
    out = F.scaled_dot_product_attention(q4, k4, v4, attn_mask, dropout_p, is_causal)
    return out.transpose(1, 2).reshape(batch, tgt_len, embed), None
