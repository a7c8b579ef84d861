"""Capture without autograd weight grads, what is refused, frozen params, memory."""

import contextlib

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dpclip.engine import DPEngine
from dpclip.errors import EngineError
from tests.engine.conftest import (DTYPE, LSTMNet, check_exact, classify_loss, gpt2_batch, gpt2_loss, mlp,
                                   mlp_batch, seq_batch, tiny_gpt2)


def test_autograd_never_computes_the_unweighted_weight_gradient():
    model = tiny_gpt2()
    fired, accumulators = [], []
    for name, p in model.named_parameters():
        # a pre-hook on p's AccumulateGrad node (held here, so the forward's graph reuses it), which
        # autograd calls with None when no gradient was formed (a hook on p itself is refused)
        accumulators.append(p.view_as(p).grad_fn.next_functions[0][0])
        accumulators[-1].register_prehook(lambda grads, name=name: fired.append(name) if grads[0] is not None else None)
    engine = DPEngine(model, {"grouping": "layer"}, expected_batch_size=4)
    engine.backward(gpt2_loss(model, gpt2_batch(n=3)))
    assert fired == []
    assert all(p.grad is None for p in model.parameters())   # only privatize writes .grad
    engine.privatize()
    assert all(p.grad is not None for p in model.parameters())


@pytest.mark.parametrize("bn", [nn.BatchNorm1d(4), nn.BatchNorm2d(4), nn.SyncBatchNorm(4)])
def test_batchnorm_is_refused_naming_the_module_with_a_groupnorm_hint(bn):
    model = nn.Sequential(nn.Linear(3, 4), bn, nn.Linear(4, 2))
    with pytest.raises(EngineError) as err:
        DPEngine(model, {}, expected_batch_size=4)
    assert "module 1" in err.value.message and type(bn).__name__ in err.value.message
    assert "GroupNorm" in err.value.hint


def test_strict_mode_refuses_the_lstm_fallback_naming_it():
    with pytest.raises(EngineError) as err:
        DPEngine(LSTMNet().to(DTYPE), {"strict": True}, expected_batch_size=4)
    assert "lstm (LSTM)" in err.value.message and "strict" in err.value.message


def test_strict_mode_accepts_every_supported_layer():
    from tests.engine.conftest import TinyRMSNorm, cnn, tiny_bert
    for model in (tiny_gpt2(), tiny_bert(), cnn(), nn.Sequential(nn.Linear(3, 4), TinyRMSNorm(4))):
        DPEngine(model, {"strict": True}, expected_batch_size=4).detach()


def test_frozen_parameters_get_no_grad_and_their_modules_are_not_wrapped():
    model = tiny_gpt2()
    for p in model.transformer.h[0].parameters():
        p.requires_grad_(False)
    engine = DPEngine(model, {"grouping": "block"}, expected_batch_size=4, gradient_noise_multiplier=1.0)
    assert "transformer.h.0" not in engine.group_names
    assert "forward" not in model.transformer.h[0].attn.c_attn.__dict__
    assert "forward" in model.transformer.h[1].attn.c_attn.__dict__
    engine.backward(gpt2_loss(model, gpt2_batch(n=3)))
    engine.privatize()
    assert all(p.grad is None for p in model.transformer.h[0].parameters())
    assert all(p.grad is not None for p in model.transformer.h[1].parameters())


def test_calling_loss_backward_directly_is_an_error():
    model = mlp()
    DPEngine(model, {}, expected_batch_size=4)
    with pytest.raises(EngineError, match="engine.backward"):
        classify_loss(model, mlp_batch()).sum().backward()


def test_mean_loss_instead_of_per_sample_losses_is_an_error():
    model = mlp()
    engine = DPEngine(model, {}, expected_batch_size=4)
    with pytest.raises(EngineError) as err:
        engine.backward(classify_loss(model, mlp_batch()).mean())
    assert "reduction='none'" in err.value.hint


def test_sequence_first_input_is_an_error_not_a_silent_mix():
    model = nn.Sequential(nn.Linear(3, 2))
    engine = DPEngine(model, {}, expected_batch_size=4)
    x = torch.randn(7, 4, 3)                        # [T, B, d]
    with pytest.raises(EngineError, match="leading dimension 7"):
        engine.backward(model(x).sum(-1).sum(0))      # 4 losses


class _Peeker(nn.Module):
    """Reads another module's weight without calling it."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(3, 3)
        self.b = nn.Linear(3, 2)

    def forward(self, x):
        return F.linear(self.a(x), self.b.weight)


def test_parameter_used_outside_its_module_is_refused():
    model = _Peeker()
    engine = DPEngine(model, {}, expected_batch_size=2)
    with pytest.raises(EngineError, match="b.weight"):
        engine.backward(model(torch.randn(2, 3)).sum(1))


def test_attention_extra_key_bias_and_scale_grad_by_freq_are_refused():
    with pytest.raises(EngineError, match="add_bias_kv"):
        DPEngine(nn.Sequential(nn.MultiheadAttention(4, 2, add_bias_kv=True)), {},
                 expected_batch_size=2)
    model = nn.Sequential(nn.Embedding(5, 3, scale_grad_by_freq=True))
    engine = DPEngine(model, {}, expected_batch_size=2)
    with pytest.raises(EngineError, match="scale_grad_by_freq"):
        model(torch.tensor([[1, 2], [2, 2]]))
    del engine


@pytest.mark.parametrize("table", [nn.Embedding(5, 3, sparse=True), nn.EmbeddingBag(5, 3, sparse=True)])
def test_a_trainable_sparse_embedding_is_refused_with_the_dense_hint(table):
    with pytest.raises(EngineError, match="sparse=True") as err:
        DPEngine(nn.Sequential(table), {}, expected_batch_size=2)
    assert "sparse=False" in err.value.hint
    table.requires_grad_(False)   # frozen: no sparse gradient is ever formed
    DPEngine(nn.Sequential(table, nn.Linear(3, 2)), {}, expected_batch_size=2).detach()


@pytest.mark.parametrize("hook", ["prune", "weight_norm", "spectral_norm"])
def test_a_weight_computed_by_an_old_style_forward_pre_hook_is_refused_with_the_parametrization_hint(hook):
    import torch.nn.utils.prune as prune
    layer = nn.Linear(4, 2)
    with pytest.warns(FutureWarning) if hook == "weight_norm" else contextlib.nullcontext():
        {"prune": lambda m: prune.l1_unstructured(m, "weight", amount=0.5), "weight_norm": nn.utils.weight_norm,
         "spectral_norm": nn.utils.spectral_norm}[hook](layer)
    with pytest.raises(EngineError, match="computes its weight in a forward pre-hook") as err:
        DPEngine(nn.Sequential(nn.Linear(3, 4), nn.Tanh(), layer), {}, expected_batch_size=2)
    assert "parametrizations.weight_norm" in err.value.hint and "prune.remove" in err.value.hint


class _DoubledByFunctionalCall(nn.Module):
    """A layer called with a weight computed from its own (torch.func.functional_call)."""

    def __init__(self):
        super().__init__()
        self.a, self.h = nn.Linear(5, 5), nn.Linear(5, 3)

    def forward(self, x):
        h = torch.func.functional_call(self.a, {"weight": self.a.weight * 2, "bias": self.a.bias}, (x,))
        return self.h(torch.tanh(h))


def test_a_layer_called_with_a_computed_weight_by_functional_call_is_refused_by_name_before_any_noise():
    """It was refused by the certificate (relative error 0.4) with the hint for a wrong clip."""
    torch.manual_seed(0)
    model = _DoubledByFunctionalCall()
    engine = DPEngine(model, {}, expected_batch_size=6)
    x, y = torch.randn(6, 5), torch.randint(0, 3, (6,))
    with pytest.raises(EngineError, match=r"module a \(Linear\) is called with its parameter weight replaced") as err:
        engine.backward(F.cross_entropy(model(x), y, reduction="none"))
    assert "register_parametrization" in err.value.hint
    assert all(p.grad is None for p in model.parameters())


class _SpectralFilter(nn.Module):
    """A learned complex filter in the frequency domain (FNO / GFNet style)."""

    def __init__(self):
        super().__init__()
        self.proj, self.filter = nn.Linear(4, 4), nn.Parameter(torch.randn(4, dtype=torch.cfloat))

    def forward(self, x):
        return (torch.fft.fft(self.proj(x)) * self.filter).real


def test_a_complex_parameter_is_refused_by_name_when_the_engine_is_built():
    with pytest.raises(EngineError, match="complex parameter filter") as err:
        DPEngine(_SpectralFilter(), {}, expected_batch_size=2)
    assert "two real parameters" in err.value.hint
    with pytest.raises(EngineError, match=r"module 0 \(Linear\) has complex parameter weight"):
        DPEngine(nn.Sequential(nn.Linear(4, 4, dtype=torch.cfloat)), {}, expected_batch_size=2)


def _unfrozen_first_layer(model):
    model[0].requires_grad_(True)


def _replaced_head(model):
    model[2] = nn.Linear(4, 2)


def _replaced_weight(model):
    model[2].weight = nn.Parameter(torch.randn(2, 4))


@pytest.mark.parametrize("change", [_unfrozen_first_layer, _replaced_head, _replaced_weight],
                         ids=["unfrozen", "replaced-module", "replaced-parameter"])
def test_parameters_trainable_since_the_engine_was_built_are_refused_before_a_raw_gradient_lands(change):
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    model[0].requires_grad_(False)
    engine = DPEngine(model, {}, expected_batch_size=2)
    change(model)
    with pytest.raises(EngineError, match="trainable now that were not") as err:
        engine.backward(model(torch.randn(2, 3)).sum(1))
    assert "before building the engine" in err.value.hint
    assert all(p.grad is None for p in model.parameters())


def test_a_parameter_frozen_since_the_engine_was_built_is_refused_before_it_gets_noise_alone():
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    engine = DPEngine(model, {}, expected_batch_size=2)
    model[0].weight.requires_grad_(False)
    with pytest.raises(EngineError, match=r"frozen \(requires_grad=False\) since the engine was built \(0.weight\)") \
            as err:
        engine.backward(model(torch.randn(2, 3)).sum(1))
    assert "before building the engine" in err.value.hint
    assert all(p.grad is None for p in model.parameters())


class _GatedMixer(nn.Module):
    """A parameter of its own (the torch.func fallback takes the module) around an attention and a GRU
    without dropout: ops tagged as random by torch (aten::gru, dropout with p = 0) that draw nothing."""

    def __init__(self):
        super().__init__()
        self.attn, self.rnn = nn.MultiheadAttention(6, 2, batch_first=True), nn.GRU(6, 6, batch_first=True)
        self.gamma, self.head = nn.Parameter(torch.ones(6)), nn.Linear(6, 3)

    def forward(self, x):
        return self.head(x + self.gamma * (self.attn(x, x, x, need_weights=False)[0] + self.rnn(x)[0])).mean(1)


def test_ops_torch_tags_random_that_draw_nothing_clip_as_the_per_example_reference():
    g = torch.Generator().manual_seed(2)
    batch = {"x": torch.randn(5, 4, 6, generator=g, dtype=DTYPE), "y": torch.randint(0, 3, (5,), generator=g)}

    def make():
        torch.manual_seed(0)
        return _GatedMixer().to(DTYPE)
    check_exact(make, classify_loss, batch)


class _Noisy(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(3))

    def forward(self, x):
        return F.dropout(x * self.w, 0.5, training=True)


def test_fallback_refuses_randomness_it_cannot_replay():
    model = nn.Sequential(nn.Linear(3, 3), _Noisy())
    engine = DPEngine(model, {}, expected_batch_size=2)
    with pytest.raises(EngineError, match="random"):
        engine.backward(model(torch.randn(2, 3)).sum(1))


def test_detach_restores_the_original_forwards():
    model = tiny_gpt2()
    batch = gpt2_batch(n=2)
    before = gpt2_loss(model, batch).detach()
    engine = DPEngine(model, {}, expected_batch_size=2)
    with_engine = gpt2_loss(model, batch).detach()
    engine.detach()
    assert not any("forward" in m.__dict__ for m in model.modules())
    torch.testing.assert_close(with_engine, before)
    gpt2_loss(model, batch).sum().backward()            # plain autograd works again
    assert model.transformer.wte.weight.grad is not None


def _stash_peak(grouping):
    model = tiny_gpt2(n_layer=4)
    engine = DPEngine(model, {"grouping": grouping}, expected_batch_size=4)
    engine.backward(gpt2_loss(model, gpt2_batch(n=4)))
    assert engine.stash_bytes == 0        # everything released once the backward is done
    return engine.stash_bytes_peak


def test_layerwise_grouping_has_lower_peak_stash_than_all_layer():
    peaks = {g: _stash_peak(g) for g in ("all-layer", "block", "layer")}
    assert peaks["layer"] < peaks["block"] < peaks["all-layer"]
    assert peaks == {g: _stash_peak(g) for g in peaks}     # deterministic byte counting
    assert peaks["layer"] < 0.5 * peaks["all-layer"]


def test_lstm_padding_rows_get_no_noise_when_untied():
    model = LSTMNet().to(DTYPE)
    engine = DPEngine(model, {}, expected_batch_size=4, gradient_noise_multiplier=1.0)
    engine.backward(classify_loss(model, seq_batch()))
    engine.privatize()
    assert model.emb.weight.grad[0].abs().sum() == 0 and model.emb.weight.grad[1].abs().sum() > 0


def test_a_second_engine_on_a_wrapped_model_is_refused_until_detach():
    model = mlp()
    first = DPEngine(model, {}, expected_batch_size=2)
    with pytest.raises(EngineError, match="another DPEngine"):
        DPEngine(model, {}, expected_batch_size=2)
    first.detach()
    DPEngine(model, {}, expected_batch_size=2).detach()
