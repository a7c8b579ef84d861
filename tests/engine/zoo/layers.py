"""The PyTorch / Opacus layer zoo: one layer (or a layer and a small head) per case, read out
through :func:`~tests.engine.zoo.readout`. Batches keep the sample on dim 0; a case that
feeds its layer another layout (sequence-first, a flat 1-D bag input) builds it inside the
model's forward, as a user's model would."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from tests.engine.zoo import Case, floats, ids, readout, register, seeded

D = 6           # feature size of float inputs
VOCAB = 20


class Apply(nn.Module):
    """``fn(self.layer, **batch)``: a layer with the forward a user would write around it."""

    def __init__(self, layer: nn.Module, fn: Callable, **extra: nn.Module):
        super().__init__()
        self.layer = layer
        for name, module in extra.items():
            self.add_module(name, module)
        self.fn = fn

    def forward(self, **batch):
        return self.fn(self, **batch)


def read_loss(model, batch):
    return readout(model(**batch))


def layer(name, what, make_layer, fn, batch, tags=(), **extra):
    register(Case(name, "layer", what, seeded(lambda: Apply(make_layer(), fn, **{k: v() for k, v in extra.items()})),
                  batch, read_loss, tags))


def seq(B, T, g):
    return {"x": floats(g, B, T, D)}


def chan(B, T, g):              # [B, C, T]
    return {"x": floats(g, B, 4, T)}


def tokens(B, T, g):
    x = ids(B, T, g, VOCAB, low=0)
    x[0, 0] = 0                 # a padding token
    return {"x": x}


def call(m, x):
    return m.layer(x)


layer("linear-2d", "nn.Linear on [B, d] (T unused)", lambda: nn.Linear(D, 5), call, lambda B, T, g: {"x": floats(g, B, D)})
layer("linear-3d", "nn.Linear on [B, T, d]", lambda: nn.Linear(D, 5), call, seq)
layer("conv1d", "nn.Conv1d on [B, C, T] (stride 1, padding 1)", lambda: nn.Conv1d(4, 3, 3, padding=1), call, chan)
layer("conv2d", "nn.Conv2d on [B, C, T, 3] (stride 2, padding 1)", lambda: nn.Conv2d(3, 4, 3, stride=2, padding=1),
      call, lambda B, T, g: {"x": floats(g, B, 3, T, 3)})
layer("embedding", "nn.Embedding with padding_idx", lambda: nn.Embedding(VOCAB, D, padding_idx=0), call, tokens)
for mode in ("sum", "mean", "max"):
    layer(f"embeddingbag-{mode}-2d", f"nn.EmbeddingBag(mode={mode}) on [B, T] ids",
          lambda mode=mode: nn.EmbeddingBag(VOCAB, D, mode=mode), call, tokens)


def bag_batch(B, T, g):
    """Bags of different lengths, stored padded as [B, T] with their lengths."""
    return {"x": ids(B, T, g, VOCAB, low=0), "n": torch.tensor([T - i % 3 for i in range(B)]).clamp_min(1),
            "w": floats(g, B, T)}


def flat_bags(x, n):
    """1-D input and offsets, as a user feeds nn.EmbeddingBag: bag i is sample i."""
    flat = torch.cat([x[i, :int(n[i])] for i in range(x.shape[0])])
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), n.cumsum(0)[:-1]])
    return flat, offsets


def bag_offsets(m, x, n, w):
    flat, offsets = flat_bags(x, n)
    return m.layer(flat, offsets)


def bag_weighted(m, x, n, w):
    flat, offsets = flat_bags(x, n)
    weights = torch.cat([w[i, :int(n[i])] for i in range(x.shape[0])])
    return m.layer(flat, offsets, per_sample_weights=weights)


for mode in ("sum", "mean", "max"):
    layer(f"embeddingbag-{mode}-offsets", f"nn.EmbeddingBag(mode={mode}), 1-D input with offsets",
          lambda mode=mode: nn.EmbeddingBag(VOCAB, D, mode=mode), bag_offsets, bag_batch)
layer("embeddingbag-sum-weighted", "nn.EmbeddingBag(mode=sum), offsets and per_sample_weights",
      lambda: nn.EmbeddingBag(VOCAB, D, mode="sum"), bag_weighted, bag_batch)

layer("layernorm", "nn.LayerNorm on [B, T, d]", lambda: nn.LayerNorm(D), call, seq)
layer("groupnorm", "nn.GroupNorm(2, 4) on [B, 4, T]", lambda: nn.GroupNorm(2, 4), call, chan)
layer("rmsnorm", "nn.RMSNorm on [B, T, d]", lambda: nn.RMSNorm(D), call, seq)
layer("instancenorm", "nn.InstanceNorm1d(affine) on [B, 4, T]", lambda: nn.InstanceNorm1d(4, affine=True), call, chan)
layer("batchnorm", "nn.BatchNorm1d (must be refused: batch statistics mix samples)",
      lambda: nn.BatchNorm1d(4), call, chan, tags=("refuse",))


def mha(m, x):
    return m.layer(x, x, x, need_weights=False)[0]


def mha_seq_first(m, x):
    xt = x.transpose(0, 1)
    return m.layer(xt, xt, xt, need_weights=False)[0].transpose(0, 1)


def mha_padded(m, x, pad):
    return m.layer(x, x, x, key_padding_mask=pad, need_weights=False)[0]


def padded_seq(B, T, g):
    pad = torch.zeros(B, T, dtype=torch.bool)
    pad[1::2, T - 1] = True           # odd samples: their last key is padding
    return {"x": floats(g, B, T, D), "pad": pad}


layer("mha-batch-first", "nn.MultiheadAttention(batch_first=True), self-attention",
      lambda: nn.MultiheadAttention(D, 2, batch_first=True), mha, seq)
layer("mha-seq-first", "nn.MultiheadAttention(batch_first=False) on [T, B, d]",
      lambda: nn.MultiheadAttention(D, 2), mha_seq_first, seq)
layer("mha-key-padding", "nn.MultiheadAttention with key_padding_mask",
      lambda: nn.MultiheadAttention(D, 2, batch_first=True), mha_padded, padded_seq)
layer("encoder-layer-batch-first", "nn.TransformerEncoderLayer(batch_first=True)",
      lambda: nn.TransformerEncoderLayer(D, 2, 12, dropout=0.0, batch_first=True), call, seq)
layer("encoder-layer-seq-first", "nn.TransformerEncoderLayer(batch_first=False) on [T, B, d]",
      lambda: nn.TransformerEncoderLayer(D, 2, 12, dropout=0.0), lambda m, x: m.layer(x.transpose(0, 1)).transpose(0, 1),
      seq)


def rnn_out(m, x):
    return m.layer(x)[0]


for kind in ("LSTM", "GRU", "RNN"):
    layer(f"{kind.lower()}", f"nn.{kind}(batch_first=True)", lambda kind=kind: getattr(nn, kind)(D, 5, batch_first=True),
          rnn_out, seq)
layer("lstm-seq-first", "nn.LSTM(batch_first=False) on [T, B, d]", lambda: nn.LSTM(D, 5),
      lambda m, x: m.layer(x.transpose(0, 1))[0].transpose(0, 1), seq)


def cell_loop(m, x):
    """A cell stepped over time in Python, as in a hand-written RNN: the first step without
    a state (the cell starts from zeros), then each step from the last."""
    state, outs = None, []
    for t in range(x.shape[1]):
        state = m.layer(x[:, t]) if state is None else m.layer(x[:, t], state)
        outs.append(state[0] if isinstance(state, tuple) else state)
    return torch.stack(outs, 1)


def cell_loop_zeros(m, x):
    """The same loop from an explicit zero state built by the caller."""
    h = torch.zeros(x.shape[0], m.layer.hidden_size, dtype=x.dtype)
    state = (h, h.clone()) if isinstance(m.layer, nn.LSTMCell) else h
    outs = []
    for t in range(x.shape[1]):
        state = m.layer(x[:, t], state)
        outs.append(state[0] if isinstance(state, tuple) else state)
    return torch.stack(outs, 1)


for kind in ("LSTMCell", "GRUCell"):
    layer(f"{kind.lower()}-loop", f"nn.{kind} stepped in a Python loop, first step without a state",
          lambda kind=kind: getattr(nn, kind)(D, 5), cell_loop, seq)
    layer(f"{kind.lower()}-loop-zeros", f"nn.{kind} stepped in a Python loop from an explicit zero state",
          lambda kind=kind: getattr(nn, kind)(D, 5), cell_loop_zeros, seq)


def _opacus(cls):
    def make():
        from opacus import layers as ol
        return getattr(ol, cls)(D, 5, batch_first=True)
    return make


layer("opacus-dplstm", "opacus.layers.DPLSTM(batch_first=True)", _opacus("DPLSTM"), rnn_out, seq)
layer("opacus-dpgru", "opacus.layers.DPGRU(batch_first=True)", _opacus("DPGRU"), rnn_out, seq)


def _dp_mha():
    from opacus.layers import DPMultiheadAttention
    return DPMultiheadAttention(D, 2)


layer("opacus-dpmha", "opacus.layers.DPMultiheadAttention on [T, B, d] (its layout)", _dp_mha,
      lambda m, x: m.layer(x.transpose(0, 1), x.transpose(0, 1), x.transpose(0, 1))[0].transpose(0, 1), seq)


class Gate(nn.Module):
    """A module owning a bare nn.Parameter and no registered rule (torch.func fallback)."""

    def __init__(self, d: int = D):
        super().__init__()
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, d))

    def forward(self, x: Tensor) -> Tensor:
        return x * torch.sigmoid(self.scale) + self.scale.pow(2) * x.pow(2)


layer("custom-param", "a custom module with its own nn.Parameter (torch.func fallback)", Gate, call, seq)
