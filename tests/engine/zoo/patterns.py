"""The forward patterns issue 25 names, each in a tiny model of its own: tensors whose dim 0
is not the batch, tensors shared by every sample, in-place changes of a Linear's output,
one parameter reached under two names."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tests.engine.zoo import Case, floats, ids, readout, register, seeded, token_mean, upcast
from tests.engine.zoo.layers import Gate

D, V, P, R = 6, 20, 16, 3       # features, vocabulary, max positions, learned queries / relative rows


def seq(B, T, g):
    return {"x": floats(g, B, T, D)}


def lm(B, T, g):
    return {"x": ids(B, T, g, V)}


def read_loss(model, batch):
    return readout(model(**batch))


def next_token_loss(model, batch):
    x = batch["x"]
    logits = model(x=x)[:, :-1]
    return token_mean(F.cross_entropy(upcast(logits.transpose(1, 2)), x[:, 1:], reduction="none"))


def pattern(name, what, cls, batch=seq, loss=read_loss):
    register(Case(name, "pattern", what, seeded(cls), batch, loss))


class SeqFirstLinear(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, 5)

    def forward(self, x):                        # x [B, T, d] -> the Linear sees [T, B, d]
        return self.lin(x.transpose(0, 1)).transpose(0, 1)


class SeqFirstEmbedding(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, D)

    def forward(self, x):                        # ids [B, T] -> the Embedding sees [T, B]
        return self.emb(x.t()).transpose(0, 1)


class NanoGPTPositions(nn.Module):
    """tok_emb + wpe(torch.arange(T)) (a [T, d] lookup shared by every sample), as nanoGPT."""

    def __init__(self):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(V, D), nn.Embedding(P, D)
        self.head = nn.Linear(D, V)

    def forward(self, x):
        h = self.wte(x) + self.wpe(torch.arange(x.shape[1]))
        return self.head(torch.tanh(h))


class LinearOnSharedTable(nn.Module):
    """A Linear applied to a [T, d] table that no sample owns (a relative-position table)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("table", torch.randn(P, D))
        self.proj = nn.Linear(D, D)
        self.head = nn.Linear(D, 5)

    def forward(self, x):
        return self.head(torch.tanh(x + self.proj(self.table[: x.shape[1]])))


class LearnedQueryIndex0(nn.Module):
    """``lin(q)[0]`` on a learned [1, R, d] query, then attention of each sample's tokens."""

    def __init__(self):
        super().__init__()
        self.q = nn.Parameter(torch.randn(1, R, D))
        self.lin = nn.Linear(D, D)
        self.inp = nn.Linear(D, D)

    def forward(self, x):
        queries = self.lin(self.q)[0]            # [R, d]
        return torch.softmax(self.inp(x) @ queries.t(), -1)


class CustomOnSharedTable(nn.Module):
    """A custom module (torch.func fallback) fed a shared [T, d] tensor."""

    def __init__(self):
        super().__init__()
        self.register_buffer("table", torch.randn(P, D))
        self.gate = Gate(D)
        self.head = nn.Linear(D, 5)

    def forward(self, x):
        return self.head(torch.tanh(x + self.gate(self.table[: x.shape[1]])))


class InPlaceAdd(nn.Module):
    """``out = lin(x); out += y`` on [B, T, d] (a residual added in place)."""

    def __init__(self):
        super().__init__()
        self.lin, self.other = nn.Linear(D, D), nn.Linear(D, D)
        self.head = nn.Linear(D, 5)

    def forward(self, x):
        out = self.lin(x)
        out += self.other(x)
        return self.head(torch.tanh(out))


class ReluInPlace(nn.Module):
    """nn.ReLU(inplace=True) right after a Linear on [B, T, d]."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(D, 8), nn.ReLU(inplace=True), nn.Linear(8, 5))

    def forward(self, x):
        return self.net(x + 0.5)


class QueryProjRelative(nn.Module):
    """DeBERTa's ``query_proj(rel.unsqueeze(0))`` on a relative-embedding table, then
    ``.repeat(B, 1, 1)`` or ``.squeeze(0)``."""

    def __init__(self, how: str, frozen_table: bool = False):
        super().__init__()
        self.how = how
        self.rel = nn.Embedding(R, D)
        self.rel.weight.requires_grad_(not frozen_table)
        self.query_proj = nn.Linear(D, D)
        self.inp = nn.Linear(D, D)

    def forward(self, x):
        rel = self.query_proj(self.rel.weight.unsqueeze(0))             # [1, R, d]
        h = self.inp(x)                                                 # [B, T, d]
        if self.how == "repeat":
            scores = h @ rel.repeat(x.shape[0], 1, 1).transpose(1, 2)   # [B, T, R]
        else:
            scores = h @ rel.squeeze(0).t()
        return torch.softmax(scores, -1)


class SharedBiasHead(nn.Module):
    """BERT's MLM head: ``self.decoder.bias = self.bias`` (one tensor, two names, the parent's first)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.decoder = nn.Linear(D, V, bias=False)
        self.bias = nn.Parameter(0.1 * torch.randn(V))
        self.decoder.bias = self.bias

    def forward(self, x):
        return self.decoder(torch.tanh(self.emb(x)))


class TiedEmbeddingHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.mid = nn.Linear(D, D)
        self.head = nn.Linear(D, V, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x):
        return self.head(torch.tanh(self.mid(self.emb(x))))


pattern("seq-first-linear", "nn.Linear on a sequence-first [T, B, d] tensor", SeqFirstLinear)
pattern("seq-first-embedding", "nn.Embedding on sequence-first [T, B] ids", SeqFirstEmbedding, lm)
pattern("nanogpt-positions", "nanoGPT positions: wte(x) + wpe(torch.arange(T))", NanoGPTPositions, lm,
        next_token_loss)
pattern("linear-on-shared-table", "nn.Linear on a shared [T, d] table added to every sample", LinearOnSharedTable)
pattern("learned-query-index0", "lin(q)[0] on a learned [1, R, d] query", LearnedQueryIndex0)
pattern("custom-on-shared-table", "a custom module (torch.func fallback) fed a shared [T, d] tensor",
        CustomOnSharedTable)
pattern("inplace-add", "out = lin(x); out += y on [B, T, d]", InPlaceAdd)
pattern("relu-inplace", "nn.ReLU(inplace=True) after nn.Linear on [B, T, d]", ReluInPlace)
pattern("query-proj-repeat", "query_proj(rel.unsqueeze(0)).repeat(B, 1, 1)", lambda: QueryProjRelative("repeat"))
pattern("query-proj-repeat-frozen", "query_proj(rel.unsqueeze(0)).repeat(B, 1, 1), the table frozen",
        lambda: QueryProjRelative("repeat", frozen_table=True))
pattern("query-proj-squeeze", "query_proj(rel.unsqueeze(0)).squeeze(0)", lambda: QueryProjRelative("squeeze"))
pattern("shared-bias", "parent.bias is child.bias (BERT MLM head)", SharedBiasHead, lm, next_token_loss)
pattern("tied-embedding-head", "nn.Embedding tied to the output nn.Linear", TiedEmbeddingHead, lm, next_token_loss)
