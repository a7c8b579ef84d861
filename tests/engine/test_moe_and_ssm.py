"""Mixture-of-experts and state-space layers (issue 52), built from plain torch so that each
mechanism is seen alone: parameters a module reads without calling their owner (Mamba's
``F.conv1d(x, self.conv1d.weight)``) and experts over the batch's tokens merged into rows
([B·T, d], dispatched by a router). Each is clipped as the per-example reference, and what
truly mixes samples stays refused (docs/supported-models.md, "Mixture-of-experts and state-space models")."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dpclip.engine import DPEngine
from dpclip.errors import EngineError
from tests.engine.conftest import DTYPE, check_exact

D, T = 6, 4


class ShortConvMixer(nn.Module):
    """A Mamba-style mixer: its own ``A`` and ``D``, ``proj`` called, ``conv`` and ``dt`` read."""

    def __init__(self):
        super().__init__()
        self.proj, self.conv, self.dt = nn.Linear(D, D), nn.Conv1d(D, D, 3, groups=D, padding=2), nn.Linear(D, D)
        self.A, self.D = nn.Parameter(torch.randn(D)), nn.Parameter(torch.randn(D))

    def forward(self, x):                                           # [B, T, D]
        h = self.proj(x).transpose(1, 2)
        h = F.conv1d(h, self.conv.weight, self.conv.bias, padding=2, groups=D)[..., :x.shape[1]]
        h = F.silu(h).transpose(1, 2)
        dt = F.softplus(h @ self.dt.weight.t() + self.dt.bias)
        return torch.cumsum(torch.exp(-dt * self.A.exp()) * h, 1) + h * self.D


class Ssm(nn.Module):
    def __init__(self, mixer=ShortConvMixer):
        super().__init__()
        self.mixer, self.head = mixer(), nn.Linear(D, 3)

    def forward(self, x):
        return self.head(self.mixer(x).mean(1))


class Experts(nn.Module):
    """Fused expert weights [E, d, d] over [B·T, d] token rows, each token sent to its top-1
    expert by index (the loop transformers' eager experts run)."""

    def __init__(self, n=3):
        super().__init__()
        self.w = nn.Parameter(torch.randn(n, D, D) / D ** 0.5)

    def forward(self, rows, expert, weight):
        out = torch.zeros_like(rows)
        for e in range(self.w.shape[0]):
            (idx,) = torch.where(expert == e)
            out.index_add_(0, idx, torch.tanh(rows[idx] @ self.w[e]) * weight[idx, None])
        return out


class Router(nn.Module):
    def __init__(self, n=3):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n, D))

    def forward(self, rows):
        probs = F.softmax(rows @ self.weight.t(), -1)
        weight, expert = probs.max(-1)
        return weight, expert


class Moe(nn.Module):
    def __init__(self, experts=Experts):
        super().__init__()
        self.inp, self.router, self.experts, self.head = nn.Linear(D, D), Router(), experts(), nn.Linear(D, 3)

    def forward(self, x):
        h = self.inp(x)
        rows = h.reshape(-1, D)                                      # [B·T, D]: the batch merged with tokens
        weight, expert = self.router(rows)
        out = (rows + self.experts(rows, expert, weight)).view_as(h)
        return self.head(out.mean(1))


def _factory(cls, *args):
    def make():
        torch.manual_seed(0)
        return cls(*args).to(DTYPE)
    return make


def _loss(model, batch):
    return F.cross_entropy(model(batch["x"]), batch["y"], reduction="none")


def _batch(n=5, seed=3):
    g = torch.Generator().manual_seed(seed)
    return {"x": torch.randn(n, T, D, generator=g, dtype=DTYPE), "y": torch.randint(0, 3, (n,), generator=g)}


def _engine(model, n):
    return DPEngine(model, {"grouping": "layer", "threshold": {"kind": "fixed", "value": 0.1}},
                    gradient_noise_multiplier=0.0, expected_batch_size=n)


def _refused(model, n, match, engine=None):
    """The engine's backward over ``n`` samples refuses, with ``match`` in the error."""
    engine = engine or _engine(model, n)
    with pytest.raises(EngineError, match=match):
        engine.backward(_loss(model, _batch(n)))


@pytest.mark.parametrize("grouping, norm_method", [("all-layer", "auto"), ("layer", "ghost"), ("param", "instantiate")])
def test_weights_a_mixer_reads_without_calling_their_module_clip_as_the_per_example_reference(grouping, norm_method):
    check_exact(_factory(Ssm), _loss, _batch(), grouping=grouping, norm_method=norm_method, micro=[2, 3])


def test_the_mixer_takes_the_read_weights_and_the_unread_module_keeps_its_own():
    model = _factory(Ssm)()
    model.mixer.spare = nn.Linear(D, D).to(DTYPE)           # never called, never read: no gradient
    engine = _engine(model, 5)
    engine.backward(_loss(model, _batch()))
    adopted = engine._keeper.adopted
    assert sorted(adopted) == ["mixer.conv (Conv1d) -> mixer (ShortConvMixer)", "mixer.dt (Linear) -> mixer (ShortConvMixer)"]
    engine.detach()


class Reader(nn.Module):
    """Reads ``conv.weight`` with no parameter of its own (LFM2's short convolution)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv1d(D, D, 1)

    def forward(self, x):
        return F.conv1d(x.transpose(1, 2), self.conv.weight, self.conv.bias).transpose(1, 2)


class Sibling(nn.Module):
    """Reads a weight whose module it also calls: that module's own uses are delivered by its rule."""

    def __init__(self):
        super().__init__()
        self.lin, self.A = nn.Linear(D, D), nn.Parameter(torch.ones(D))

    def forward(self, x):
        return self.lin(x) * self.A + x @ self.lin.weight.t()


def test_a_reader_without_parameters_of_its_own_takes_the_weights_it_reads():
    """LFM2's short convolution: a module with no parameter of its own reads ``conv.weight``; it
    gets a unit (the first forward is probed before any module runs) and is exact."""
    check_exact(_factory(Ssm, Reader), _loss, _batch(), grouping="layer", micro=[2, 3])


def test_a_weight_read_while_its_module_is_also_called_is_still_refused():
    _refused(_factory(Ssm, Sibling)(), 4, "outside the engine's hooks")


def test_a_reader_found_after_the_first_forward_has_run_is_refused_not_adopted():
    """A model whose first forward has already run part of itself when a reader is found (its
    probes ran lazily, at a later shape): the reader is not given a unit mid-forward."""
    model = _factory(Ssm, Reader)()
    engine = _engine(model, 4)
    engine._keeper.axes.first = False   # as if an earlier forward had been probed
    _refused(model, 4, "outside the engine's hooks", engine)


@pytest.mark.parametrize("grouping, norm_method", [("all-layer", "auto"), ("layer", "ghost"), ("param", "instantiate")])
def test_experts_over_token_rows_and_their_router_clip_as_the_per_example_reference(grouping, norm_method):
    check_exact(_factory(Moe), _loss, _batch(), grouping=grouping, norm_method=norm_method, micro=[2, 3])


class CapacityExperts(Experts):
    """Each expert takes at most 2 tokens of the whole batch (Switch-style capacity): whether a
    sample's token is processed depends on the other samples' tokens."""

    def forward(self, rows, expert, weight):
        out = torch.zeros_like(rows)
        for e in range(self.w.shape[0]):
            (idx,) = torch.where(expert == e)
            idx = idx[weight[idx].argsort(descending=True)[:2]]
            out.index_add_(0, idx, torch.tanh(rows[idx] @ self.w[e]) * weight[idx, None])
        return out


def test_experts_with_a_capacity_over_the_batch_are_refused_not_clipped_wrong():
    _refused(_factory(Moe, CapacityExperts)(), 6, "experts .*neither batch-outer")


class EveryTokenExperts(nn.Module):
    """Llama 4's experts: every token goes to every expert, scaled by its router weight (0 where
    unrouted), as rows [E·B·T, d] that each expert reads as its block [B·T, d] (a bmm): the
    batch sits between the experts and the tokens."""

    def __init__(self, n=3):
        super().__init__()
        self.w = nn.Parameter(torch.randn(n, D, D) / D ** 0.5)

    def forward(self, routed):                                     # [E·B·T, D]
        return torch.tanh(torch.bmm(routed.view(self.w.shape[0], -1, D), self.w)).view(-1, D)


class EveryTokenMoe(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp, self.router, self.experts, self.head = nn.Linear(D, D), nn.Linear(D, 3), EveryTokenExperts(), nn.Linear(D, 3)

    def forward(self, x):
        h = self.inp(x)
        rows = h.reshape(-1, D)                                      # [B·T, D]
        scores = torch.sigmoid(self.router(rows))                    # [B·T, E]
        routed = rows.repeat(scores.shape[1], 1) * scores.t().reshape(-1, 1)
        out = self.experts(routed).view(scores.shape[1], -1, D).sum(0)
        return self.head((rows + out).view_as(h).mean(1))


@pytest.mark.parametrize("grouping, norm_method", [("all-layer", "auto"), ("layer", "ghost"), ("param", "instantiate")])
def test_experts_taking_every_token_once_per_expert_clip_as_the_per_example_reference(grouping, norm_method):
    check_exact(_factory(EveryTokenMoe), _loss, _batch(), grouping=grouping, norm_method=norm_method, micro=[2, 3])


def test_expert_rows_read_batch_outer_by_mistake_are_refused_by_the_certificate(monkeypatch):
    """Sabotage: the [E·B·T] rows read as [B, E·T] (the batch-outer reading): sample i's rows
    are then other samples' tokens, which only the check against each sample's own gradient sees."""
    import dpclip.engine.batch_axis.probe as probe
    real = probe._layout

    def outer(*args):
        lay = real(*args)
        return replace(lay, outer=1) if lay.merged else lay
    monkeypatch.setattr(probe, "_layout", outer)
    model = _factory(EveryTokenMoe)()
    batch = _batch(6)
    batch["x"][0] *= 20   # one sample's norm far above the others'
    with pytest.raises(EngineError, match="certificate refused"):
        _engine(model, 6).backward(_loss(model, batch))


class TinyExperts(Experts):
    """Experts whose outputs are about 10⁻⁶ (a freshly initialised layer of a tiny config): rows
    that small are still told apart by sample, relative to their own scale."""

    def __init__(self):
        super().__init__()
        with torch.no_grad():
            self.w.mul_(1e-6)

    def forward(self, rows, expert, weight):
        return super().forward(rows, expert, weight) * 1e-6


def test_experts_whose_outputs_are_tiny_clip_as_the_per_example_reference():
    check_exact(_factory(Moe, TinyExperts), _loss, _batch(), grouping="layer", norm_method="auto", micro=[2, 3])


class TopOneRouter(Router):
    """Top-1 routing renormalised over the chosen expert: every token's weight is exactly 1."""

    def forward(self, rows):
        weight, expert = super().forward(rows)
        return weight / weight, expert


def test_a_top_one_router_whose_weights_are_all_one_is_refused_with_what_to_do():
    model = _factory(Moe)()
    model.router = TopOneRouter().to(DTYPE)
    engine = _engine(model, 4)
    with pytest.raises(EngineError, match=r"rows are equal read in \d+ orders") as info:
        engine.backward(_loss(model, _batch(4)))
    assert "two experts or more" in info.value.hint


def test_a_generation_cache_passed_to_a_layer_of_its_own_parameters_is_refused_with_the_fix():
    transformers = pytest.importorskip("transformers")
    config = transformers.GptOssConfig(
        vocab_size=32, hidden_size=16, intermediate_size=8, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=8, num_local_experts=2, num_experts_per_tok=1,
        layer_types=["full_attention"], attn_implementation="eager")
    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM(config).train()
    model.set_experts_implementation("eager")
    ids = torch.randint(0, 32, (3, 5))
    engine = _engine(model, 3)
    with pytest.raises(EngineError, match="generation cache") as caught:
        model(input_ids=ids, use_cache=True)
    assert "use_cache=False" in caught.value.hint
    engine.detach()


def test_dpclip_forwards_build_no_generation_cache_and_leave_the_config_as_it_was():
    transformers = pytest.importorskip("transformers")
    from dpclip.models.losses import forward_transformers
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=32, hidden_size=16, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1))
    seen = []
    model.model.register_forward_hook(lambda m, a, out: seen.append(out.past_key_values))
    ids = torch.randint(0, 32, (2, 4))
    forward_transformers(model, {"input_ids": ids, "attention_mask": torch.ones_like(ids)})
    assert seen == [None] and model.config.use_cache is True


def test_capacity_experts_slipping_past_the_probe_are_refused_by_the_certificate(monkeypatch):
    """Sabotage: the probe's row check of the experts' output is blinded (its merged rows read as
    batch-outer unchecked); a sample's tokens then depend on the others', which only the check of
    each clip against the sample's own gradient can tell."""
    from dpclip.engine.batch_axis import probe, state
    real = probe.compare

    def blind(a, b):
        out = real(a, b)
        for key, call in out.items():
            if call.outputs is not None:
                fixed = tuple(probe.Layout(lay.ndim, lay.dim, merged=True) if lay.merged else lay
                              for lay in call.outputs)
                out[key] = type(call)(call.inputs, fixed, call.refusal, call.consumers)
        return out
    monkeypatch.setattr(state, "compare", blind)
    model = _factory(Moe, CapacityExperts)()
    engine = _engine(model, 6)
    with pytest.raises(EngineError, match="mixes samples|certificate refused"):
        engine.backward(_loss(model, _batch(6)))


def test_transformers_default_grouped_mm_experts_match_a_float32_per_example_loop():
    """transformers' default experts kernel (``torch._grouped_mm``, float32 only, so not in the
    float64 zoo): unclipped sums equal the per-example gradients' sum."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(transformers.MixtralConfig(
        vocab_size=32, hidden_size=16, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, num_local_experts=4, num_experts_per_tok=2, attn_implementation="eager")).train()
    model.config.use_cache = False
    assert model.config._experts_implementation == "grouped_mm"
    ids = torch.randint(0, 32, (3, 6))

    def losses(x):
        logits = model(input_ids=x).logits[:, :-1]
        return F.cross_entropy(logits.transpose(1, 2), x[:, 1:], reduction="none").mean(1)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    per = [torch.autograd.grad(losses(ids[i:i + 1]).sum(), [p for _, p in named]) for i in range(3)]
    engine = DPEngine(model, {"grouping": "all-layer", "threshold": {"kind": "fixed", "value": 1e6}},
                      gradient_noise_multiplier=0.0, expected_batch_size=3)
    engine.backward(losses(ids))
    sums = engine.debug_clipped().sums
    for k, (name, _) in enumerate(named):
        torch.testing.assert_close(sums[name], sum(g[k] for g in per), rtol=1e-4, atol=1e-6, msg=name)
    engine.detach()


class KeepsItsState(nn.Module):
    """RecurrentGemma's RG-LRU: keeps the batch's last state on the module (``state``, [B, d]) and
    starts the next call from it when the batch sizes agree or one token is decoded (its reset at
    position 0 zeroes it here: ``0 *``). The torch.func fallback recomputes one sample with the
    batch's state: ``expand`` fails, as RecurrentGemma's does."""

    def __init__(self, d=3):
        super().__init__()
        self.w, self.state = nn.Parameter(torch.randn(d, dtype=DTYPE)), None

    def forward(self, x):                    # [B, T, d]
        s = x.new_zeros(x.shape[0], x.shape[2])
        if self.state is not None and self.state.shape[0] in (x.shape[0], 3) and x.shape[0] in (1, self.state.shape[0]):
            s = self.state.expand(x.shape[0], -1)
        h = torch.tanh(x * self.w) + 0 * s[:, None]
        self.state = h[:, -1].detach()
        return h


class Cleared(KeepsItsState):
    """The hint's fix: the state cleared first thing in the module's own forward."""

    def forward(self, x):
        self.state = None
        return super().forward(x)


class StatefulNet(nn.Module):
    def __init__(self, clear=False):
        super().__init__()
        self.rnn, self.head = (Cleared if clear else KeepsItsState)(), nn.Linear(3, 2, dtype=DTYPE)

    def forward(self, x):
        return self.head(self.rnn(x).mean(1))


def _stateful_loss(model, batch):
    return F.cross_entropy(model(batch["x"]), batch["y"], reduction="none")


def test_a_module_keeping_the_batchs_state_is_refused_naming_the_state_and_clearing_it_is_exact():
    """recurrent_gemma (rev44): refused with "the engine cannot follow this module" only. The refusal
    names the stateful module's attribute and the fix (clear it before each call): exact then."""
    g = torch.Generator().manual_seed(0)
    batch = {"x": torch.randn(3, 4, 3, generator=g, dtype=DTYPE), "y": torch.randint(0, 2, (3,), generator=g)}
    model = StatefulNet()
    engine = DPEngine(model, {}, expected_batch_size=3, gradient_noise_multiplier=1.0)
    with pytest.raises(EngineError, match=r"module rnn \(KeepsItsState\).*stateful: it keeps `state` \(3, 3\)") as err:
        engine.backward(_stateful_loss(model, batch))
    assert "`self.state = None`" in err.value.hint
    assert all(p.grad is None for p in model.parameters())
    engine.detach()
    check_exact(lambda: StatefulNet(clear=True), _stateful_loss, batch)
