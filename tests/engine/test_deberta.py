"""DeBERTa-v2 and -v3: exact with and without relative attention (docs/supported-models.md, "Learned
tables shared by all samples").

With relative attention, the encoder reads its table ``rel_embeddings.weight`` (DeBERTa-v3:
through a LayerNorm), each ``DisentangledSelfAttention`` projects it (``pos_key_proj``, or its
own ``key_proj`` with ``share_att_key``) and ``.repeat``s the [H, 2k, d] result over the
batch (B·H rows, batch-outer). The projections get each sample's output gradient from that
tiling; the table and its LayerNorm are taken by the encoder's torch.func unit.
"""

import pytest
import torch
import torch.nn.functional as F

from dpclip.engine import DPEngine
from tests.engine.conftest import DTYPE, check_exact


def _deberta_v2(**overrides):
    from transformers import DebertaV2Config, DebertaV2ForSequenceClassification
    cfg = DebertaV2Config(**{**dict(vocab_size=30, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                    intermediate_size=24, max_position_embeddings=16, hidden_dropout_prob=0.0,
                                    attention_probs_dropout_prob=0.0, num_labels=3), **overrides})
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


RELATIVE = {"v2": dict(pos_att_type=["p2c", "c2p"]),
            "v2-c2p": dict(pos_att_type=["c2p"]),
            "v3": dict(pos_att_type=["p2c", "c2p"], share_att_key=True, norm_rel_ebd="layer_norm")}


@pytest.mark.parametrize("variant", sorted(RELATIVE))
@pytest.mark.parametrize("n,t,grouping", [(3, 5, "layer"), (4, 4, "all-layer"), (1, 4, "param")],
                         ids=["B!=T", "B==T", "B1"])
def test_deberta_relative_attention_clips_as_the_per_example_reference(variant, n, t, grouping):
    g = torch.Generator().manual_seed(n + 10 * t)
    batch = {"ids": torch.randint(0, 30, (n, t), generator=g), "y": torch.randint(0, 3, (n,), generator=g)}
    engine, _, _ = check_exact(lambda: _deberta_v2(relative_attention=True, position_buckets=4, num_hidden_layers=2,
                                                   **RELATIVE[variant]),
                               classify_loss, batch, grouping, fn="auto" if n == 1 else "abadi", micro=[2, n - 2] if n > 2 else None)
    assert engine.certificate.checks >= 1


def test_deberta_v3_table_and_its_layer_norm_are_taken_by_the_encoder():
    """Read without a call (the table) and fed a shared input that only feeds other layers (its
    LayerNorm): neither has a per-sample output gradient of its own; the encoder's torch.func
    unit recomputes each sample's call and differentiates them there."""
    model = _deberta_v2(relative_attention=True, position_buckets=4, **RELATIVE["v3"])
    engine = DPEngine(model, {"grouping": "layer"}, gradient_noise_multiplier=0.0, expected_batch_size=3)
    g = torch.Generator().manual_seed(0)
    engine.backward(classify_loss(model, {"ids": torch.randint(0, 30, (3, 4), generator=g),
                                          "y": torch.randint(0, 3, (3,), generator=g)}))
    assert sorted(engine._keeper.adopted) == ["deberta.encoder.LayerNorm (LayerNorm) -> deberta.encoder (DebertaV2Encoder)",
                                              "deberta.encoder.rel_embeddings (Embedding) -> deberta.encoder (DebertaV2Encoder)"]
    assert engine.certificate.checks == 1


@pytest.mark.parametrize("pos_att_type", [["p2c", "c2p"], ["c2p"]])
def test_deberta_v1_relative_attention_clips_as_the_per_example_reference(pos_att_type):
    """DeBERTa (v1) divides its position projection's output in place (``pos_query_layer /= s``): the
    shared output's chain takes the in-place op as one more link, replayed per sample."""
    from transformers import DebertaConfig, DebertaForSequenceClassification

    def make():
        torch.manual_seed(0)
        return DebertaForSequenceClassification(DebertaConfig(
            vocab_size=30, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=24,
            max_position_embeddings=16, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_labels=3,
            relative_attention=True, max_relative_positions=8, pos_att_type=pos_att_type)).to(DTYPE)
    g = torch.Generator().manual_seed(1)
    batch = {"ids": torch.randint(0, 30, (5, 6), generator=g), "y": torch.randint(0, 3, (5,), generator=g)}
    engine, _, _ = check_exact(make, classify_loss, batch, "layer", micro=[2, 3])
    assert engine.certificate.checks >= 1
