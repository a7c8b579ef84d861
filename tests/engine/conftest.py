"""Shared helpers for the engine tests: tiny float64 models and a per-example reference.

The reference never touches the engine's math: it runs autograd on each example alone,
flattens that example's group gradients, and clips them with its own two-line clip
functions. The engine must match it to float64 round-off.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
import torch
import torch.nn.functional as F
from torch import nn

from dpclip.engine import DPEngine, build_groups, trainable_params
from dpclip.engine.factors import Dense

DTYPE = torch.float64


# ----------------------------------------------------------------- the reference


def ref_factor(fn: str, norm: float, c: float, gamma: float = 0.01) -> float:
    if fn == "auto":
        return c / (norm + gamma)
    return 1.0 if norm == 0 else min(1.0, c / norm)


@dataclass
class Reference:
    grads: dict[str, torch.Tensor]      # Σ_i clip(g_i) / B, by canonical parameter name
    norms: torch.Tensor                 # [n, K] per-sample group norms
    per_sample: list[dict[str, torch.Tensor]]


def per_example_grads(model: nn.Module, loss_fn, batch: dict) -> list[dict[str, torch.Tensor]]:
    """Autograd on each example alone (batch of one), by ``.backward()`` into ``p.grad`` (reentrant
    gradient checkpointing refuses ``torch.autograd.grad``); the model's ``.grad`` are put back."""
    infos = trainable_params(model)
    params = [i.param for i in infos]
    kept = [p.grad for p in params]
    n = next(iter(batch.values())).shape[0]
    out = []
    try:
        for i in range(n):
            for p in params:
                p.grad = None
            loss_fn(model, {k: v[i:i + 1] for k, v in batch.items()}).sum().backward()
            out.append({info.name: (torch.zeros_like(p) if p.grad is None else p.grad.clone())
                        for info, p in zip(infos, params)})
    finally:
        for p, g in zip(params, kept):
            p.grad = g
    return out


def group_norms(per_sample, groups) -> torch.Tensor:
    names = [[groups.params[i].name for i in m] for m in groups.members]
    return torch.tensor([[math.sqrt(sum(float(g[nm].pow(2).sum()) for nm in members))
                          for members in names] for g in per_sample], dtype=DTYPE)


def clip_reference(groups, per_sample, thresholds, fn, batch_size, gamma=0.01) -> Reference:
    """Σ_i clip(g_i)/B from per-example gradients, clipping each group on its own."""
    norms = group_norms(per_sample, groups)
    out = {info.name: torch.zeros_like(info.param) for info in groups.params}
    for i, g in enumerate(per_sample):
        for k, members in enumerate(groups.members):
            c = ref_factor(fn, float(norms[i, k]), float(thresholds[k]), gamma)
            for j in members:
                name = groups.params[j].name
                out[name] += c * g[name]
    return Reference({k: v / batch_size for k, v in out.items()}, norms, per_sample)


def per_sample_reference(uses, shape) -> torch.Tensor:
    """Σ_u G_{i,u} as ``[B, *shape]`` from a parameter's uses, by einsum and one-hot rows
    (never through dpclip.engine.factors): the reference the factor math must match."""
    out = None
    for u in uses:
        if isinstance(u, Dense):
            g = u.grad
        elif u.is_ids:
            onehot = F.one_hot(u.left, u.vocab).to(u.right.dtype)          # [B, T, V]
            g = torch.einsum("btv,btn->bvn", onehot, u.right[:, 0])
        else:
            g = torch.einsum("bgtm,bgtn->bgmn", u.left, u.right)
        g = g.reshape(g.shape[0], *shape)
        out = g if out is None else out + g
    assert out is not None
    return out


def run_engine(model, loss_fn, batch, clipping, batch_size, micro=None, **kw):
    """Feed ``batch`` to a fresh engine in micro-batches of ``micro`` sizes; privatize.

    ``engine.observed_norms`` collects the per-sample group norms [b, K] of every
    micro-batch, as the threshold policy sees them."""
    kw.setdefault("gradient_noise_multiplier", 0.0)
    engine = DPEngine(model, clipping, expected_batch_size=batch_size, **kw)
    engine.observed_norms = []
    observe = engine.policy.observe

    def spy(norms):
        engine.observed_norms.append(norms.detach().clone())
        return observe(norms)

    engine.policy.observe = spy
    n = next(iter(batch.values())).shape[0]
    sizes = micro or [n]
    start = 0
    for size in sizes:
        chunk = {k: v[start:start + size] for k, v in batch.items()}
        start += size
        engine.backward(loss_fn(model, chunk))
    assert start == n
    return engine, engine.privatize()


def check_exact(factory, loss_fn, batch, grouping="all-layer", fn="abadi", micro=None,
                batch_size=None, norm_method="auto", thresholds=None, strict=False):
    """Engine p.grad == per-example reference (noise 0). With abadi and median
    thresholds, every group with a nonzero gradient has clipped and unclipped samples."""
    model = factory()
    ref_model = copy.deepcopy(model)
    n = next(iter(batch.values())).shape[0]
    batch_size = batch_size or n + 2   # ≠ n: the engine must divide by the expected size
    groups = build_groups(ref_model, grouping)
    per = per_example_grads(ref_model, loss_fn, batch)
    if thresholds is None:
        thresholds = [float(v) or 1e-6 for v in group_norms(per, groups).median(dim=0).values]   # > 0
    ref = clip_reference(groups, per, thresholds, fn, batch_size)
    clipping = {"grouping": grouping, "fn": fn, "norm_method": norm_method, "strict": strict,
                "threshold": {"kind": "fixed", "value": thresholds}}
    engine, report = run_engine(model, loss_fn, batch, clipping, batch_size, micro)
    assert engine.group_names == groups.names
    for info in trainable_params(model):
        assert info.param.grad is not None, info.name
        torch.testing.assert_close(info.param.grad, ref.grads[info.name], rtol=1e-9, atol=1e-12,
                                   msg=lambda m: f"{info.name}: {m}")
    torch.testing.assert_close(report.norm_quantiles["max"].cpu(), ref.norms.max(dim=0).values.cpu())
    # every sample's group norms, not only their maximum
    torch.testing.assert_close(torch.cat(engine.observed_norms).cpu(), ref.norms.cpu(), rtol=1e-9, atol=1e-12)
    if fn == "abadi" and len(thresholds) == len(groups):
        c = torch.tensor(thresholds, dtype=DTYPE)
        live = ref.norms.max(dim=0).values > 0
        clipped = (ref.norms > c * (1 + 1e-9)).any(dim=0)
        unclipped = (ref.norms <= c * (1 + 1e-9)).any(dim=0)
        assert bool((clipped | ~live).all()) and bool((unclipped | ~live).all()), ref.norms
    engine.detach()
    return engine, report, ref


def example_model(example) -> tuple[list[str], type]:
    """(the batch's names x0, x1, ..., a model class running a copy of ``example``'s module on them)."""
    run = example.run or (lambda module, *xs: module(*xs))

    class Wrapped(nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = copy.deepcopy(example.module)

        def forward(self, *xs):
            return run(self.layer, *xs)
    return [f"x{j}" for j in range(len(example.inputs))], Wrapped


def check_example_exact(example, grouping="all-layer", norm_method="auto", strict=True):
    """A layer rule's :class:`~dpclip.engine.layers.Example` in a model of its own: its
    norms and clipped sums equal the per-example loop (check_exact). The loss reads every
    output entry through fixed random weights, so each parameter gets a gradient."""
    names, Wrapped = example_model(example)

    def loss_fn(model, batch):
        out = model(*[batch[n] for n in names]).flatten(1)
        g = torch.Generator().manual_seed(99)
        weights = torch.randn(out.shape[1], generator=g, dtype=out.dtype)
        return torch.tanh(out) @ weights + 0.1 * out.pow(2).sum(1)

    batch = dict(zip(names, example.inputs))
    return check_exact(Wrapped, loss_fn, batch, grouping, norm_method=norm_method, strict=strict)


# --------------------------------------------------------------------- models


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(),
                         nn.Linear(8, 3)).to(DTYPE)


def classify_loss(model, batch):
    return F.cross_entropy(model(batch["x"]), batch["y"], reduction="none")


def mlp_batch(n=5, d=6, classes=3, seed=1):
    g = torch.Generator().manual_seed(seed)
    return {"x": torch.randn(n, d, generator=g, dtype=DTYPE),
            "y": torch.randint(0, classes, (n,), generator=g)}


class CNN(nn.Module):
    """Conv2d with stride/padding, 'same'+circular padding, dilation+groups, GroupNorm,
    InstanceNorm, Conv1d with stride and groups, reflect padding; all book-kept."""

    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(3, 4, 3, stride=2, padding=1)
        self.gn = nn.GroupNorm(2, 4)
        self.c2 = nn.Conv2d(4, 6, 3, padding=2, dilation=2, groups=2)
        self.c3 = nn.Conv2d(6, 6, (2, 3), padding="same", padding_mode="circular", bias=False)
        self.inorm = nn.InstanceNorm2d(6, affine=True)
        self.c4 = nn.Conv1d(6, 4, 3, stride=2, padding=1, groups=2)
        self.c5 = nn.Conv1d(4, 4, 2, padding=1, padding_mode="reflect")
        self.head = nn.Linear(4, 3)

    def forward(self, x):
        h = torch.relu(self.gn(self.c1(x)))
        h = torch.tanh(self.inorm(self.c3(torch.tanh(self.c2(h)))))
        h = h.flatten(2)                       # [B, 6, 16]
        h = torch.tanh(self.c5(torch.tanh(self.c4(h))))
        return self.head(h.mean(-1))


def cnn() -> nn.Module:
    return CNN().to(DTYPE)


def cnn_batch(n=5, seed=2):
    g = torch.Generator().manual_seed(seed)
    return {"x": torch.randn(n, 3, 8, 8, generator=g, dtype=DTYPE),
            "y": torch.randint(0, 3, (n,), generator=g)}


def tiny_gpt2(n_layer=2, n_embd=32, vocab=50, positions=16) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel
    cfg = GPT2Config(n_layer=n_layer, n_embd=n_embd, n_head=2, vocab_size=vocab,
                     n_positions=positions, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                     bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(cfg).to(DTYPE)
    assert model.lm_head.weight is model.transformer.wte.weight
    return model


T_GPT = 6


def gpt2_loss(model, batch):
    ids = batch["ids"]
    position_ids = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0)      # (1, T): broadcast
    logits = model(input_ids=ids, position_ids=position_ids, use_cache=False).logits
    tok = F.cross_entropy(logits[:, :-1].transpose(1, 2), ids[:, 1:], reduction="none")
    return tok.mean(1)


def gpt2_batch(n=5, vocab=50, seed=3):
    g = torch.Generator().manual_seed(seed)
    return {"ids": torch.randint(0, vocab, (n, T_GPT), generator=g)}


def tiny_bert() -> nn.Module:
    from transformers import BertConfig, BertForSequenceClassification
    cfg = BertConfig(vocab_size=40, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=32, max_position_embeddings=16, type_vocab_size=2,
                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_labels=3)
    torch.manual_seed(0)
    return BertForSequenceClassification(cfg).to(DTYPE)


def bert_loss(model, batch):
    logits = model(input_ids=batch["ids"], token_type_ids=batch["tt"]).logits
    return F.cross_entropy(logits, batch["y"], reduction="none")


def bert_batch(n=5, seed=4):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 40, (n, 7), generator=g)
    tt = (torch.arange(7) >= 4).long().expand(n, 7).clone()
    return {"ids": ids, "tt": tt, "y": torch.randint(0, 3, (n,), generator=g)}


class ReusedLinear(nn.Module):
    """One Linear applied twice (its calls concatenate along T)."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(5, 6)
        self.shared = nn.Linear(6, 6)
        self.out = nn.Linear(6, 3)

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        h = torch.tanh(self.shared(h))
        h = torch.tanh(self.shared(h)) + h
        return self.out(h.mean(1) if h.dim() == 3 else h)


class LSTMNet(nn.Module):
    def __init__(self, batch_first=True):
        super().__init__()
        self.batch_first = batch_first
        self.emb = nn.Embedding(12, 4, padding_idx=0)
        self.lstm = nn.LSTM(4, 5, batch_first=batch_first)
        self.head = nn.Linear(5, 3)

    def forward(self, ids):
        h = self.emb(ids)
        if not self.batch_first:
            h = h.transpose(0, 1)
        out, _ = self.lstm(h)
        if not self.batch_first:
            out = out.transpose(0, 1)
        return self.head(out[:, -1])


def seq_batch(n=5, t=4, vocab=12, seed=5):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (n, t), generator=g)
    ids[0, 0] = 0          # a padding token
    return {"x": ids, "y": torch.randint(0, 3, (n,), generator=g)}


class Gate(nn.Module):
    """A custom module owning a bare nn.Parameter (no rule: torch.func fallback)."""

    def __init__(self, d):
        super().__init__()
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, d))

    def forward(self, x):
        return x * torch.sigmoid(self.scale) + self.scale.pow(2) * x.pow(2)


class TinyRMSNorm(nn.Module):
    """A transformers-style RMSNorm (class name ends with RMSNorm)."""

    def __init__(self, d, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(0.8, 1.2, d))
        self.eps = eps

    def forward(self, x):
        var = x.pow(2).mean(-1, keepdim=True)
        return self.weight * (x * torch.rsqrt(var + self.eps))


class CustomParamNet(nn.Module):
    """Custom parameters: one on a leaf (Gate) and one on a parent that also has children
    (``self.offset``, not owned by any leaf), plus every norm layer."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(5, 6)
        self.gate = Gate(6)
        self.ln = nn.LayerNorm(6)
        self.rms = nn.RMSNorm(6)
        self.tiny = TinyRMSNorm(6)
        self.offset = nn.Parameter(torch.linspace(-0.3, 0.3, 6))
        self.head = nn.Linear(6, 3)

    def forward(self, x):
        h = self.ln(self.gate(self.lin(x)))
        h = self.tiny(self.rms(torch.tanh(h))) + self.offset
        return self.head(h.mean(1))


def seq_float_batch(n=5, t=3, d=5, seed=6):
    g = torch.Generator().manual_seed(seed)
    return {"x": torch.randn(n, t, d, generator=g, dtype=DTYPE),
            "y": torch.randint(0, 3, (n,), generator=g)}


__all__ = [n for n in dir() if not n.startswith("_")]
