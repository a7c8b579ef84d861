"""The model families people fine-tune in 2026 (issue 52), at tiny size: gradient checkpointing
so far (docs/engine.md, "Gradient checkpointing"). Tagged like issue 49's cases: the slow suite
runs all of their runs (tests/engine/test_hf_zoo.py)."""

from __future__ import annotations

import torch
import transformers as tf
from torch import nn
from torch.utils.checkpoint import checkpoint

from tests.engine.zoo import Case, seeded
from tests.engine.zoo.hf import EAGER, P, V, causal_loss, cls_batch, cls_loss, lm_batch
from tests.engine.zoo.outside import D, read_loss, register, seq

_SMALL = dict(vocab_size=V, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
              max_position_embeddings=P)


def checkpointed(make):
    """A transformers model with activation checkpointing on (non-reentrant, its default), in
    training mode: transformers checkpoints only while training (its dropout is 0 here)."""
    def build():
        model = seeded(make)()
        model.activation_checkpointing_enable()
        return model.train()
    return build


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(D), nn.Linear(D, 2 * D), nn.Linear(2 * D, D)

    def forward(self, x):
        return x + self.down(torch.tanh(self.up(self.norm(x))))


class CheckpointedBlocks(nn.Module):
    """Two blocks under torch.utils.checkpoint, one of them called twice (a tied block)."""

    reentrant = False

    def __init__(self):
        super().__init__()
        self.inp, self.blocks, self.head = nn.Linear(D, D), nn.ModuleList([Block(), Block()]), nn.Linear(D, 4)

    def forward(self, x):
        h = self.inp(x)
        for block in (self.blocks[0], self.blocks[1], self.blocks[0]):
            h = checkpoint(block, h, use_reentrant=self.reentrant)
        return self.head(h)


class ReentrantBlocks(CheckpointedBlocks):
    reentrant = True


register(Case("checkpointed-blocks", "pattern", "torch.utils.checkpoint (non-reentrant) around blocks, one tied",
              seeded(CheckpointedBlocks), seq, read_loss))
register(Case("checkpoint-reentrant", "pattern", "torch.utils.checkpoint with use_reentrant=True",
              seeded(ReentrantBlocks), seq, read_loss))
register(Case("gpt2-checkpointed", "hf", "GPT-2 with activation_checkpointing_enable()", checkpointed(
    lambda: tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=V, n_embd=16, n_layer=2, n_head=2, n_positions=P,
                                             resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **EAGER))),
    lm_batch, causal_loss))
register(Case("llama-checkpointed", "hf", "Llama with activation_checkpointing_enable()", checkpointed(
    lambda: tf.LlamaForCausalLM(tf.LlamaConfig(**_SMALL, num_key_value_heads=1, **EAGER))), lm_batch, causal_loss))
register(Case("bert-checkpointed", "hf", "BERT classifier with activation_checkpointing_enable()", checkpointed(
    lambda: tf.BertForSequenceClassification(tf.BertConfig(**_SMALL, hidden_dropout_prob=0.0,
                                                           attention_probs_dropout_prob=0.0, num_labels=3,
                                                           **EAGER))), cls_batch, cls_loss))
