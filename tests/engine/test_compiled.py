"""torch.compile and the engine.

A model the user compiled (issue 52): dynamo compiles what it can trace and the engine's book-kept
calls run eagerly between its graphs; the clipping is the per-example reference's.

The compiled micro-batch (dpclip/engine/compiled.py, issue 54): forward, backward and clip of the
tiny GPT-2, Llama and BERT trace as one graph with no break, and clip as the eager engine and the
per-example reference do. The tests trace with the ``aot_eager`` backend (autograd traced, nothing
generated); inductor runs in the slow end-to-end test (tests/train/test_compiled_training.py)."""

from __future__ import annotations

import traceback
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dpclip.engine import DPEngine
from dpclip.engine.compiled import CompiledMicroBatch
from dpclip.errors import EngineError
from tests.engine.conftest import (DTYPE, check_exact, clip_reference, example_model, gpt2_batch, gpt2_loss,
                                   group_norms, per_example_grads, tiny_gpt2)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp, self.norm, self.out = nn.Linear(5, 8), nn.LayerNorm(8), nn.Linear(8, 3)

    def forward(self, x):
        return self.out(torch.tanh(self.norm(self.inp(x))).mean(1))


def _loss(model, batch):
    return F.cross_entropy(model(batch["x"]), batch["y"], reduction="none")


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])   # inductor: 23 s
def test_a_compiled_model_clips_as_the_per_example_reference(backend):
    def make():
        torch.manual_seed(0)
        return torch.compile(Net().to(DTYPE), backend=backend)
    g = torch.Generator().manual_seed(1)
    batch = {"x": torch.randn(6, 4, 5, generator=g, dtype=DTYPE), "y": torch.randint(0, 3, (6,), generator=g)}
    check_exact(make, _loss, batch, grouping="layer", micro=[2, 4])


# ------------------------------------------------------------------ the compiled micro-batch


def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel
    return GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16))


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM
    return LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, vocab_size=64,
                                        max_position_embeddings=16))


def _bert():
    from transformers import BertConfig, BertForSequenceClassification
    return BertForSequenceClassification(BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2,
                                                    num_attention_heads=2, intermediate_size=64,
                                                    max_position_embeddings=16, num_labels=3))


def _lm_loss(model, batch):
    logits = model(input_ids=batch["ids"], use_cache=False).logits
    return F.cross_entropy(logits[:, :-1].transpose(1, 2), batch["ids"][:, 1:], reduction="none").mean(1)


def _classify_loss(model, batch):
    return F.cross_entropy(model(input_ids=batch["ids"]).logits, batch["y"], reduction="none")


# dropout stays on (the defaults of each config): the compiled and the eager micro-batch draw the same masks
MODELS = {"gpt2": (_gpt2, _lm_loss), "llama": (_llama, _lm_loss), "bert": (_bert, _classify_loss)}


def _rows(n: int = 6, seed: int = 3) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"ids": torch.randint(0, 64, (n, 10), generator=g), "y": torch.randint(0, 3, (n,), generator=g)}


def _setup(name: str, grouping: str = "layer", fn: str = "abadi"):
    make, loss = MODELS[name]
    torch.manual_seed(0)
    model = make()
    engine = DPEngine(model, {"grouping": grouping, "fn": fn, "threshold": {"kind": "fixed", "value": 0.05}},
                      gradient_noise_multiplier=0.0, expected_batch_size=8)
    engine.backward(loss(model, _rows(seed=1)))   # the first micro-batch: probed and certified
    engine.debug_clipped()
    return model, loss, engine


@pytest.mark.slow   # the default run compiles GPT-2 with fullgraph=True below, which raises at any break
@pytest.mark.parametrize("name", list(MODELS))
def test_the_compiled_micro_batch_traces_as_one_graph_without_breaks(name):
    model, loss, engine = _setup(name)
    graphs, breaks, reasons = CompiledMicroBatch(engine, model, loss, backend="aot_eager").graph_breaks(_rows(), 6)
    assert (graphs, breaks) == (1, 0), reasons
    engine.detach()


@pytest.mark.slow   # 12 s a model; the default run compiles the layer rules' examples and make_private's models
@pytest.mark.parametrize("name", list(MODELS))
def test_compiled_clipped_sums_equal_the_eager_engines_within_1e_5(name):
    """Noise off, the same rows and random state (dropout on): the compiled micro-batch's sums and
    norms are the eager engine's within 1e-5 relative (the rounding of the same sums in another order)."""
    model, loss, engine = _setup(name, grouping="block" if name == "gpt2" else "layer",
                                 fn="auto" if name == "gpt2" else "abadi")
    rows = _rows()
    state = torch.random.get_rng_state()
    engine.backward(loss(model, rows))
    eager = engine.debug_clipped()
    compiled = CompiledMicroBatch(engine, model, loss, backend="aot_eager")
    torch.random.set_rng_state(state)
    with compiled.probed():
        sums, norms, clipped, suspect, _ = compiled.compiled(rows, torch.ones(6), engine.thresholds, None)
    assert not bool(suspect)
    torch.testing.assert_close(norms, eager.norms, rtol=1e-5, atol=0)
    for (name_, want), got in zip(eager.sums.items(), sums):
        got = got * engine.expected_batch_size   # the engine's sums carry 1/B; debug_clipped undoes it
        assert (got - want).norm() <= 1e-5 * want.norm(), name_
    assert bool((norms > 0.05).any()) and bool((norms < 0.05).any()) or name == "gpt2"   # abadi clips some, not all
    engine.detach()


def _float64_gpt2():
    return tiny_gpt2()   # tied wte/lm_head, (1, T) position ids shared by the batch, dropout 0


def test_compiled_step_releases_the_per_example_reference():
    """The compiled micro-batches (after the first, which the engine runs and the compiled one must
    match) give p.grad = (Σ_i clip(g_i)) / B of the per-example loop, tied embedding and shared
    position ids included, at float64's precision."""
    batch = gpt2_batch(n=9)
    ref_model = _float64_gpt2()
    per = per_example_grads(ref_model, gpt2_loss, batch)
    engine_model = _float64_gpt2()
    engine = DPEngine(engine_model, {"grouping": "layer", "threshold": {"kind": "fixed", "value": 0.5}},
                      gradient_noise_multiplier=0.0, expected_batch_size=11)
    groups = engine.groups
    thresholds = engine.thresholds.tolist()   # 0.5 split over the groups
    ref = clip_reference(groups, per, thresholds, "abadi", 11)
    compiled = CompiledMicroBatch(engine, engine_model, gpt2_loss, backend=None)
    for start in (0, 3, 6):   # the first through the engine (and compared), then compiled
        compiled({k: v[start:start + 3] for k, v in batch.items()}, 3)
    assert len(compiled.verified) == 1
    engine.privatize()
    for info in engine.groups.params:
        torch.testing.assert_close(info.param.grad, ref.grads[info.name], rtol=1e-9, atol=1e-12)
    norms, limit = group_norms(per, groups), torch.tensor(thresholds, dtype=DTYPE)
    assert bool((norms > limit).any()) and bool((norms < limit).any())   # some clipped, some not
    engine.detach()


def test_a_suspect_compiled_micro_batch_is_redone_by_the_engine(monkeypatch):
    """A flagged micro-batch (a norm the cancellation check cannot vouch for, or a non-finite one)
    is not taken from the graph: the engine redoes it, with its float64 rows and its non-finite rule."""
    model = _float64_gpt2()
    engine = DPEngine(model, {"grouping": "all-layer", "threshold": {"kind": "fixed", "value": 0.5}},
                      gradient_noise_multiplier=0.0, expected_batch_size=4)
    compiled = CompiledMicroBatch(engine, model, gpt2_loss, backend=None)
    batch = gpt2_batch(n=4)
    compiled({"ids": batch["ids"][:2]}, 2)
    clean = compiled.compiled
    through_engine = []

    def flagged(*args):
        sums, norms, clipped, _, losses = clean(*args)
        return [None if s is None else s * 0 + float("nan") for s in sums], norms, clipped, torch.tensor(True), losses
    monkeypatch.setattr(compiled, "compiled", flagged)
    monkeypatch.setattr(engine, "backward", lambda *a, **k: through_engine.append(1) or DPEngine.backward(
        engine, *a, **k))
    compiled({"ids": batch["ids"][2:]}, 2)
    assert through_engine == [1]
    assert all(bool(torch.isfinite(s).all()) for s in engine.debug_clipped().sums.values())
    engine.detach()


class _Scale(nn.Module):
    """A module without a layer rule (the torch.func fallback's kind): a per-feature scale."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 5))

    def forward(self, x, shift=None):
        return x * self.scale if shift is None else x * self.scale + shift


def _scaled_net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 5), _Scale(), nn.Tanh(), nn.Linear(5, 3))


def _scaled_loss(model, batch):
    return F.cross_entropy(model(batch["x"]), batch["y"], reduction="none")


def _scaled_rows(seed):
    g = torch.Generator().manual_seed(seed)
    return {"x": torch.randn(6, 5, generator=g) * 3, "y": torch.randint(0, 3, (6,), generator=g)}


def test_a_module_without_a_layer_rule_is_compiled_by_a_per_sample_vjp_as_the_engine_clips_it():
    model = _scaled_net()
    engine = DPEngine(model, {"grouping": "layer", "threshold": {"kind": "fixed", "value": 0.3}},
                      gradient_noise_multiplier=0.0, expected_batch_size=6)
    compiled = CompiledMicroBatch(engine, model, _scaled_loss, backend="aot_eager")
    compiled(_scaled_rows(1), 6)   # through the engine, and the graph compared with it: equal, or refused
    assert len(compiled.verified) == 1
    engine.debug_clipped()
    rows = _scaled_rows(2)
    engine.backward(_scaled_loss(model, rows))
    eager = engine.debug_clipped()
    with compiled.probed():
        sums, norms, *_ = compiled.compiled(rows, torch.ones(6), engine.thresholds, None)
    torch.testing.assert_close(norms, eager.norms, rtol=1e-5, atol=0)
    assert (sums[2] * 6 - eager.sums["1.scale"]).norm() <= 1e-5 * eager.sums["1.scale"].norm()
    engine.detach()


def test_a_module_without_a_layer_rule_called_otherwise_than_with_one_batch_tensor_is_refused():
    class Shifted(nn.Module):
        def __init__(self):
            super().__init__()
            self.inp, self.scale, self.out = nn.Linear(5, 5), _Scale(), nn.Linear(5, 3)

        def forward(self, x):
            return self.out(torch.tanh(self.scale(self.inp(x), shift=x)))

    model = Shifted()
    engine = DPEngine(model, {"threshold": {"kind": "fixed", "value": 1.0}}, gradient_noise_multiplier=1.0,
                      expected_batch_size=6)
    compiled = CompiledMicroBatch(engine, model, _scaled_loss, backend="aot_eager")
    with pytest.raises(EngineError) as info:
        compiled(_scaled_rows(1), 6)
    assert "no layer rule" in str(info.value) and "training.compile: false" in info.value.hint and "compile=False" in info.value.hint
    assert all(p.grad is None for p in model.parameters())
    engine.detach()


def test_a_model_torch_compile_cannot_trace_is_refused_with_a_hint_before_noise():
    """A forward dynamo cannot take whole (here an explicit graph break; gradient checkpointing's
    logging is one in the zoo) stops the step at its first compiled call with error and hint."""
    class Breaks(nn.Module):
        def __init__(self):
            super().__init__()
            self.inp, self.out = nn.Linear(5, 4), nn.Linear(4, 3)

        def forward(self, x):
            h = torch.tanh(self.inp(x))
            torch._dynamo.graph_break()
            return self.out(h)

    model = Breaks()
    engine = DPEngine(model, {"threshold": {"kind": "fixed", "value": 1.0}}, gradient_noise_multiplier=1.0,
                      expected_batch_size=4)
    compiled = CompiledMicroBatch(engine, model, lambda m, b: F.cross_entropy(m(b["x"]), b["y"], reduction="none"),
                                  backend="aot_eager")
    g = torch.Generator().manual_seed(0)
    with pytest.raises(EngineError, match="could not compile") as info:
        compiled({"x": torch.randn(4, 5, generator=g), "y": torch.randint(0, 3, (4,), generator=g)}, 4)
    assert "training.compile: false" in info.value.hint and "compile=False" in info.value.hint and not compiled.verified
    assert all(p.grad is None for p in model.parameters())
    engine.detach()


def _compiled_net(noise_multiplier: float):
    """Net under layer-wise clipping at 0.5 (expected batch 6), its engine, their compiled micro-batch
    (aot_eager) and a generator for its rows."""
    torch.manual_seed(0)
    model = Net()
    engine = DPEngine(model, {"grouping": "layer", "threshold": {"kind": "fixed", "value": 0.5}},
                      gradient_noise_multiplier=noise_multiplier, expected_batch_size=6)
    return model, engine, CompiledMicroBatch(engine, model, _loss, backend="aot_eager"), torch.Generator().manual_seed(0)


def test_a_steady_compiled_step_reads_the_device_twice_the_suspect_flag_and_the_noise_stds(monkeypatch):
    """Issue 54's count of host round trips, on the CPU: after its first (checked) micro-batch, a
    compiled micro-batch and privatize read values back from the device twice: the suspect flag
    after the graph and the noise stds (one read per step, not one per parameter). A new .item(),
    .tolist() or branch on a tensor's value in the step shows here."""
    model, engine, compiled, g = _compiled_net(noise_multiplier=1.0)

    def rows():
        return {"x": torch.randn(6, 4, 5, generator=g), "y": torch.randint(0, 3, (6,), generator=g)}
    for _ in range(2):   # the first: through the engine and the graph, compared; then the graph
        compiled(rows(), 6)
        engine.privatize()
    batch, reads = rows(), []
    for name in ("item", "tolist", "__bool__", "__float__", "__int__", "__index__", "cpu", "numpy"):
        real = getattr(torch.Tensor, name)

        def counted(self, *args, _name=name, _real=real, **kwargs):
            caller = traceback.extract_stack(limit=2)[0]
            reads.append((Path(caller.filename).name, caller.name, _name))
            return _real(self, *args, **kwargs)
        monkeypatch.setattr(torch.Tensor, name, counted)
    compiled(batch, 6)
    engine.privatize()
    monkeypatch.undo()
    assert sorted(reads) == [("compiled.py", "__call__", "__bool__"), ("privatizer.py", "release", "tolist")]
    engine.detach()


def _rule_examples():
    from dpclip.engine.layers import registered_rules
    rules = {id(r): r for r in registered_rules().values()}.values()
    fast = {"conv", "multihead_attention", "embedding_bag"}   # in the default run: one example each
    return [pytest.param(example, rule.name, id=f"{rule.name}-{type(example.module).__name__}-{j}",
                         marks=[] if rule.name in fast and j == 0 else pytest.mark.slow)
            for rule in rules for j, example in enumerate(rule.examples())]


@pytest.mark.parametrize("example, rule", _rule_examples())
def test_every_layer_rules_examples_compile_as_the_engine_clips_them_or_are_refused_with_a_hint(example, rule):
    """Each registered layer rule's own examples through the compiled micro-batch: its first call runs
    the engine and the graph on the same rows and must find them equal (within 1e-4; else refused),
    after which the shape is compiled. EmbeddingBag's bags are ragged (sizes read from the offsets'
    values), which a graph of fixed shapes cannot take: refused with the hint."""
    names, Wrapped = example_model(example)
    model = Wrapped()
    with torch.no_grad():
        width = model(*example.inputs).flatten(1).shape[1]
    weights = torch.randn(width, generator=torch.Generator().manual_seed(99), dtype=example.inputs[0].dtype
                          if example.inputs[0].is_floating_point() else DTYPE)

    def loss(m, batch):
        out = m(*[batch[n] for n in names]).flatten(1)
        return torch.tanh(out) @ weights.to(out.dtype) + 0.1 * out.pow(2).sum(1)
    batch = example.inputs[0].shape[0]
    engine = DPEngine(model, {"grouping": "all-layer", "threshold": {"kind": "fixed", "value": 1.0}},
                      gradient_noise_multiplier=0.0, expected_batch_size=batch)
    compiled = CompiledMicroBatch(engine, model, loss, backend="aot_eager")
    if rule == "embedding_bag":
        with pytest.raises(EngineError, match="torch.compile could not compile") as info:
            compiled(dict(zip(names, example.inputs)), batch)
        assert "compile=False" in info.value.hint and not compiled.verified
    else:
        compiled(dict(zip(names, example.inputs)), batch)
        assert compiled.verified   # the graph agreed with the engine on the same rows
    engine.detach()


def test_a_batch_shape_past_the_compiled_steps_limit_is_refused_with_a_hint(monkeypatch):
    """Past its limit of graphs, the compiled step refuses the new shape (nothing released) and says
    to pad or turn compile off; here the limit is lowered to 1 shape."""
    import torch._dynamo.config as dynamo_config

    import dpclip.torch_compat as torch_compat
    monkeypatch.setattr(torch_compat, "COMPILED_SHAPES_LIMIT", 1)
    # torch's own patch restores the value; pytest's monkeypatch would delete the attribute on undo
    # (it is in no __dict__), hiding it from every later test in the process
    with dynamo_config.patch(recompile_limit=1):
        model, engine, compiled, g = _compiled_net(noise_multiplier=0.0)
        compiled({"x": torch.randn(6, 4, 5, generator=g), "y": torch.randint(0, 3, (6,), generator=g)}, 6)
        assert compiled.verified
        with pytest.raises(EngineError, match="batch shapes") as info:
            compiled({"x": torch.randn(5, 4, 5, generator=g), "y": torch.randint(0, 3, (5,), generator=g)}, 5)
        assert "pad batches" in info.value.hint and "compile=False" in info.value.hint
        engine.detach()
