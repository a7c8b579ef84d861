"""Gradient checkpointing (docs/supported-models.md, "Gradient checkpointing"): the engine's book-kept
operations run again when torch.utils.checkpoint recomputes a block in the backward, and the
per-sample clipping is the per-example reference's, in either reentrant setting (reentrant: the
forward's calls run without gradients and the recomputation's backward delivers the uses)."""

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


def _checkpointed(reentrant: bool = False):
    def make():
        torch.manual_seed(0)
        return Checkpointed(reentrant).to(DTYPE)
    return make


def _tokens_loss(model, batch):
    return F.cross_entropy(model(batch["ids"]), batch["y"], reduction="none")


def _tokens(n=5, seed=6):
    g = torch.Generator().manual_seed(seed)
    return {"ids": torch.randint(0, 11, (n, 4), generator=g), "y": torch.randint(0, 3, (n,), generator=g)}


def _hf(factory, reentrant: bool = False):
    def make():
        model = factory()
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": reentrant})
        model.train()   # transformers checkpoints only in training mode
        return model
    return make


CASES = {"blocks": (_checkpointed(), _tokens_loss, _tokens), "gpt2": (_hf(tiny_gpt2), gpt2_loss, gpt2_batch),
         "bert": (_hf(tiny_bert), bert_loss, bert_batch),
         "blocks-reentrant": (_checkpointed(True), _tokens_loss, _tokens),
         "gpt2-reentrant": (_hf(tiny_gpt2, True), gpt2_loss, gpt2_batch),
         "bert-reentrant": (_hf(tiny_bert, True), bert_loss, bert_batch)}


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


@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpointing_changes_no_gradient_of_the_step(reentrant):
    """Equal up to float64 rounding: reentrant recomputation delivers the uses in another order."""
    torch.manual_seed(0)
    plain = Checkpointed().to(DTYPE)
    checkpointed = Checkpointed(reentrant).to(DTYPE)
    checkpointed.load_state_dict(plain.state_dict())
    plain.forward = lambda ids: plain.head(plain.blocks[0](plain.blocks[1](plain.blocks[0](plain.emb(ids))))).mean(1)
    batch = _tokens()
    for model in (plain, checkpointed):
        _step(model, batch)
    for (name, a), b in zip(plain.named_parameters(), checkpointed.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-12, atol=1e-15, msg=name)


def _reformer():
    from transformers import ReformerConfig, ReformerModelWithLMHead
    torch.manual_seed(0)
    config = ReformerConfig(vocab_size=40, hidden_size=16, num_attention_heads=2, attention_head_size=8,
                            attn_layers=["lsh", "local"], feed_forward_size=32, axial_pos_embds=False,
                            max_position_embeddings=16, local_attn_chunk_length=4, lsh_attn_chunk_length=4,
                            num_buckets=2, num_hashes=1, is_decoder=True, hidden_dropout_prob=0.0,
                            attention_probs_dropout_prob=0.0, lsh_attention_probs_dropout_prob=0.0,
                            local_attention_probs_dropout_prob=0.0, pad_token_id=0, eos_token_id=1)
    return ReformerModelWithLMHead(config).to(DTYPE).train()   # reversible layers train only in training mode


def _reformer_loss(model, batch):
    logits = model(input_ids=batch["ids"]).logits[:, :-1]
    return F.cross_entropy(logits.transpose(1, 2), batch["ids"][:, 1:], reduction="none").mean(1)


@pytest.mark.parametrize("grouping, norm_method", [("all-layer", "auto"), ("param", "ghost")])
def test_reformer_reversible_layers_clip_as_the_per_example_reference(grouping, norm_method):
    """Reformer's layers run without gradients in the forward and are recomputed from their outputs
    in the backward, which runs a backward of its own into the parameters: the recomputation's calls
    deliver the uses; the certificate's replay reaches them with the parameters swapped again."""
    g = torch.Generator().manual_seed(3)
    batch = {"ids": torch.randint(2, 40, (5, 8), generator=g)}
    engine, _, _ = check_exact(_reformer, _reformer_loss, batch, grouping=grouping, norm_method=norm_method,
                               micro=[2, 3])
    assert engine.certificate.checks >= 1


def test_a_forward_recomputed_by_hand_and_differentiated_is_refused():
    """A module's forward run again in the backward and differentiated, although its first call
    had gradients (no checkpoint): its uses would count twice."""

    class Again(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin, self.head = nn.Linear(4, 4), nn.Linear(4, 1)

        def forward(self, x):
            return self.head(_RecomputeInBackward.apply(self.lin(x), x, self.lin)).squeeze(1)

    torch.manual_seed(0)
    model = Again()
    engine = DPEngine(model, {"grouping": "all-layer"}, gradient_noise_multiplier=0.0, expected_batch_size=3)
    with pytest.raises(EngineError, match="count twice"):
        engine.backward(model(torch.randn(3, 4)) ** 2)
    assert all(p.grad is None for p in model.parameters())


class _GradlessInput(nn.Module):
    """A reentrant checkpoint around the first layer, called on the data (which needs no gradient)."""

    def __init__(self, reentrant: bool):
        super().__init__()
        self.first, self.head, self.reentrant = nn.Linear(4, 8), nn.Linear(8, 3), reentrant

    def forward(self, x):
        return self.head(torch.tanh(checkpoint(self.first, x, use_reentrant=self.reentrant)))


def test_a_reentrant_checkpoint_on_inputs_without_gradient_is_refused_with_a_hint_naming_it():
    """torch never runs such a block's backward, so its parameters would get no gradient: the
    certificate refuses the step, and its hint names the checkpoint and use_reentrant=False."""
    torch.manual_seed(0)
    model = _GradlessInput(reentrant=True)
    x, y = torch.randn(4, 4), torch.tensor([0, 1, 2, 0])
    engine = DPEngine(model, {"grouping": "all-layer"}, gradient_noise_multiplier=0.0, expected_batch_size=4)
    with pytest.warns(UserWarning, match="None of the inputs"), pytest.raises(EngineError) as refused:
        engine.backward(F.cross_entropy(model(x), y, reduction="none"))
    assert "first.weight" in refused.value.message
    assert "use_reentrant=True" in refused.value.hint and "use_reentrant=False" in refused.value.hint


def test_the_same_block_checkpointed_without_reentrancy_trains():
    torch.manual_seed(0)
    model = _GradlessInput(reentrant=False)
    engine = DPEngine(model, {"grouping": "all-layer"}, gradient_noise_multiplier=0.0, expected_batch_size=4)
    engine.backward(F.cross_entropy(model(torch.randn(4, 4)), torch.tensor([0, 1, 2, 0]), reduction="none"))
    engine.privatize()
    assert model.first.weight.grad is not None and model.first.weight.grad.abs().sum() > 0


class _RecomputeInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, x, module):
        ctx.save_for_backward(x)
        ctx.module = module
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        with torch.enable_grad():
            again = ctx.module(x.detach())
        torch.autograd.backward(again, grad)
        return grad, None, None


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
