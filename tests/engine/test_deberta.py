"""DeBERTa-v2: exact without relative-position projections, refused by name with them.

With relative attention, ``DisentangledSelfAttention`` runs ``query_proj(rel.unsqueeze(0))``
on the relative-position table (shared by all samples) and ``.repeat``s the result over the
batch: the samples' gradients of that use are summed inside the model. It used to crash
with an internal shape error; now the engine refuses it before any forward.
"""

import pytest
import torch
import torch.nn.functional as F

from dpclip.engine import DPEngine
from dpclip.errors import EngineError
from tests.engine.conftest import DTYPE, check_exact


def _deberta_v2(**overrides):
    from transformers import DebertaV2Config, DebertaV2ForSequenceClassification
    cfg = DebertaV2Config(vocab_size=30, hidden_size=16, num_hidden_layers=1,
                          num_attention_heads=2, intermediate_size=24,
                          max_position_embeddings=16, hidden_dropout_prob=0.0,
                          attention_probs_dropout_prob=0.0, num_labels=3, **overrides)
    torch.manual_seed(0)
    return DebertaV2ForSequenceClassification(cfg).to(DTYPE)


def classify_loss(model, batch):
    return F.cross_entropy(model(input_ids=batch["ids"]).logits, batch["y"], reduction="none")


@pytest.mark.parametrize("n,t", [(3, 5), (4, 4), (5, 4), (1, 4)],
                         ids=["B!=T", "B==T", "B==T+1", "B1"])
def test_deberta_v2_without_relative_projections_is_exact(n, t):
    g = torch.Generator().manual_seed(n + 10 * t)
    batch = {"ids": torch.randint(0, 30, (n, t), generator=g),
             "y": torch.randint(0, 3, (n,), generator=g)}
    check_exact(_deberta_v2, classify_loss, batch, "layer", fn="auto" if n == 1 else "abadi")


@pytest.mark.parametrize("pos_att_type", [["p2c", "c2p"], ["c2p"]])
def test_deberta_v2_relative_position_projections_are_refused_naming_the_module(pos_att_type):
    model = _deberta_v2(relative_attention=True, position_buckets=4, pos_att_type=pos_att_type,
                        norm_rel_ebd="layer_norm")
    with pytest.raises(EngineError) as err:
        DPEngine(model, {}, expected_batch_size=4)
    assert "encoder.layer.0.attention.self (DisentangledSelfAttention)" in err.value.message
    assert "pos_att_type" in err.value.hint
    assert "forward" not in model.deberta.embeddings.word_embeddings.__dict__  # nothing installed
