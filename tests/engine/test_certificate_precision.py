"""The certificate's rounding bound under bf16 autocast (dpclip/engine/certificate/verdict.py;
docs/certificate.md, "What it refuses")."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dpclip.engine.microbatch as microbatch
from dpclip.engine import DPEngine
from dpclip.errors import EngineError


def _engine(model, batch):
    clipping = {"grouping": "all-layer", "threshold": {"kind": "fixed", "value": 1.0}}
    return DPEngine(model, clipping, gradient_noise_multiplier=0.0, expected_batch_size=batch)


def _bf16_step(engine, losses_of):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        losses = losses_of()
    engine.backward(losses.float())
    return engine.privatize()


@pytest.mark.slow
def test_bf16_gradient_zero_in_exact_arithmetic_is_not_refused():
    """ESM C's attention query and key weights get no gradient from a sample of one repeated token in
    exact arithmetic (every position attends alike): in the batch bf16 gives 0, alone it gives rounding
    noise of about 10⁻⁴ of the sample's gradient. That noise is rounding, not a wrong clip."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(
        "esmc", vocab_size=64, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
        max_position_embeddings=18, num_key_value_heads=2, head_dim=8, pad_token_id=0, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, attn_implementation="eager")
    model = transformers.AutoModelForMaskedLM.from_config(config).eval()
    ids = torch.tensor([[1, 13, 40, 1], [1, 1, 0, 0], [1, 1, 58, 12], [1, 1, 0, 0], [1, 1, 1, 1]])   # the last:
    mask = (torch.arange(4) < torch.tensor([4, 2, 4, 2, 4])[:, None]).long()               # one token repeated
    labels = torch.tensor([[35, -100, -100, 23], [35, 6, -100, -100], [8, 20, -100, -100], [8, 23, -100, -100],
                           [17, 12, 48, 41]])

    def losses():
        logits = model(input_ids=ids, attention_mask=mask).logits.float()
        per_token = F.cross_entropy(logits.transpose(1, 2), labels.clamp_min(0), reduction="none")
        return (per_token * (labels >= 0)).sum(1) / (labels >= 0).sum(1)
    engine = _engine(model, 5)
    _bf16_step(engine, losses)
    assert engine.certificate.checks == 1


def test_bf16_wrong_clip_factor_by_a_few_percent_is_still_refused(monkeypatch):
    """The floor widened for bf16 is an eighth of the bound times the sample's whole gradient: a clip
    factor 8% off on one row still exceeds it on the parameters that carry the gradient."""
    real = microbatch.clip_factors

    def inflated(*args, **kwargs):
        factors = real(*args, **kwargs).clone()
        factors[0] *= 1.08
        return factors
    monkeypatch.setattr(microbatch, "clip_factors", inflated)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 3))
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(6, 5, generator=g), torch.randint(0, 3, (6,), generator=g)
    engine = _engine(model, 6)
    with pytest.raises(EngineError, match="certificate refused"):
        _bf16_step(engine, lambda: F.cross_entropy(model(x), y, reduction="none"))
