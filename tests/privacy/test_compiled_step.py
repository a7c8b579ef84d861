"""The compiled micro-batch (training.compile, dpclip/engine/compiled.py) as an attacker sees it.

What leaves a compiled step is what leaves the eager one: the padding rows that give the graph its
one shape add nothing (their content cannot show in the release), and a graph that attributes
wrongly is caught at its first micro-batch by the engine's own, checked micro-batch on the same
rows, before any noise: no release ever comes from an unchecked graph.
"""

from __future__ import annotations

import pytest
import torch

from dpclip.engine import DPEngine
from dpclip.engine.compiled import CompiledMicroBatch
from dpclip.errors import EngineError
from tests.engine.conftest import gpt2_batch, gpt2_loss, tiny_gpt2


def test_padding_rows_add_nothing_to_a_compiled_micro_batch():
    model = tiny_gpt2()
    batch = gpt2_batch(n=4)
    results = []
    for filler in (0, 7):   # the padding row's content: any
        engine = DPEngine(model, {"grouping": "all-layer", "threshold": {"kind": "fixed", "value": 0.5}},
                          gradient_noise_multiplier=0.0, expected_batch_size=4)
        compiled = CompiledMicroBatch(engine, model, gpt2_loss, backend=None)
        compiled({"ids": batch["ids"][:2]}, 2)   # through the engine: verified
        padded = torch.cat([batch["ids"][2:], torch.full((1, batch["ids"].shape[1]), filler)])
        compiled({"ids": padded}, 2)            # 2 examples and one padding row
        results.append(engine.debug_clipped())
        engine.detach()
    for name, total in results[0].sums.items():
        torch.testing.assert_close(total, results[1].sums[name], rtol=0, atol=1e-14)
    assert results[0].norms.shape[0] == 4   # the padding row's norm is not observed


def test_a_compiled_micro_batch_that_differs_from_the_engines_is_refused_before_noise(monkeypatch):
    """A compiled clip that attributes wrongly (here: every parameter's sum doubled) is caught at its
    first micro-batch by the engine's, and nothing of the step can be released."""
    model = tiny_gpt2()
    engine = DPEngine(model, {"grouping": "all-layer", "threshold": {"kind": "fixed", "value": 0.5}},
                      gradient_noise_multiplier=1.0, expected_batch_size=4)
    compiled = CompiledMicroBatch(engine, model, gpt2_loss, backend=None)
    wrong = compiled.clip

    def doubled(*args):
        sums, *rest = wrong(*args)
        return ([None if s is None else 2 * s for s in sums], *rest)
    monkeypatch.setattr(compiled, "compiled", doubled)
    with pytest.raises(EngineError, match="differs from the engine's"):
        compiled(gpt2_batch(n=3), 3)
    assert not compiled.verified
    assert all(p.grad is None for p in model.parameters())
    engine.detach()


def test_make_private_compiled_refusals_do_not_name_the_drawn_batch_size():
    """A Poisson draw's size is private: make_private(compile=True)'s refusal of a batch it cannot
    compile (here an input holding the batch in dim 1) names what is wrong, not the input's shape,
    which would hold how many rows were drawn."""
    import re

    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    import dpclip
    from dpclip.errors import DpclipError

    def collate(rows):
        x = torch.stack([r[0] for r in rows])
        return {"x": x, "columns": x.T}, torch.stack([r[1] for r in rows])

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(5, 3)

        def forward(self, x, columns):
            return self.linear(x + columns.T)

    torch.manual_seed(0)
    model = Model()
    data = TensorDataset(torch.randn(60, 5), torch.arange(60) % 3)
    with pytest.warns(UserWarning, match="unsafe_seed"):
        private = dpclip.make_private(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                      DataLoader(data, batch_size=12, collate_fn=collate),
                                      criterion=nn.CrossEntropyLoss(), delta=1e-5, noise_multiplier=1.0, steps=2,
                                      max_grad_norm=1.0, compile=True, compile_backend="aot_eager", unsafe_seed=11)
    inputs, targets = next(iter(private.data_loader))
    drawn = len(targets)
    assert drawn not in (5, 12) and inputs["columns"].shape == (5, drawn)
    with pytest.raises(DpclipError, match="inputs:columns is a tensor without the batch in dim 0") as info:
        private.train_step(inputs, targets)
    assert not re.search(rf"\b{drawn}\b", str(info.value)) and private.ledger.steps == 0


class _Switched(torch.nn.Module):
    """A Python flag the forward reads (a curriculum switch): once set, ``lin1`` is called
    sequence-first, the same function, on [T, B, D] where T == B. torch.compile compiles a new graph
    for the same shapes; its attribution must be checked before use, as a new shape's is."""

    def __init__(self):
        super().__init__()
        self.lin1, self.lin2 = torch.nn.Linear(3, 3), torch.nn.Linear(3, 2)
        self.seq_first = False

    def forward(self, x):
        h = self.lin1(x.transpose(0, 1)).transpose(0, 1) if self.seq_first else self.lin1(x)
        return self.lin2(torch.tanh(h).mean(1))


def _switched_loss(model, rows):
    return torch.nn.functional.cross_entropy(model(rows["x"]), rows["y"], reduction="none")


def _compiled(model_class, threshold: float, sigma: float = 1.0, backend: str | None = "aot_eager"):
    """A fresh ``model_class`` (torch seeded 0), its engine at a fixed ``threshold`` (B = 4) and its
    compiled micro-batch on :func:`_switched_loss`."""
    torch.manual_seed(0)
    model = model_class()
    engine = DPEngine(model, {"threshold": {"kind": "fixed", "value": threshold}}, gradient_noise_multiplier=sigma,
                      expected_batch_size=4)
    return model, engine, CompiledMicroBatch(engine, model, _switched_loss, backend=backend)


def test_a_graph_compiled_again_for_a_checked_shape_is_checked_before_its_sums_are_used():
    model, engine, compiled = _compiled(_Switched, 0.01)
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(4, 1, 3, generator=g) * 10).expand(4, 4, 3).contiguous()
    rows = {"x": x, "y": torch.randint(0, 2, (4,), generator=g)}
    compiled(rows, 4)                      # the first graph: checked
    engine.privatize()
    compiled(rows, 4)                      # the same graph, not checked again
    assert engine.certificate.checks == 1
    engine.privatize()
    model.zero_grad(set_to_none=True)
    model.seq_first = True                 # a new graph for the same shapes: its micro-batch is checked
    with pytest.raises(EngineError, match="certificate refused"):
        compiled(rows, 4)
    assert all(p.grad is None for p in model.parameters())
    engine.detach()


def test_a_layer_unfrozen_after_the_engine_is_refused_by_a_compiled_micro_batch_too():
    model = tiny_gpt2()
    model.transformer.wte.requires_grad_(False)
    engine = DPEngine(model, {"grouping": "all-layer", "threshold": {"kind": "fixed", "value": 0.5}},
                      gradient_noise_multiplier=1.0, expected_batch_size=4)
    compiled = CompiledMicroBatch(engine, model, gpt2_loss, backend=None)
    batch = gpt2_batch(n=2)
    compiled(batch, 2)                     # verified against the engine
    model.transformer.wte.requires_grad_(True)
    with pytest.raises(EngineError, match="trainable now that were not"):
        compiled(batch, 2)
    engine.detach()


class _Flagged(torch.nn.Module):
    """A Python flag the forward reads and the engine's attribution does not depend on: setting it
    makes torch.compile compile a new graph for the same shapes."""

    def __init__(self):
        super().__init__()
        self.lin1, self.lin2 = torch.nn.Linear(3, 3), torch.nn.Linear(3, 2)
        self.flag = False

    def forward(self, x):
        h = torch.tanh(self.lin1(x))
        return self.lin2(h * 1.0 if self.flag else h)


@pytest.mark.slow   # 3.6 s: two aot_eager graphs
def test_a_graph_compiled_again_that_differs_from_the_engine_stays_refused_on_the_next_call():
    """A graph compiled again for a checked shape (a guard changed) that differs from the engine's
    micro-batch is refused; torch.compile keeps it cached, so the next call, which compiles nothing,
    must still check it rather than use its sums (here the flagged graph doubles every sum)."""
    model, engine, compiled = _compiled(_Flagged, 1.0)
    real = compiled.compiled

    def wrong_when_flagged(*args):
        sums, *rest = real(*args)
        return ([s if s is None or not model.flag else 2 * s for s in sums], *rest)
    compiled.compiled = wrong_when_flagged
    g = torch.Generator().manual_seed(1)
    rows = {"x": torch.randn(4, 3, generator=g), "y": torch.randint(0, 2, (4,), generator=g)}
    compiled(rows, 4)                      # the first graph: checked, equal
    engine.privatize()
    model.zero_grad(set_to_none=True)
    model.flag = True                      # a new graph, which differs: refused
    for _ in range(2):                     # and again: the cached graph is checked again, not used
        with pytest.raises(EngineError, match="differs from the engine's"):
            compiled(rows, 4)
        engine.step_accumulator.reset()
    assert all(p.grad is None for p in model.parameters())
    engine.detach()


def test_a_compiled_steps_noise_does_not_follow_torchs_global_seed():
    """The noise of a compiled step comes from the engine's private generator (OS entropy), never from
    torch's global generator, which a script's torch.manual_seed sets and which the graph's random
    operations draw from: two runs seeded alike release different gradients on the same rows."""
    released = []
    for _ in range(2):
        model, engine, compiled = _compiled(_Flagged, 1.0)
        g = torch.Generator().manual_seed(1)
        rows = {"x": torch.randn(4, 3, generator=g), "y": torch.randint(0, 2, (4,), generator=g)}
        compiled(rows, 4)                  # checked against the engine
        engine.privatize()
        model.zero_grad(set_to_none=True)
        compiled(rows, 4)                  # the graph's sums alone
        engine.privatize()
        released.append([p.grad.clone() for p in model.parameters()])
        engine.detach()
    for first, second in zip(*released):
        assert not torch.allclose(first, second)


class _Counting(torch.nn.Module):
    """A forward that counts itself in a saved buffer (written alike whatever the batch: the certificate
    passes it; the statement names it) and draws dropout."""

    def __init__(self):
        super().__init__()
        self.lin1, self.lin2 = torch.nn.Linear(3, 3), torch.nn.Linear(3, 2)
        self.register_buffer("forwards", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        self.forwards += 1
        return self.lin2(torch.nn.functional.dropout(torch.tanh(self.lin1(x)), 0.5))


def test_the_saved_state_and_torchs_generator_after_compiled_micro_batches_are_the_engines():
    """The compiled step runs some micro-batches twice, the graph and the engine (the first of each shape,
    and one the graph flags: which is flagged depends on the rows). Only the run whose sums enter the step
    may leave anything: after each micro-batch the saved buffers and torch's generator are where the eager
    engine alone leaves them, so the checkpoint does not tell which micro-batches were redone."""
    def run(compile: bool):
        model, engine, compiled = _compiled(_Counting, 1.0, sigma=0.0, backend=None)
        clean = compiled.compiled

        def flagged_third(*args):   # the third micro-batch's graph flags a row it cannot vouch for
            sums, norms, clipped, suspect, losses = clean(*args)
            return sums, norms, clipped, suspect | (int(model.forwards) == 3), losses
        compiled.compiled = flagged_third
        g = torch.Generator().manual_seed(1)
        seen = []
        for _ in range(4):
            rows = {"x": torch.randn(4, 3, generator=g), "y": torch.randint(0, 2, (4,), generator=g)}
            if compile:
                compiled(rows, 4)
            else:
                engine.backward(_switched_loss(model, rows))
            seen.append((int(model.forwards), torch.random.get_rng_state()))
        engine.detach()
        return seen
    for (count, state), (eager_count, eager_state) in zip(run(True), run(False)):
        assert count == eager_count
        assert torch.equal(state, eager_state)


@pytest.mark.slow   # two aot_eager graphs, as the flagged graph's test
def test_a_hook_added_after_a_graph_was_checked_is_checked_before_its_sums_are_used():
    """torch.compile does not guard a module's hooks by default: a forward hook registered on a layer
    after its graph was checked would leave the cached graph, run without the hook, giving the sums of
    a model that no longer exists. The graph is compiled again with the hook, and checked: here the
    hook changes the layer's output, which the certificate refuses before any noise."""
    model, engine, compiled = _compiled(_Flagged, 1.0)
    g = torch.Generator().manual_seed(1)
    rows = {"x": torch.randn(4, 3, generator=g), "y": torch.randint(0, 2, (4,), generator=g)}
    compiled(rows, 4)                      # the first graph: checked
    engine.privatize()
    model.zero_grad(set_to_none=True)
    model.lin1.register_forward_hook(lambda module, args, out: out * 3.0)
    with pytest.raises(EngineError, match="forward hooks"):
        compiled(rows, 4)
    assert all(p.grad is None for p in model.parameters())
    engine.detach()
