"""Recurrent layers on PackedSequences (issue 52): each sample's rows, found from the packing
(docs/supported-models.md, "Packed sequences"), recomputed alone, give its exact gradient."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence

from dpclip.engine import DPEngine
from dpclip.engine.layers.packed import sample_rows
from dpclip.errors import EngineError
from tests.engine.conftest import DTYPE, check_exact

D, T = 5, 6


def _lengths(x):
    """Each sample's own length (as padding marks it): 2 to T steps."""
    return (2 + (x[:, 0, 0].abs() * 10).long() % (T - 1)).cpu()


class PackedNet(nn.Module):
    def __init__(self, rnn="lstm", hx=False):
        super().__init__()
        cls = {"lstm": nn.LSTM, "gru": nn.GRU}[rnn]
        self.rnn = cls(D, 4, num_layers=2, bidirectional=True, batch_first=True)
        self.h0 = nn.Linear(D, 4 * 4) if hx else None
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        packed = pack_padded_sequence(x, _lengths(x), batch_first=True, enforce_sorted=False)
        hx = None
        if self.h0 is not None:
            h = torch.tanh(self.h0(x[:, 0])).view(len(x), 4, 4).transpose(0, 1).contiguous()
            hx = (h, torch.zeros_like(h)) if isinstance(self.rnn, nn.LSTM) else h
        out, _ = self.rnn(packed, hx)
        padded, lengths = nn.utils.rnn.pad_packed_sequence(out, batch_first=True)
        return self.head(padded.sum(1) / lengths[:, None].to(padded))


def _loss(model, batch):
    return F.cross_entropy(model(batch["x"]), batch["y"], reduction="none")


def _batch(n=6, seed=5):
    g = torch.Generator().manual_seed(seed)
    return {"x": torch.randn(n, T, D, generator=g, dtype=DTYPE), "y": torch.randint(0, 3, (n,), generator=g)}


def _factory(*args):
    def make():
        torch.manual_seed(0)
        return PackedNet(*args).to(DTYPE)
    return make


def test_sample_rows_are_each_samples_own_steps_in_the_packed_data():
    x = _batch()["x"]
    lengths = _lengths(x)
    packed = pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)
    for i, rows in enumerate(sample_rows(packed)):
        torch.testing.assert_close(packed.data[rows], x[i, :int(lengths[i])], rtol=0, atol=0)


@pytest.mark.parametrize("rnn, hx", [("lstm", False), ("lstm", True), ("gru", True)])
@pytest.mark.parametrize("grouping", ["all-layer", "layer"])
def test_rnn_on_packed_sequences_clips_as_the_per_example_reference(rnn, hx, grouping):
    check_exact(_factory(rnn, hx), _loss, _batch(), grouping=grouping, micro=[2, 4])


class TwoPerSample(nn.Module):
    """Packs two sequences per sample: the packing's sequences are not the samples."""

    def __init__(self):
        super().__init__()
        self.rnn, self.head = nn.GRU(D, 4, batch_first=True), nn.Linear(4, 3)

    def forward(self, x):
        both = torch.cat([x, x.flip(1)])
        packed = pack_padded_sequence(both, torch.full((len(both),), T), batch_first=True)
        _, h = self.rnn(packed)
        return self.head(h[-1, :len(x)] + h[-1, len(x):])


def test_a_packing_whose_sequences_are_not_the_samples_is_refused():
    torch.manual_seed(0)
    model = TwoPerSample().to(DTYPE)
    engine = DPEngine(model, {"threshold": {"kind": "fixed", "value": 1.0}}, gradient_noise_multiplier=0.0,
                      expected_batch_size=4)
    with pytest.raises(EngineError, match="PackedSequence of 8 sequences, but the batch has 4"):
        engine.backward(_loss(model, _batch(4)))
