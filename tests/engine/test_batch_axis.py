"""Which axis is the batch (dpclip/engine/batch_axis.py): established by probing, never by a size.

Every pattern runs at B != T, B == T, B == T + 1 and B == 1 against the float64 per-example
loop (tests/engine/conftest.py): exact, or refused with an EngineError that names the
module's path and class, raised in the forward (before any noise).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from dpclip.engine import DPEngine
from dpclip.errors import EngineError
from tests.engine.conftest import DTYPE, Gate, check_exact, classify_loss

T = 4
SIZES = [2, T, T + 1, 1]          # B != T, B == T, B == T + 1, B == 1
VOCAB = 11


def _ids(n, t=T, seed=0, vocab=VOCAB):
    g = torch.Generator().manual_seed(seed)
    return {"x": torch.randint(0, vocab, (n, t), generator=g), "y": torch.randint(0, 3, (n,), generator=g)}


def _floats(n, t=T, d=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"x": torch.randn(n, t, d, generator=g, dtype=DTYPE), "y": torch.randint(0, 3, (n,), generator=g)}


def exact(factory, batch, loss=classify_loss, **kw):
    """check_exact; with one sample the median threshold cannot clip on both sides: AUTO."""
    n = next(iter(batch.values())).shape[0]
    return check_exact(factory, loss, batch, fn="abadi" if n > 1 else "auto", **kw)


def refused(factory, batch, match, loss=classify_loss):
    """The engine refuses in the forward, naming the module; nothing reached backward."""
    model = factory()
    engine = DPEngine(model, {}, expected_batch_size=8, gradient_noise_multiplier=1.0)
    with pytest.raises(EngineError, match=match) as err:
        loss(model, batch)
    assert err.value.hint
    assert all(p.grad is None for p in model.parameters())
    engine.detach()
    return err.value


# ------------------------------------------------------------------ models


class SeqFirst(nn.Module):
    """nn.Embedding and nn.Linear on sequence-first [T, B, ...] tensors."""

    def __init__(self, d=4, p=3):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(VOCAB, d)
        self.lin = nn.Linear(d, p)
        self.head = nn.Linear(p, 3)

    def forward(self, ids):                          # [B, T]
        h = torch.tanh(self.lin(self.emb(ids.t())))  # [T, B, p]
        return self.head(h.mean(0))


class SeqFirstEncoder(nn.Module):
    """nn.TransformerEncoderLayer(batch_first=False): MultiheadAttention, Linear, LayerNorm on [T, B, d]."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(3, 8)
        self.enc = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=False)
        self.head = nn.Linear(8, 3)

    def forward(self, x):                           # [B, T, 3]
        h = self.enc(self.inp(x).transpose(0, 1))   # [T, B, 8]
        return self.head(h.mean(0))


class OpacusAttention(nn.Module):
    """opacus DPMultiheadAttention (Linear layers on [T, B, E])."""

    def __init__(self):
        super().__init__()
        from opacus.layers import DPMultiheadAttention
        torch.manual_seed(0)
        self.inp = nn.Linear(3, 8)
        self.attn = DPMultiheadAttention(8, 2)
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        q = torch.tanh(self.inp(x)).transpose(0, 1)
        out, _ = self.attn(q, q, q)
        return self.head(out.mean(0))


class NanoPositions(nn.Module):
    """nanoGPT: wpe(arange(T)) is [T, d], shared by all samples and broadcast over the batch."""

    def __init__(self, d=4):
        super().__init__()
        torch.manual_seed(0)
        self.wte = nn.Embedding(VOCAB, d)
        self.wpe = nn.Embedding(8, d)
        self.head = nn.Linear(d, 3)

    def forward(self, ids):
        pos = self.wpe(torch.arange(ids.shape[1]))
        return self.head(torch.tanh(self.wte(ids) + pos).mean(1))


class ExpandedAsPositions(NanoPositions):
    """XLM: ``wpe(position_ids[:, :T]).expand_as(tokens)``, the [1, T, d] positions expanded to the
    tokens' [B, T, d] by ``expand_as`` (``expand`` to another tensor's shape)."""

    def forward(self, ids):
        tok = self.wte(ids)
        pos = self.wpe(torch.arange(ids.shape[1])[None]).expand_as(tok)
        return self.head(torch.tanh(tok + pos).mean(1))


class SharedTable(nn.Module):
    """A Linear on a shared [T, d] table (a buffer), its output added to every sample."""

    def __init__(self, d=3):
        super().__init__()
        torch.manual_seed(0)
        self.register_buffer("table", torch.randn(8, d))
        self.lin = nn.Linear(d, d)
        self.head = nn.Linear(d, 3)

    def forward(self, x):
        pos = self.lin(self.table[:x.shape[1]])      # [T, d]
        return self.head(torch.tanh(x + pos).mean(1))


class SharedFallback(nn.Module):
    """A module without a rule (torch.func fallback) fed a shared [T, d] tensor."""

    def __init__(self, d=3):
        super().__init__()
        torch.manual_seed(0)
        self.register_buffer("table", torch.randn(8, d))
        self.gate = Gate(d)
        self.head = nn.Linear(d, 3)

    def forward(self, x):
        pos = self.gate(self.table[:x.shape[1]])
        return self.head(torch.tanh(x + pos).mean(1))


class Mix(nn.Module):
    """No rule: one per-sample input and one shared input."""

    def __init__(self, d):
        super().__init__()
        self.w = nn.Parameter(torch.linspace(0.5, 1.5, d))

    def forward(self, x, table):
        return x * self.w + table * self.w.pow(2)


class MixedFallback(nn.Module):
    def __init__(self, d=3):
        super().__init__()
        torch.manual_seed(0)
        self.register_buffer("table", torch.randn(8, d))
        self.mix = Mix(d)
        self.head = nn.Linear(d, 3)

    def forward(self, x):
        return self.head(torch.tanh(self.mix(x, self.table[:x.shape[1]])).mean(1))


class PickedQuery(nn.Module):
    """``lin(q)[0]`` on a [1, R, d] query: [0] picks the query, not a sample. With the query
    learned by another layer (``query``), that layer's shared output feeds ``lin``."""

    def __init__(self, d=3, r=2, learned=False):
        super().__init__()
        torch.manual_seed(0)
        if learned == "root":
            self.q = nn.Parameter(torch.randn(1, r, d))     # on the model itself (fallback)
        elif learned:
            self.query = nn.Linear(1, r * d, bias=False)   # q = query(1): a learned [1, R, d]
        else:
            self.register_buffer("q", torch.randn(1, r, d))
        self.r, self.d, self.learned = r, d, learned
        self.lin = nn.Linear(d, d)
        self.head = nn.Linear(r, 3)

    def forward(self, x):                          # [B, T, d]
        q = (self.query(x.new_ones(1, 1)).view(1, self.r, self.d) if self.learned is True else self.q)
        q0 = self.lin(q)[0]                        # [R, d]
        return self.head(torch.tanh(x @ q0.t()).mean(1))


class OpacusRNN(nn.Module):
    def __init__(self, kind="LSTM", layers=1, batch_first=True):
        super().__init__()
        from opacus.layers import DPGRU, DPLSTM
        torch.manual_seed(0)
        cls = DPLSTM if kind == "LSTM" else DPGRU
        self.rnn = cls(3, 5, num_layers=layers, batch_first=batch_first)
        self.batch_first = batch_first
        self.head = nn.Linear(5, 3)

    def forward(self, x):
        out, _ = self.rnn(x if self.batch_first else x.transpose(0, 1))
        return self.head(out[:, -1] if self.batch_first else out[-1])


def _layouts(engine) -> dict:
    """The established layouts by "module label #call"."""
    label = {id(u): u.label for u in engine._keeper.units}
    return {f"{label[unit]} #{n}": lay for (unit, n), lay in engine._keeper.axes.layouts.items()}


def _double(cls, *args, **kw):
    return lambda: cls(*args, **kw).to(DTYPE)


# ------------------------------------------------------------ exact patterns


@pytest.mark.parametrize("n", SIZES)
def test_sequence_first_embedding_and_linear_are_exact(n):
    engine, _, _ = exact(_double(SeqFirst), _ids(n))
    axis = {label: lay.inputs[0].dim for label, lay in _layouts(engine).items()}
    assert axis["emb (Embedding) #0"] == 1 and axis["lin (Linear) #0"] == 1   # [T, B, ...]
    assert axis["head (Linear) #0"] == 0


@pytest.mark.parametrize("n", SIZES)
def test_transformer_encoder_layer_sequence_first_is_exact(n):
    exact(_double(SeqFirstEncoder), _floats(n), strict=True)


@pytest.mark.parametrize("n", SIZES)
def test_opacus_multihead_attention_is_exact(n):
    pytest.importorskip("opacus")
    exact(_double(OpacusAttention), _floats(n), strict=True)


@pytest.mark.parametrize("n", SIZES)
def test_nanogpt_positions_broadcast_over_the_batch_are_exact(n):
    exact(_double(NanoPositions), _ids(n), strict=True)


@pytest.mark.parametrize("n", SIZES)
def test_positions_expanded_as_the_tokens_are_exact(n):
    exact(_double(ExpandedAsPositions), _ids(n), strict=True)


@pytest.mark.parametrize("n", SIZES)
def test_linear_on_a_shared_table_is_exact(n):
    exact(_double(SharedTable), _floats(n), strict=True)


@pytest.mark.parametrize("n", SIZES)
def test_fallback_module_on_a_shared_tensor_is_exact(n):
    exact(_double(SharedFallback), _floats(n))


@pytest.mark.parametrize("n", SIZES)
def test_fallback_module_with_a_per_sample_and_a_shared_input_is_exact(n):
    exact(_double(MixedFallback), _floats(n))


class TorchRNN(nn.Module):
    """nn.LSTM / nn.GRU (torch.func fallback) with per-sample initial states [layers, B, H]
    and the final states [layers, B, H] read by the head: the batch is axis 1 there."""

    def __init__(self, kind="LSTM", layers=1, batch_first=True):
        super().__init__()
        torch.manual_seed(0)
        self.rnn = (nn.LSTM if kind == "LSTM" else nn.GRU)(3, 5, num_layers=layers,
                                                           batch_first=batch_first)
        self.init = nn.Linear(3, 5 * layers)
        self.head = nn.Linear(5, 3)
        self.kind, self.layers, self.batch_first = kind, layers, batch_first

    def forward(self, x):                                       # [B, T, 3]
        h0 = torch.tanh(self.init(x[:, 0])).view(x.shape[0], self.layers, 5).transpose(0, 1)
        state = (h0, torch.zeros_like(h0)) if self.kind == "LSTM" else h0
        out, last = self.rnn(x if self.batch_first else x.transpose(0, 1), state)
        h_n = last[0] if self.kind == "LSTM" else last
        final = out[:, -1] if self.batch_first else out[-1]
        return self.head(final + h_n[-1])


@pytest.mark.parametrize("kind", ["LSTM", "GRU"])
@pytest.mark.parametrize("layers", [1, 2])
@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("n", SIZES)
def test_rnn_hidden_states_have_the_batch_in_axis_1(kind, layers, batch_first, n):
    exact(_double(TorchRNN, kind, layers, batch_first), _floats(n))


@pytest.mark.parametrize("kind", ["LSTM", "GRU"])
@pytest.mark.parametrize("layers", [1, 2])
@pytest.mark.parametrize("n", SIZES)
def test_opacus_dplstm_and_dpgru_are_exact(kind, layers, n):
    pytest.importorskip("opacus")
    exact(_double(OpacusRNN, kind, layers), _floats(n))


@pytest.mark.parametrize("n", [1, T])
def test_opacus_rnn_sequence_first_is_exact(n):
    pytest.importorskip("opacus")
    exact(_double(OpacusRNN, "LSTM", 2, batch_first=False), _floats(n))


# ---------------------------------------------------------------- refusals


class ExpandedQuery(nn.Module):
    """A learned query [1, R, d] (a module without a rule) expanded to the batch."""

    def __init__(self, d=3, r=2):
        super().__init__()
        torch.manual_seed(0)
        self.query = Query(r, d)
        self.attn = nn.MultiheadAttention(d, 1, batch_first=True)
        self.head = nn.Linear(d, 3)

    def forward(self, x):
        q = self.query().expand(x.shape[0], -1, -1)
        return self.head(self.attn(q, x, x, need_weights=False)[0].mean(1))


class Query(nn.Module):
    def __init__(self, r, d):
        super().__init__()
        self.q = nn.Parameter(torch.randn(1, r, d))

    def forward(self):
        return torch.tanh(self.q)


@pytest.mark.parametrize("learned", [False, "root"])
@pytest.mark.parametrize("n", SIZES)
def test_indexing_the_output_of_a_shared_query_is_exact(n, learned):
    # lin(q) is shared; [0] and .t() keep it shared; x @ q0.t() broadcasts it over the batch.
    # A query learned on the model itself makes the model a torch.func unit (q's gradients).
    exact(lambda: PickedQuery(learned=learned).to(DTYPE), _floats(n), strict=not learned)


@pytest.mark.parametrize("n", SIZES)
def test_a_shared_output_fed_to_another_layer_is_refused(n):
    err = refused(lambda: PickedQuery(learned=True).to(DTYPE), _floats(n),
                  r"module query \(Linear\) is fed a tensor shared by all samples")
    assert "input of another layer (lin (Linear))" in str(err)


@pytest.mark.parametrize("n", SIZES)
def test_a_learned_query_expanded_to_the_batch_is_exact(n):
    exact(lambda: ExpandedQuery().to(DTYPE), _floats(n))


class RepeatedPrompt(nn.Module):
    """peft's prompt tuning: an Embedding of the shared prompt ids [1, P], its output tiled over
    the batch by ``repeat(B, 1, 1)`` (equal to an expand) and put before each sample's tokens;
    ``tile_axis_above_one`` repeats [P, d] to [B·P, d] instead (the batch merged with P rows)."""

    def __init__(self, d=3, prompt=2, tile_axis_above_one=False):
        super().__init__()
        torch.manual_seed(0)
        self.prompt, self.tile = nn.Embedding(prompt, d), tile_axis_above_one
        self.mix, self.head = nn.Linear(d, d), nn.Linear(d, 3)

    def forward(self, x):
        ids = torch.arange(self.prompt.num_embeddings)[None]
        p = self.prompt(ids)                                               # [1, P, d]
        p = p[0].repeat(len(x), 1).view(len(x), -1, x.shape[-1]) if self.tile else p.repeat(len(x), 1, 1)
        return self.head(torch.tanh(self.mix(torch.cat([p, x], 1))).mean(1))


@pytest.mark.parametrize("n", SIZES)
def test_a_shared_prompt_repeated_over_the_batch_is_exact(n):
    exact(lambda: RepeatedPrompt().to(DTYPE), _floats(n))


@pytest.mark.parametrize("n", SIZES)
def test_a_shared_prompt_tiled_over_its_rows_is_exact(n):
    """[P, d] repeated to [B·P, d]: batch-outer rows, sample i's are i·P ... i·P + P - 1."""
    exact(lambda: RepeatedPrompt(tile_axis_above_one=True).to(DTYPE), _floats(n))


class BiasTable(nn.Module):
    """A learned [1, T, T] bias, called without inputs (BEiT's shared relative position bias)."""

    def __init__(self, t=T):
        super().__init__()
        self.table = nn.Parameter(torch.randn(1, t, t))

    def forward(self):
        return torch.tanh(self.table)


class BiasedMixer(nn.Module):
    """A layer of its own parameter that takes the shared bias as an argument."""

    def __init__(self, d=3):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(()))
        self.proj = nn.Linear(d, d)

    def forward(self, x, bias):
        scores = self.scale * x @ x.transpose(1, 2) + bias
        return x + self.proj(torch.softmax(scores, -1) @ x)


class SharedBiasLayers(nn.Module):
    def __init__(self, d=3):
        super().__init__()
        torch.manual_seed(0)
        self.bias, self.layers, self.head = BiasTable(), nn.ModuleList([BiasedMixer(d), BiasedMixer(d)]), nn.Linear(d, 3)

    def forward(self, x):
        bias = self.bias()                      # one table for every layer
        for layer in self.layers:
            x = layer(x, bias)
        return self.head(x.mean(1))


@pytest.mark.parametrize("n", SIZES)
def test_a_shared_table_passed_to_every_layer_is_exact(n):
    exact(lambda: SharedBiasLayers().to(DTYPE), _floats(n))


class WindowedAttention(nn.Module):
    """Swin's pattern: each sample's tokens cut into W windows, attention over [B·W, N, d] rows
    (batch outer), a learned bias table of its own module added to every window's scores."""

    def __init__(self, d=3, windows=2, sdpa=False):
        super().__init__()
        torch.manual_seed(0)
        self.windows, self.sdpa = windows, sdpa
        self.bias, self.qkv, self.head = BiasTable(T // windows), nn.Linear(d, 3 * d), nn.Linear(d, 3)

    def forward(self, x):                                            # [B, T, d]
        rows = x.reshape(len(x) * self.windows, T // self.windows, x.shape[-1])   # [B·W, N, d]
        q, k, v = self.qkv(rows).chunk(3, -1)
        bias = self.bias()                                           # [1, N, N], shared
        if self.sdpa:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        else:
            out = torch.softmax(q @ k.transpose(1, 2) + bias, -1) @ v
        return self.head(out.reshape(x.shape).mean(1))


@pytest.mark.parametrize("sdpa", [False, True])
@pytest.mark.parametrize("n", SIZES)
def test_a_shared_table_over_windows_merged_with_the_batch_is_exact(n, sdpa):
    exact(lambda: WindowedAttention(sdpa=sdpa).to(DTYPE), _floats(n))


def test_windows_read_batch_inner_by_mistake_are_refused_by_the_certificate(monkeypatch):
    """Sabotage: the table's B·W rows summed per sample as [W, B] (window-major) instead of
    [B, W]: sample i then gets other samples' windows' gradients, which only the check of each
    clip against the sample's own gradient can tell."""
    from dpclip.engine.layers import functorch
    real = functorch.per_sample_grads

    def inner(capture, args, kwargs, out_index, grads, batch, autocast=None, in_dims=None, out_dims=None, draws=None):
        if out_dims is not None and any(a.folded is not None for a in out_dims):
            grads = tuple(g.unflatten(a.dim, (a.rows, batch)).transpose(a.dim, a.dim + 1).flatten(a.dim, a.dim + 1)
                          if a.folded is not None else g for g, a in zip(grads, out_dims))
        return real(capture, args, kwargs, out_index, grads, batch, autocast, in_dims, out_dims, draws)
    monkeypatch.setattr(functorch, "per_sample_grads", inner)
    model = WindowedAttention().to(DTYPE)
    batch = _floats(6)
    batch["x"][0] *= 20
    engine = DPEngine(model, {"grouping": "layer", "threshold": {"kind": "fixed", "value": 0.1}},
                      gradient_noise_multiplier=0.0, expected_batch_size=6)
    with pytest.raises(EngineError, match="certificate refused|mixes samples"):
        engine.backward(classify_loss(model, batch))


class DetachedNorm(nn.Module):
    """DoRA's pattern: ``up(down(eye))`` of a shared identity, used only detached (a weight norm
    that gets no gradient); ``live`` also adds it to the output, a use with a gradient."""

    def __init__(self, d=3, live=False):
        super().__init__()
        torch.manual_seed(0)
        self.live = live
        self.down, self.up, self.head = nn.Linear(d, 2, bias=False), nn.Linear(2, d, bias=False), nn.Linear(d, 3)

    def forward(self, x):
        delta = self.up(self.down(torch.eye(x.shape[-1], dtype=x.dtype))).T
        norm = (torch.eye(x.shape[-1], dtype=x.dtype) + delta.detach()).norm(dim=1)
        h = x + self.up(self.down(x))
        h = h / norm + (delta.sum(0) if self.live else 0)
        return self.head(h.mean(1))


@pytest.mark.parametrize("n", SIZES)
def test_layers_on_a_shared_tensor_whose_output_is_only_detached_are_exact(n):
    exact(lambda: DetachedNorm().to(DTYPE), _floats(n))


def test_a_detached_end_reached_as_well_as_a_live_use_is_not_taken_for_dead():
    refused(lambda: DetachedNorm(live=True).to(DTYPE), _floats(4), "fed a tensor shared by all samples")


def test_a_call_wrongly_taken_for_dead_is_refused_as_a_stray_gradient(monkeypatch):
    """Sabotage: every shared call declared dead, the live one too: its parameters then receive
    an autograd gradient outside the engine's hooks, which the engine refuses before any noise."""
    from dpclip.engine.batch_axis import state
    monkeypatch.setattr(state, "dead_ends", lambda checks, verdicts: set(verdicts))
    model = DetachedNorm(live=True).to(DTYPE)
    batch = _floats(4)
    engine = DPEngine(model, {}, expected_batch_size=4, gradient_noise_multiplier=1.0)
    with pytest.raises(EngineError, match="outside the engine's hooks"):
        engine.backward(classify_loss(model, batch))


def test_a_layer_input_whose_batch_cannot_be_moved_is_refused():
    class BatchAlongLength(nn.Module):   # Conv1d gets [L, C, B]: its rule needs the batch first
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv1d(4, 2, 1)

        def forward(self, x):                # [B, C, L]
            return self.conv(x.permute(2, 1, 0)).mean((0, 1))[:, None].expand(-1, 3)

    refused(lambda: BatchAlongLength().to(DTYPE), {"x": torch.randn(3, 4, 5, dtype=DTYPE),
                                                   "y": torch.zeros(3, dtype=torch.long)},
            r"module conv \(Conv1d\) gets the batch in axis 2")


def test_sequence_first_model_inputs_are_refused_with_a_hint_to_pass_them_batch_first():
    class SequenceFirst(nn.Module):      # x: [T, B, d]; the engine reads dim 0 as the batch
        def __init__(self):
            super().__init__()
            self.r, self.h = nn.Linear(4, 5), nn.Linear(5, 3)

        def forward(self, x):
            return self.h(torch.tanh(self.r(x)).mean(0))

    err = refused(lambda: SequenceFirst().to(DTYPE), {"x": torch.randn(6, 3, 4, dtype=DTYPE),
                                                      "y": torch.zeros(3, dtype=torch.long)},
                  r"module h \(Linear\) is fed a tensor shared by all samples")
    assert "batch in dim 0 of its first tensor input" in err.hint and "[T, B" in err.hint


class PackedPatches(nn.Module):
    """A vision-language model's layout: ``patches`` packs every sample's K patch rows into one
    [B·K, d] tensor (Qwen2-VL's pixel_values), reshaped by the sample count of ``x``."""

    K = 3

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.proj, self.head = nn.Linear(4, 5), nn.Linear(5, 3)

    def forward(self, x, patches):
        img = torch.tanh(self.proj(patches)).reshape(x.shape[0], self.K, -1)
        return self.head(img.mean(1) + x)


class BatchFirstPatches(PackedPatches):
    """The same model given its patches batch-first, [B, K, d], flattened inside the forward."""

    def forward(self, x, patches):
        return super().forward(x, patches.flatten(0, 1))


def _patches_batch(n):
    g = torch.Generator().manual_seed(0)
    return {"x": torch.randn(n, 5, generator=g, dtype=DTYPE), "patches": torch.randn(n, 3, 4, generator=g, dtype=DTYPE),
            "y": torch.randint(0, 3, (n,), generator=g)}


def _packed_loss(model, batch):
    return F.cross_entropy(model(batch["x"], batch["patches"].flatten(0, 1)), batch["y"], reduction="none")


def _patches_loss(model, batch):
    return F.cross_entropy(model(batch["x"], batch["patches"]), batch["y"], reduction="none")


def test_an_input_packing_the_samples_rows_is_refused_naming_it_with_the_batch_first_way():
    err = refused(_double(PackedPatches), _patches_batch(4), "fails when the engine probes it", loss=_packed_loss)
    assert "input 1 (12, 4)" in str(err) and "batch-first" in err.hint and "flattened inside the forward" in err.hint


@pytest.mark.parametrize("n", [4, 1])
def test_an_input_given_batch_first_and_flattened_inside_the_forward_is_exact(n):
    exact(_double(BatchFirstPatches), _patches_batch(n), loss=_patches_loss)


def test_a_model_mixing_samples_is_refused():
    class Mixer(nn.Module):   # a [B, B] matrix across samples feeds a Linear
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 3)

        def forward(self, x):
            sim = x.flatten(1) @ x.flatten(1).t()          # [B, B]
            return self.lin(sim[:, :1].expand(-1, 3) * 0 + x.mean(1)) + self.lin(
                torch.tanh(sim).unsqueeze(-1).expand(-1, -1, 3)).mean(1)

    refused(lambda: Mixer().to(DTYPE), _floats(3), r"module lin \(Linear\).*mixes samples")


# ------------------------------------------------------------- transformers


def _tiny(config_cls, model_cls, attention="eager", **kw):
    transformers = pytest.importorskip("transformers")
    config = getattr(transformers, config_cls)(**kw)
    config._attn_implementation = attention

    def factory():
        torch.manual_seed(0)
        return getattr(transformers, model_cls)(config).to(DTYPE)

    return factory


def _lm_loss(model, batch):
    ids = batch["x"]
    logits = model(input_ids=ids, use_cache=False).logits
    return F.cross_entropy(logits[:, :-1].transpose(1, 2), ids[:, 1:], reduction="none").mean(1)


def _seq2seq_loss(model, batch):
    ids = batch["x"]
    logits = model(input_ids=ids, decoder_input_ids=ids, use_cache=False).logits
    return F.cross_entropy(logits[:, :-1].transpose(1, 2), ids[:, 1:], reduction="none").mean(1)


OPT = dict(vocab_size=VOCAB, hidden_size=8, num_hidden_layers=1, ffn_dim=16, num_attention_heads=2,
           max_position_embeddings=16, word_embed_proj_dim=8, dropout=0.0, attention_dropout=0.0,
           activation_dropout=0.0, layerdrop=0.0, pad_token_id=1, bos_token_id=0, eos_token_id=2)
BART = dict(vocab_size=VOCAB, d_model=8, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
            decoder_attention_heads=2, encoder_ffn_dim=16, decoder_ffn_dim=16, max_position_embeddings=16,
            dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, encoder_layerdrop=0.0,
            decoder_layerdrop=0.0, pad_token_id=1, bos_token_id=0, eos_token_id=2,
            decoder_start_token_id=2)
T5 = dict(vocab_size=VOCAB, d_model=8, d_kv=4, d_ff=16, num_layers=1, num_decoder_layers=1, num_heads=2,
          relative_attention_num_buckets=4, relative_attention_max_distance=8, dropout_rate=0.0,
          pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)
GPT2 = dict(vocab_size=VOCAB, n_embd=8, n_layer=1, n_head=2, n_positions=16, resid_pdrop=0.0,
            embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)


@pytest.mark.parametrize("n", SIZES)
def test_opt_merged_batch_and_positions_are_exact(n):
    engine, _, _ = exact(_tiny("OPTConfig", "OPTForCausalLM", **OPT), _ids(n, seed=n), _lm_loss)
    merged = {label for label, lay in _layouts(engine).items() if lay.inputs[0].merged}
    assert merged == {f"model.decoder.layers.0.{name} #0"             # they get [B·T, d]
                      for name in ("final_layer_norm (LayerNorm)", "fc1 (Linear)", "fc2 (Linear)")}


@pytest.mark.parametrize("n", SIZES)
def test_bart_positional_embeddings_are_exact(n):
    exact(_tiny("BartConfig", "BartForConditionalGeneration", **BART), _ids(n, seed=n), _seq2seq_loss)


@pytest.mark.parametrize("n", SIZES)
def test_gpt2_stays_exact_when_the_batch_equals_the_sequence_length(n):
    exact(_tiny("GPT2Config", "GPT2LMHeadModel", **GPT2), _ids(n, seed=n), _lm_loss, strict=True)


def _padded_seq2seq_loss(model, batch):
    ids = batch["x"]
    mask = (torch.arange(ids.shape[1]) < ids.shape[1] - (ids[:, :1] % 2)).long()  # some padded
    logits = model(input_ids=ids, attention_mask=mask, decoder_input_ids=ids, use_cache=False).logits
    return F.cross_entropy(logits[:, :-1].transpose(1, 2), ids[:, 1:], reduction="none").mean(1)


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
@pytest.mark.parametrize("loss", [_seq2seq_loss, _padded_seq2seq_loss], ids=["plain", "padded"])
@pytest.mark.parametrize("n", SIZES)
def test_t5_relative_position_bias_is_exact(n, loss, attention):
    # the bias Embedding gets shared [T, T] buckets; permute and unsqueeze keep its output
    # shared; eager adds it to each layer's scores, sdpa takes it as the mask (the decoder's
    # after a where() with the shared causal mask, a padded encoder's with the per-sample one)
    exact(_tiny("T5Config", "T5ForConditionalGeneration", attention, **T5), _ids(n, seed=n), loss)


@pytest.mark.parametrize("model", ["GPT2", "OPT", "BART"])
@pytest.mark.parametrize("n", [T, 1])
def test_transformers_with_sdpa_attention_are_exact(model, n):
    config, cls, kw, loss = {"GPT2": ("GPT2Config", "GPT2LMHeadModel", GPT2, _lm_loss),
                             "OPT": ("OPTConfig", "OPTForCausalLM", OPT, _lm_loss),
                             "BART": ("BartConfig", "BartForConditionalGeneration", BART,
                                      _seq2seq_loss)}[model]
    exact(_tiny(config, cls, "sdpa", **kw), _ids(n, seed=n), loss)


def test_t5_bias_is_book_kept_once_per_forward_and_probed_once():
    model = _tiny("T5Config", "T5ForConditionalGeneration", num_layers=2, num_decoder_layers=2,
                  **{k: v for k, v in T5.items() if k not in ("num_layers", "num_decoder_layers")})()
    engine = DPEngine(model, {}, expected_batch_size=4, gradient_noise_multiplier=0.0)
    for n in (3, 4):
        engine.backward(_seq2seq_loss(model, _ids(n, seed=n)))
    axes = engine._keeper.axes
    assert axes.probes == 4
    chained = [lay for lay in axes.layouts.values() if lay.consumers is not None]
    assert len(chained) == 2                                   # encoder and decoder bias
    assert all(len(lay.consumers) == 2 for lay in chained)      # reused by both layers
    engine.detach()


# -------------------------------------------------------------- the probes


def test_the_probe_runs_once_not_per_step_and_poisson_sizes_reuse_it():
    model = SeqFirst().to(DTYPE)
    engine = DPEngine(model, {}, expected_batch_size=4, gradient_noise_multiplier=0.0)
    axes = engine._keeper.axes
    for n in (3, 4, 5, 1, 2, 4):
        engine.backward(classify_loss(model, _ids(n)))
        engine.privatize()
    assert axes.probes == 2          # the same inputs, then resized: once
    engine.detach()


def test_the_common_batch_first_case_probes_once_and_checks_shapes_after():
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 3)).to(DTYPE)
    engine = DPEngine(model, {}, expected_batch_size=4, gradient_noise_multiplier=0.0)
    for n in (4, 7, 2):
        x = torch.randn(n, 3, dtype=DTYPE)
        engine.backward(F.cross_entropy(model(x), torch.zeros(n, dtype=torch.long), reduction="none"))
    assert engine._keeper.axes.probes == 2
    assert all(lay.inputs[0].dim == 0 for lay in engine._keeper.axes.layouts.values())
    engine.detach()


def test_the_probes_leave_the_callers_random_stream_alone():
    model = nn.Sequential(nn.Linear(3, 4), nn.Dropout(0.5), nn.Linear(4, 3)).to(DTYPE)
    x = torch.randn(5, 3, dtype=DTYPE)
    torch.manual_seed(7)
    want = model(x)
    engine = DPEngine(model, {}, expected_batch_size=4, gradient_noise_multiplier=0.0)
    torch.manual_seed(7)
    got = model(x)                   # probes ran first, with the RNG forked
    torch.testing.assert_close(got, want)
    engine.detach()


def test_a_layer_called_outside_the_models_forward_is_refused():
    model = nn.Sequential(nn.Linear(3, 3))
    engine = DPEngine(model, {}, expected_batch_size=4)
    with pytest.raises(EngineError, match=r"module 0 \(Linear\) was called outside"):
        model[0](torch.randn(4, 3))
    engine.detach()


def test_losses_that_do_not_match_the_models_batch_are_refused():
    model = SeqFirst().to(DTYPE)
    engine = DPEngine(model, {}, expected_batch_size=4)
    out = model(_ids(3)["x"])
    with pytest.raises(EngineError, match="batch of 3 samples"):
        engine.backward(out.sum(1)[:2])                # 2 losses for a batch of 3
    engine.detach()


# ------------------------------------------------------------- property


class _SeqFirstFloat(nn.Module):
    def __init__(self, d, p):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(VOCAB, d)
        self.lin = nn.Linear(d, p)
        self.head = nn.Linear(p, 2)

    def forward(self, ids):
        return self.head(torch.tanh(self.lin(self.emb(ids.t()))).mean(0))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n=st.integers(1, 6), t=st.integers(1, 6), d=st.integers(1, 6), p=st.integers(1, 6),
       seed=st.integers(0, 2**16))
def test_property_sequence_first_linear_and_embedding_match_the_per_example_loop(n, t, d, p, seed):
    g = torch.Generator().manual_seed(seed)
    batch = {"x": torch.randint(0, VOCAB, (n, t), generator=g), "y": torch.randint(0, 2, (n,), generator=g)}
    check_exact(lambda: _SeqFirstFloat(d, p).to(DTYPE), classify_loss, batch, fn="auto")


class _Loop(nn.Module):
    """A cell called once per time step: a longer sequence makes calls the probe never saw."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.cell = nn.Linear(3, 3)
        self.head = nn.Linear(3, 3)

    def forward(self, x):
        h = torch.zeros_like(x[:, 0])
        for t in range(x.shape[1]):
            h = torch.tanh(self.cell(x[:, t]) + h)
        return self.head(h)


@pytest.mark.parametrize("lengths", [(2, 4, 3), (4, 2, 5)])
def test_calls_beyond_the_probed_ones_probe_again_once_and_stay_exact(lengths):
    for t in lengths:   # each length exact on a fresh engine, and on one engine in sequence
        exact(lambda: _Loop().to(DTYPE), _floats(3, t=t, seed=t))
    model = _Loop().to(DTYPE)
    engine = DPEngine(model, {}, expected_batch_size=3, gradient_noise_multiplier=0.0)
    for t in lengths:
        engine.backward(classify_loss(model, _floats(3, t=t, seed=t)))
    longest = [max(lengths[:i + 1]) for i in range(len(lengths))]
    assert engine._keeper.axes.probes == 2 * len(set(longest))   # only a new longest probes
    engine.detach()


def test_the_models_forward_hooks_do_not_see_the_probes():
    model = SeqFirst().to(DTYPE)
    seen, pre = [], []
    model.lin.register_forward_hook(lambda m, args, out: seen.append(tuple(out.shape)))
    model.register_forward_pre_hook(lambda m, args: pre.append(args[0].shape[0]))
    engine = DPEngine(model, {}, expected_batch_size=4, gradient_noise_multiplier=0.0)
    engine.backward(classify_loss(model, _ids(5)))
    assert engine._keeper.axes.probes == 2
    assert seen == [(T, 5, 3)] and pre == [5]
    # the user's pre-hook, the batch axes' and the certificate's two (the rows first, the state after the user's)
    assert len(model.lin._forward_hooks) == 1 and len(model._forward_pre_hooks) == 4
    engine.detach()


def test_a_forward_wrapped_in_one_autocast_instance_leaves_autocast_off_after_the_probes():
    """accelerate (and so the Hugging Face Trainer) wraps ``model.forward`` in a single
    ``torch.autocast`` instance. The probes re-enter that forward from inside it; the
    instance's one saved state was overwritten and autocast stayed on after the step (seen
    on a GPU: a later float16 run rounded through a leftover bf16 region)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    model.forward = torch.autocast("cpu", dtype=torch.bfloat16)(model.forward)
    engine = DPEngine(model, {"threshold": {"kind": "fixed", "value": 1.0}}, gradient_noise_multiplier=0.0,
                      expected_batch_size=4)
    assert not torch.is_autocast_enabled("cpu")
    for _ in range(2):   # the probing step and an ordinary one
        x, y = torch.randn(4, 4), torch.randint(0, 3, (4,))
        engine.backward(F.cross_entropy(model(x), y, reduction="none"))
        assert not torch.is_autocast_enabled("cpu")
        engine.privatize()
    assert engine._keeper.axes.probes > 0   # the probes did run inside the wrapped forward
    engine.detach()


def test_probe_forwards_keep_no_activations_for_a_backward():
    # The probes run with gradients on but keep nothing for a backward that never comes: a
    # 3-sample probe at B 2 once held 1.5x the step's own activations (first-step peak).
    outputs = []

    class Squares(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 3)

        def forward(self, x):
            h = self.lin(x)
            y = h * h                     # autograd saves h for the product's backward
            outputs.append(y)
            return y.sum(-1)

    model = Squares()
    engine = DPEngine(model, {}, gradient_noise_multiplier=1.0, expected_batch_size=5, seed=0)
    losses = model(torch.randn(5, 4))
    probes = [y for y in outputs if y.shape[0] != 5]
    assert sorted(y.shape[0] for y in probes) == [2, 3]
    assert all(y.requires_grad for y in probes)          # gradients were on
    for y in probes:
        with pytest.raises(RuntimeError, match="has no backward"):
            y.grad_fn._saved_self
    (real,) = [y for y in outputs if y.shape[0] == 5]
    assert real.grad_fn._saved_self.shape == (5, 3)      # the step's own forward saves as usual
    engine.backward(losses)
    engine.privatize()
    assert model.lin.weight.grad is not None


class TiledTable(nn.Module):
    """A layer on a table shared by all samples, [H, K, d], tiled by ``repeat`` over the batch on its
    axis of size H (DeBERTa-v2's position projections: B·H rows, batch-outer), or by a constant."""

    def __init__(self, factor: int | None = None, h: int = 2, k: int = 3, d: int = 4):
        super().__init__()
        self.register_buffer("table", torch.randn(h, k, d))
        self.proj, self.inp, self.factor = nn.Linear(d, d), nn.Linear(d, d), factor

    def forward(self, x):                                        # x [B, K, d]
        h, k, d = self.table.shape
        rows = self.factor or x.shape[0]
        tiled = self.proj(self.table).repeat(rows, 1, 1).view(rows, h, k, d)   # [B·H, K, d] as [B, H, K, d]
        mixed = tiled.sum(1) if self.factor is None else tiled.sum((0, 1))     # [B, K, d], or [K, d] shared
        return (mixed * self.inp(x)).sum((1, 2))


def _tiled_loss(model, batch):
    return model(batch["x"]) ** 2


@pytest.mark.parametrize("n", [1, 3, 4])
def test_a_shared_output_tiled_over_the_batch_by_repeat_clips_as_the_per_example_reference(n):
    def make():
        torch.manual_seed(0)
        return TiledTable().to(DTYPE)
    x = torch.randn(n, 3, 4, dtype=DTYPE, generator=torch.Generator().manual_seed(n))
    check_exact(make, _tiled_loss, {"x": x}, grouping="layer", fn="auto" if n == 1 else "abadi")


def test_a_shared_output_tiled_by_a_constant_is_refused():
    torch.manual_seed(0)
    model = TiledTable(factor=2)
    engine = DPEngine(model, {"grouping": "all-layer"}, gradient_noise_multiplier=0.0, expected_batch_size=2)
    with pytest.raises(EngineError, match="proj .*`repeat` does not broadcast"):
        engine.backward(_tiled_loss(model, {"x": torch.randn(2, 3, 4)}))
    assert all(p.grad is None for p in model.parameters())


class InPlaceOnShared(nn.Module):
    """A layer on a shared table whose output is changed in place before a broadcast consumer."""

    def __init__(self, how: str):
        super().__init__()
        self.register_buffer("table", torch.randn(3, 4))
        self.proj, self.inp, self.how = nn.Linear(4, 4), nn.Linear(4, 4), how

    def forward(self, x):                                        # x [B, 3, 4]
        shared = self.proj(self.table).t().contiguous().t()      # a chain: the engine follows it
        {"mul": lambda: shared.mul_(0.5), "tanh": lambda: shared.tanh_(),
         "fill": lambda: shared.fill_diagonal_(0.0)}[self.how]()
        return (shared * self.inp(x)).sum((1, 2))


@pytest.mark.parametrize("how", ["mul", "tanh"])
def test_a_shared_output_changed_in_place_clips_as_the_per_example_reference(how):
    def make():
        torch.manual_seed(0)
        return InPlaceOnShared(how).to(DTYPE)
    x = torch.randn(4, 3, 4, dtype=DTYPE, generator=torch.Generator().manual_seed(2))
    check_exact(make, _tiled_loss, {"x": x}, grouping="layer")


def test_a_shared_output_changed_in_place_by_an_op_the_engine_cannot_replay_is_refused():
    refused(lambda: InPlaceOnShared("fill"), {"x": torch.randn(4, 3, 4)}, "fill_diagonal_", loss=_tiled_loss)


class TypedIds(nn.Module):
    """BERT's pattern: a second embedding of a buffer of type ids expanded over the batch (a
    view of the buffer, saved for the backward), and a head that only a later forward calls."""

    def __init__(self, d=4):
        super().__init__()
        torch.manual_seed(0)
        self.register_buffer("type_ids", torch.zeros(1, 8, dtype=torch.long))
        self.wte, self.tte = nn.Embedding(VOCAB, d), nn.Embedding(2, d)
        self.first, self.second = nn.Linear(d, 3), nn.Linear(d, 3)
        self.use_second = False

    def forward(self, ids):
        types = self.type_ids[:, :ids.shape[1]].expand(ids.shape[0], ids.shape[1])
        h = torch.tanh(self.wte(ids) + self.tte(types)).mean(1)
        return (self.second if self.use_second else self.first)(h)


def test_a_probe_in_the_middle_of_a_forward_leaves_the_buffer_views_it_saved_usable():
    """A module no earlier forward called (continual training's private head, after a public
    phase with a head of its own) is probed mid-forward; the probes restore the buffers they
    found, and a write of unchanged values would bump the version of the saved view."""
    model = TypedIds()
    engine = DPEngine(model, {}, expected_batch_size=5, gradient_noise_multiplier=1.0)
    engine.backward(classify_loss(model, _ids(5)))
    engine.privatize()
    model.use_second = True
    engine.backward(classify_loss(model, _ids(5, seed=1)))
    assert engine.privatize().samples_seen == 5
    engine.detach()


class HoldsItsOwn(nn.Module):
    """wav2vec2 / UniSpeech's shape: a whole model holding a parameter of its own (``unused``, like
    ``masked_spec_embed`` at ``mask_time_prob 0``) beside its layers, whose returned tensors are not
    the same in two calls (``hidden`` every other call): book-kept whole, its call is unprobed."""

    def __init__(self):
        super().__init__()
        self.unused = nn.Parameter(torch.zeros(3))
        self.inner, self.calls = nn.Linear(3, 4), 0

    def forward(self, x):
        self.calls += 1
        h = self.inner(x).mean(1)
        return (h, h.detach()) if self.calls % 2 else (h,)


class Speech(nn.Module):
    def __init__(self, freeze=False):
        super().__init__()
        self.encoder, self.head = HoldsItsOwn(), nn.Linear(4, 3)
        self.encoder.unused.requires_grad_(not freeze)

    def forward(self, x):
        return self.head(self.encoder(x)[0])


def test_a_module_book_kept_whole_for_a_parameter_of_its_own_is_refused_naming_it_to_freeze():
    """unispeech-sat (rev44): refused "does not match the probe forwards", hint batch-first. The refusal
    names the parameter that makes the whole module one unit, and freezing it is the fix: exact."""
    err = refused(lambda: Speech().to(DTYPE), _floats(3), r"holds the trainable parameter\(s\) unused directly")
    assert "`model.encoder.unused.requires_grad_(False)`" in err.hint
    exact(lambda: Speech(freeze=True).to(DTYPE), _floats(3))


class ReturnsItsBias(nn.Module):
    """GPT-NeoX-Japanese's attention: returns its own ``dense_bias`` for the layer to add."""

    def __init__(self):
        super().__init__()
        self.dense = nn.Linear(3, 3, bias=False)
        self.dense_bias = nn.Parameter(torch.randn(3))

    def forward(self, x):
        return self.dense(x), self.dense_bias


class BiasAfterResidual(nn.Module):
    def __init__(self, freeze=False):
        super().__init__()
        self.attention, self.head = ReturnsItsBias(), nn.Linear(3, 3)
        self.attention.dense_bias.requires_grad_(not freeze)

    def forward(self, x):
        out, bias = self.attention(x)
        out = F.dropout(out + bias.expand_as(x), 0.0, self.training) + x     # transformers' bias_dropout_add
        return self.head(out.mean(1))


def test_a_module_returning_its_own_parameter_for_the_caller_to_broadcast_is_refused_naming_it():
    """gpt_neox_japanese (rev44): refused as "fed a tensor shared by all samples", blaming the input;
    the refusal names the returned parameter, and freezing it (the hint) is exact."""
    err = refused(lambda: BiasAfterResidual().to(DTYPE), _floats(3),
                  r"module attention \(ReturnsItsBias\) returns its own parameter\(s\) dense_bias unchanged")
    assert "`model.attention.dense_bias.requires_grad_(False)`" in err.hint
    exact(lambda: BiasAfterResidual(freeze=True).to(DTYPE), _floats(3))
