"""Gradient checkpointing (docs/engine.md, "Gradient checkpointing"): the engine's book-kept
operations run again when torch.utils.checkpoint (use_reentrant=False) recomputes a block in the
backward, and the per-sample clipping is the per-example reference's; reentrant checkpointing
is refused with the fix in the hint."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from dpclip.engine import DPEngine
from dpclip.errors import EngineError
from tests.engine.conftest import (DTYPE, bert_batch, bert_loss, check_exact, gpt2_batch, gpt2_loss, tiny_bert,
                                   tiny_gpt2)


class Block(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(d), nn.Linear(d, 2 * d), nn.Linear(2 * d, d)

    def forward(self, x):
        return x + self.down(torch.tanh(self.up(self.norm(x))))


class Checkpointed(nn.Module):
    """Tokens through an embedding, two checkpointed blocks (one of them called twice: a tied
    block), and a head: the embedding's output needs a gradient, as in a transformer."""

    def __init__(self, reentrant: bool = False, d: int = 6):
        super().__init__()
        self.emb, self.blocks, self.head = nn.Embedding(11, d), nn.ModuleList([Block(d), Block(d)]), nn.Linear(d, 3)
        self.reentrant = reentrant

    def forward(self, ids):
        h = self.emb(ids)
        for block in (self.blocks[0], self.blocks[1], self.blocks[0]):
            h = checkpoint(block, h, use_reentrant=self.reentrant)
        return self.head(h).mean(1)


def _checkpointed():
    torch.manual_seed(0)
    return Checkpointed().to(DTYPE)


def _tokens_loss(model, batch):
    return F.cross_entropy(model(batch["ids"]), batch["y"], reduction="none")


def _tokens(n=5, seed=6):
    g = torch.Generator().manual_seed(seed)
    return {"ids": torch.randint(0, 11, (n, 4), generator=g), "y": torch.randint(0, 3, (n,), generator=g)}


def _hf(factory):
    def make():
        model = factory()
        model.activation_checkpointing_enable()   # non-reentrant: transformers' default
        model.train()   # transformers checkpoints only in training mode
        return model
    return make


CASES = {"blocks": (_checkpointed, _tokens_loss, _tokens), "gpt2": (_hf(tiny_gpt2), gpt2_loss, gpt2_batch),
         "bert": (_hf(tiny_bert), bert_loss, bert_batch)}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("grouping, norm_method", [("all-layer", "auto"), ("layer", "ghost"),
                                                   ("param", "instantiate")])
def test_checkpointed_model_clips_as_the_per_example_reference(case, grouping, norm_method):
    factory, loss_fn, batch = CASES[case]
    engine, _, _ = check_exact(factory, loss_fn, batch(), grouping=grouping, norm_method=norm_method, micro=[2, 3])
    assert engine.certificate.checks >= 1


def _step(model, batch, **clipping):
    engine = DPEngine(model, {"grouping": "all-layer", "threshold": {"kind": "fixed", "value": 1.0}, **clipping},
                      gradient_noise_multiplier=0.0, expected_batch_size=5)
    engine.backward(_tokens_loss(model, batch))
    return engine, engine.privatize()


def test_checkpointing_changes_no_gradient_of_the_step():
    torch.manual_seed(0)
    plain = Checkpointed()
    checkpointed = Checkpointed()
    checkpointed.load_state_dict(plain.state_dict())
    plain.forward = lambda ids: plain.head(plain.blocks[0](plain.blocks[1](plain.blocks[0](plain.emb(ids))))).mean(1)
    batch = _tokens()
    for model in (plain, checkpointed):
        _step(model, batch)
    for (name, a), b in zip(plain.named_parameters(), checkpointed.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-6, atol=1e-9, msg=name)


def test_reentrant_checkpointing_is_refused_with_the_fix_in_the_hint():
    torch.manual_seed(0)
    model = Checkpointed(reentrant=True)
    with pytest.raises(EngineError, match="reentrant gradient checkpointing") as err:
        _step(model, _tokens())
    assert "use_reentrant=False" in err.value.hint
    assert all(p.grad is None for p in model.parameters())


def test_transformers_reentrant_checkpointing_is_refused_with_the_fix_in_the_hint():
    model = tiny_gpt2()
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": True})
    model.train()
    engine = DPEngine(model, {"grouping": "all-layer"}, gradient_noise_multiplier=0.0, expected_batch_size=5)
    with pytest.raises(EngineError, match="reentrant") as err:
        engine.backward(gpt2_loss(model, gpt2_batch()))
    assert "activation_checkpointing_enable()" in err.value.hint


def test_checkpointed_model_with_dropout_passes_the_certificate_on_the_replayed_batch():
    """The recomputation draws its dropout masks again in the backward, which a sample's replay
    alone cannot cut: the check replays the batch (its recomputation redraws the same masks)."""
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=50, n_positions=16,
                                       resid_pdrop=0.2, embd_pdrop=0.2, attn_pdrop=0.2)).to(DTYPE)
    model.activation_checkpointing_enable()
    model.train()
    engine = DPEngine(model, {"grouping": "layer"}, gradient_noise_multiplier=0.0, expected_batch_size=5)
    engine.backward(gpt2_loss(model, gpt2_batch()))
    report = engine.privatize()
    assert report.certificate is not None and report.certificate.mode == "batch"


class TwoWays(nn.Module):
    """One Linear called on [B, T, d] and on its transpose [T, B, d] inside one checkpoint: at
    B == T a recomputed call fits both layouts."""

    def __init__(self):
        super().__init__()
        self.lin, self.head = nn.Linear(4, 4), nn.Linear(4, 3)

    def block(self, x):
        return self.lin(x) + self.lin(x.transpose(0, 1)).transpose(0, 1)

    def forward(self, x):
        return self.head(checkpoint(self.block, x, use_reentrant=False)).mean(1)


def test_a_recomputed_call_that_fits_two_layouts_is_refused():
    torch.manual_seed(0)
    model = TwoWays()
    engine = DPEngine(model, {"grouping": "all-layer"}, gradient_noise_multiplier=0.0, expected_batch_size=4)
    x, y = torch.randn(4, 4, 4), torch.tensor([0, 1, 2, 0])
    with pytest.raises(EngineError, match="recomputed in the backward") as err:
        engine.backward(F.cross_entropy(model(x), y, reduction="none"))
    assert "lin" in err.value.message


class TimeFirst(nn.Module):
    """A Linear called on [T, B, d] inside a checkpoint: its batch axis is 1."""

    def __init__(self):
        super().__init__()
        self.lin, self.head = nn.Linear(4, 4), nn.Linear(4, 3)

    def block(self, x):
        return torch.tanh(self.lin(x.transpose(0, 1))).transpose(0, 1)

    def forward(self, x):
        return self.head(checkpoint(self.block, x, use_reentrant=False)).mean(1)


def test_a_recomputation_laid_out_batch_first_by_mistake_is_refused_by_the_certificate(monkeypatch):
    """Sabotage: the recomputed call given the batch-first layout instead of the forward's. At
    B == T the recomputed input has the shape the forward saved, so only the check can tell."""
    from dpclip.engine.batch_axis import state
    from dpclip.engine.batch_axis.layout import BATCH_FIRST

    torch.manual_seed(0)
    x, y = torch.randn(4, 4, 4), torch.tensor([0, 1, 2, 0])
    x[0] *= 30   # one sample's norm far above the others'
    for sabotaged in (False, True):
        if sabotaged:
            monkeypatch.setattr(state.BatchAxes, "recomputed_layout", lambda self, unit, leaves, batch: BATCH_FIRST)
        model = TimeFirst().double()
        engine = DPEngine(model, {"grouping": "all-layer", "threshold": {"kind": "fixed", "value": 0.1}},
                          gradient_noise_multiplier=0.0, expected_batch_size=4)
        losses = F.cross_entropy(model(x.double()), y, reduction="none")
        if not sabotaged:
            engine.backward(losses)   # the forward's layout: exact
            continue
        with pytest.raises(EngineError, match="certificate refused"):
            engine.backward(losses)


def test_a_checkpointed_block_keeps_no_activation_after_the_forward():
    """What checkpointing frees, the engine must not hold: a book-kept call keeps no reference to
    its input once it returns (the input of `down`, made inside the block, dies with the forward)."""
    import gc
    import weakref

    torch.manual_seed(0)
    model = Checkpointed().to(DTYPE)
    seen = []
    model.blocks[1].down.register_forward_pre_hook(lambda module, args: seen.append(weakref.ref(args[0])))
    engine = DPEngine(model, {"grouping": "all-layer"}, gradient_noise_multiplier=0.0, expected_batch_size=5)
    batch = _tokens()
    engine.backward(_tokens_loss(model, batch))   # the first step: probes and the certificate
    engine.privatize()
    seen.clear()
    losses = _tokens_loss(model, batch)
    gc.collect()
    assert seen and all(ref() is None for ref in seen)
    engine.backward(losses)
