"""transformers model types the zoo's cross product does not cover, each judged in one run per
shape family it needs (fp32, the auto norm method, all-layer grouping: tests/engine/zoo/judge.py
against the float64 per-example loop), not in the slow suite's cross product (issue 52, rev44):
a verdict of its own each, exact or refused with its reason.

- XLM expands its shared position embeddings to the tokens with ``expand_as``, a broadcast over
  the batch like ``expand`` (refused as "not a broadcast" before);
- the time-series transformer's mean scaler gives a series with no observed value the batch's
  mean scale: exact while every series has one, refused (naming the scaler) once one has none.
"""

from __future__ import annotations

import pytest
import torch
import transformers as tf

from tests.engine.zoo import CASES, Case, floats, readout, seeded
from tests.engine.zoo.hf import P, V, causal_loss, lm_batch
from tests.engine.zoo.judge import judge


def _xlm():
    return tf.XLMWithLMHeadModel(tf.XLMConfig(vocab_size=V, emb_dim=16, n_layers=2, n_heads=2, max_position_embeddings=P,
                                              dropout=0.0, attention_dropout=0.0, causal=True, pad_index=0,
                                              bos_index=1, eos_index=2))


def _time_series():
    return tf.TimeSeriesTransformerModel(tf.TimeSeriesTransformerConfig(
        prediction_length=2, context_length=4, lags_sequence=[1, 2], num_time_features=1, d_model=16,
        encoder_layers=1, decoder_layers=1, encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=16,
        decoder_ffn_dim=16, dropout=0.0, encoder_layerdrop=0.0, decoder_layerdrop=0.0, attention_dropout=0.0,
        activation_dropout=0.0, scaling="mean"))


def _series(unobserved: bool):
    """Past values over the context and its lags (6 steps), one time feature; with ``unobserved``,
    series 0 has no observed value."""
    def make(B, T, g):
        observed = torch.ones(B, 6)
        if unobserved:
            observed[0] = 0
        return {"past_values": floats(g, B, 6).abs() + 0.5, "past_time_features": floats(g, B, 6, 1),
                "past_observed_mask": observed, "future_values": floats(g, B, 2),
                "future_time_features": floats(g, B, 2, 1)}
    return make


def _series_loss(model, batch):
    return readout(model(**batch).last_hidden_state)


UNSEEN = {
    "xlm": Case("unseen-xlm", "hf", "XLM (positions expanded to the tokens by expand_as)", seeded(_xlm), lm_batch,
                causal_loss),
    "time-series": Case("unseen-time-series", "hf", "time-series transformer (mean scaler), every series observed",
                        seeded(_time_series), _series(False), _series_loss),
    "time-series-unobserved": Case("unseen-time-series-unobserved", "hf", "time-series transformer, one series unobserved "
                                   "(the batch's mean scale: must be refused)", seeded(_time_series), _series(True),
                                   _series_loss),
}
REFUSED = {"time-series-unobserved": "module scaler (TimeSeriesMeanScaler) mixes samples"}


@pytest.mark.parametrize("shape", ["generic", "B==T"])
@pytest.mark.parametrize("name", list(UNSEEN))
def test_unseen_type_is_exact_or_refused_with_its_reason(name, shape, monkeypatch):
    monkeypatch.setitem(CASES, f"unseen-{name}", UNSEEN[name])
    r = judge(f"unseen-{name}", shape, "all-layer", "auto", "fp32")
    if name in REFUSED:
        assert r.verdict == "refused" and REFUSED[name] in r.message, r
    else:
        assert r.verdict == "exact", r
