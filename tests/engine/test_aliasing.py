"""One tensor reachable under two module paths: every use counted once (docs/layer-rules.md,
"Aliased parameters").

BERT, RoBERTa and ALBERT masked-LM heads hold the decoder bias twice
(``predictions.bias is predictions.decoder.bias``); the head has no layer rule, so its
torch.func fallback used to differentiate through the decoder as well and the bias'
per-sample gradient came out doubled. Every case runs against the float64 per-example loop.
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dpclip.engine import DPEngine
from dpclip.errors import EngineError
from tests.engine.conftest import DTYPE, Gate, check_exact

GROUPINGS = ["all-layer", "layer", "param", {"uniform": 2}]
METHODS = ["auto", "ghost", "instantiate"]


class AliasedHead(nn.Module):
    """BERT's LM head in small: ``self.bias`` is ``self.decoder.bias``; the head has no rule."""

    def __init__(self, extra=False, use_alias=False):
        super().__init__()
        self.dense = nn.Linear(5, 6)
        self.decoder = nn.Linear(6, 4)
        self.bias = nn.Parameter(torch.linspace(-0.5, 0.5, 4))
        self.decoder.bias = self.bias
        # an own parameter besides the alias keeps the head a torch.func unit
        self.scale = nn.Parameter(torch.linspace(0.8, 1.2, 6)) if extra else None
        self.use_alias = use_alias

    def forward(self, x):
        h = torch.tanh(self.dense(x))
        if self.scale is not None:
            h = h * self.scale
        out = self.decoder(h)
        return out + self.bias if self.use_alias else out


def head_loss(model, batch):
    return F.cross_entropy(model(batch["x"]).transpose(1, 2), batch["y"], reduction="none").mean(1)


def head_batch(n=5, t=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"x": torch.randn(n, t, 5, generator=g, dtype=DTYPE),
            "y": torch.randint(0, 4, (n, t), generator=g)}


@pytest.mark.parametrize("grouping", GROUPINGS, ids=str)
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("extra", [False, True], ids=["alias-only", "with-own-param"])
def test_a_bias_held_by_parent_and_child_is_counted_once(grouping, method, extra):
    check_exact(lambda: AliasedHead(extra).to(DTYPE), head_loss, head_batch(), grouping,
                norm_method=method)


def test_the_head_holding_only_an_alias_is_not_a_fallback_unit():
    """The decoder owns the bias: strict mode accepts the head (it owns nothing else)."""
    model = AliasedHead().to(DTYPE)
    engine = DPEngine(model, {"strict": True}, expected_batch_size=4)
    assert "forward" not in model.__dict__   # the head's forward is its own
    engine.detach()


@pytest.mark.parametrize("extra", [False, True], ids=["alias-only", "with-own-param"])
def test_a_direct_use_of_the_alias_by_the_parent_is_refused_naming_both(extra):
    model = AliasedHead(extra, use_alias=True).to(DTYPE)
    engine = DPEngine(model, {}, expected_batch_size=4, gradient_noise_multiplier=1.0)
    with pytest.raises(EngineError) as err:
        engine.backward(head_loss(model, head_batch(n=3)))
    assert "bias" in err.value.message and "AliasedHead" in err.value.message
    assert err.value.hint


class SiblingTie(nn.Module):
    """A custom module (torch.func fallback) whose parameter is a sibling Linear's bias:
    two modules, two uses, each delivered by its own module."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(5, 6)
        self.gate = Gate(6)
        self.gate.scale = self.lin.bias
        self.out = nn.Linear(6, 3)

    def forward(self, x):
        return self.out(self.gate(torch.tanh(self.lin(x))).mean(1))


def sibling_loss(model, batch):
    return F.cross_entropy(model(batch["x"]), batch["y"], reduction="none")


@pytest.mark.parametrize("grouping", ["all-layer", "param"])
@pytest.mark.parametrize("method", METHODS)
def test_a_tensor_shared_by_two_sibling_modules_sums_both_uses(grouping, method):
    g = torch.Generator().manual_seed(1)
    batch = {"x": torch.randn(4, 3, 5, generator=g, dtype=DTYPE),
             "y": torch.randint(0, 3, (4,), generator=g)}
    check_exact(lambda: SiblingTie().to(DTYPE), sibling_loss, batch, grouping, norm_method=method)


# ------------------------------------------------------------ transformers MLM heads


def _mlm(kind):
    from transformers import (AlbertConfig, AlbertForMaskedLM, BertConfig, BertForMaskedLM,
                              RobertaConfig, RobertaForMaskedLM)
    common = dict(vocab_size=30, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                  intermediate_size=24, max_position_embeddings=24, hidden_dropout_prob=0.0,
                  attention_probs_dropout_prob=0.0)
    if kind == "bert":
        cls, cfg = BertForMaskedLM, BertConfig(**common)
    elif kind == "roberta":
        cls, cfg = RobertaForMaskedLM, RobertaConfig(**common, pad_token_id=1)
    else:
        cls, cfg = AlbertForMaskedLM, AlbertConfig(**common, embedding_size=8)
    torch.manual_seed(0)
    model = cls(cfg).to(DTYPE)
    head = {"bert": lambda m: m.cls.predictions, "roberta": lambda m: m.lm_head,
            "albert": lambda m: m.predictions}[kind](model)
    assert head.bias is head.decoder.bias    # the aliasing under test
    return model


def mlm_loss(model, batch):
    logits = model(input_ids=batch["ids"]).logits
    return F.cross_entropy(logits.transpose(1, 2), batch["labels"], reduction="none").mean(1)


def mlm_batch(n, t=5, seed=2):
    g = torch.Generator().manual_seed(seed)
    return {"ids": torch.randint(2, 30, (n, t), generator=g),
            "labels": torch.randint(2, 30, (n, t), generator=g)}


@pytest.mark.parametrize("kind", ["bert", "roberta", "albert"])
@pytest.mark.parametrize("grouping", ["all-layer", "layer", "param"])
def test_masked_lm_heads_count_the_decoder_bias_once(kind, grouping):
    check_exact(lambda: _mlm(kind), mlm_loss, mlm_batch(4), grouping)


@pytest.mark.parametrize("kind", ["bert", "roberta", "albert"])
@pytest.mark.parametrize("n", [1, 5, 6], ids=lambda n: f"B{n}")   # B = 1, B = T, B = T + 1
def test_masked_lm_heads_are_exact_at_every_batch_shape(kind, n):
    check_exact(lambda: _mlm(kind), mlm_loss, mlm_batch(n), "all-layer",
                fn="auto" if n == 1 else "abadi")   # one sample: no median to split at


@pytest.mark.parametrize("method", ["ghost", "instantiate"])
def test_bert_mlm_is_exact_with_every_norm_method_and_strict(method):
    check_exact(lambda: _mlm("bert"), mlm_loss, mlm_batch(3), "layer", norm_method=method,
                strict=True)
