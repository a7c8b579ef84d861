"""The certificate on models no rule was written for (docs/certificate.md): couplings of samples
through a custom backward, a gradient hook, saved-tensor hooks, a detached statistic, a condition
over the batch, a cumulative sum along it, and several forwards before one backward. Each mixing
model is refused before any noise; the weight-only parametrizations and many views pass."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dpclip.engine import DPEngine
from dpclip.engine.certificate import MAX_FORWARDS, Certificate
from dpclip.errors import EngineError
from tests.engine.mixing_models import (BatchMeanImputation, DetachedMean, DropoutOverSwappedRows, GlobalThreshold,
                                        MixingBackward, NoisyEncoderSwappingInTraining, RunningAverageOverRows,
                                        SavedTensorsMixed, mixing_gradient_pre_hook)

B = 6


def _engine(model):
    return DPEngine(model, {"grouping": "all-layer", "threshold": {"kind": "fixed", "value": 1.0}},
                    gradient_noise_multiplier=1.0, expected_batch_size=B)


def _data(seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, 5, generator=g), torch.randint(0, 3, (B,), generator=g)


def _around(middle: nn.Module) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 8), middle, nn.ReLU(), nn.Linear(8, 3))


def _step(model, views: int = 1):
    x, y = _data()
    engine = _engine(model)
    losses = sum(F.cross_entropy(model(x + 0.01 * k), y, reduction="none") for k in range(views)) / views
    engine.backward(losses)
    return engine, engine.privatize()


@pytest.mark.parametrize("middle, why", [
    (MixingBackward, "disagree with the sample's own gradient"),
    (SavedTensorsMixed, "disagree with the sample's own gradient"),
    (lambda: mixing_gradient_pre_hook(nn.Linear(8, 8)), "disagree with the sample's own gradient"),
    (DetachedMean, r"1 \(DetachedMean\) mixes samples"),
    (GlobalThreshold, r"1 \(GlobalThreshold\) mixes samples"),
    (RunningAverageOverRows, r"1 \(RunningAverageOverRows\) mixes samples"),
])
def test_a_model_coupling_samples_in_a_way_no_rule_knows_is_refused_before_any_noise(middle, why):
    model = _around(middle())
    x, y = _data()
    engine = _engine(model)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(EngineError, match=why) as err:
        engine.backward(F.cross_entropy(model(x), y, reduction="none"))
    assert err.value.hint
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_a_coupling_only_in_rows_no_check_watches_is_refused_by_the_batch_in_halves(monkeypatch):
    """Batch-mean imputation mixes only the rows that miss a value; with none of them among the
    checked rows, the two halves of the batch replayed apart still show every row's outputs."""
    monkeypatch.setattr(Certificate, "rows", lambda self, samples: [0, samples - 1])   # clean rows
    torch.manual_seed(0)
    model = nn.Sequential(BatchMeanImputation(), nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 3))
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(32, 5, generator=g), torch.randint(0, 3, (32,), generator=g)
    x[3:31:7, 2] = float("nan")
    engine = DPEngine(model, {"grouping": "all-layer", "threshold": {"kind": "fixed", "value": 1.0}},
                      gradient_noise_multiplier=1.0, expected_batch_size=32)
    with pytest.raises(EngineError, match=r"0 \(BatchMeanImputation\) mixes samples.*in half of its batch"):
        engine.backward(F.cross_entropy(model(x), y, reduction="none"))
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("parametrize", [nn.utils.parametrizations.spectral_norm,
                                         nn.utils.parametrizations.weight_norm,
                                         nn.utils.parametrizations.orthogonal])
def test_weight_only_parametrizations_in_training_pass_the_check(parametrize):
    engine, report = _step(_around(parametrize(nn.Linear(8, 8))))
    assert engine.certificate.checks == 1 and report.certificate.mode == "alone"


def test_a_model_called_for_twelve_views_before_one_backward_passes_the_check():
    """Multi-crop: twelve forwards of the same batch, one loss per sample over all of them."""
    engine, report = _step(_around(nn.Tanh()), views=12)
    assert report.certificate.rows == 4 and engine.certificate.checks == 1


def test_a_model_called_more_times_than_the_check_replays_is_refused_saying_so():
    model = _around(nn.Tanh())
    with pytest.raises(EngineError, match=f"ran {MAX_FORWARDS + 1} training forwards") as err:
        _step(model, views=MAX_FORWARDS + 1)
    assert "one forward" in err.value.hint
    assert all(p.grad is None for p in model.parameters())


def test_a_loss_pairing_unchecked_rows_with_other_rows_outputs_is_refused_before_any_noise(monkeypatch):
    """Labels shifted by one row among the rows no check watches: loss i = ce(output of row i+1, y_i).
    Each output row's gradient then carries another record's label, so one record moves two clipped
    rows; the losses' cotangents on every row, by partitions of the batch, show it."""
    monkeypatch.setattr(Certificate, "rows", lambda self, samples: [0, samples - 1])   # clean rows
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 3))
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(32, 5, generator=g), torch.randint(0, 3, (32,), generator=g)
    shifted = torch.cat([torch.tensor([0]), torch.arange(2, 31), torch.tensor([1, 31])])
    engine = DPEngine(model, {"grouping": "all-layer", "threshold": {"kind": "fixed", "value": 1.0}},
                      gradient_noise_multiplier=1.0, expected_batch_size=32)
    with pytest.raises(EngineError, match="depends on other samples' outputs") as err:
        engine.backward(F.cross_entropy(model(x)[shifted], y, reduction="none"))
    assert err.value.hint
    assert all(p.grad is None for p in model.parameters())


def test_a_coupling_in_the_backward_in_training_mode_only_is_refused_when_the_sums_are_checked_in_eval_mode(monkeypatch):
    """The step cannot be replayed (a fused attention's dropout, torch.normal), so the sums are checked
    on a dry micro-batch in eval mode, which runs without the coupling: the training-mode replays must
    show it on the checked rows, each checked row's gradient unmoved when every other row is replaced."""
    monkeypatch.setattr(Certificate, "rows", lambda self, samples: [0, 1, samples - 1])   # row 2 unchecked
    torch.manual_seed(0)
    model = NoisyEncoderSwappingInTraining().train()
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(5, 3, 8, generator=g), torch.randint(0, 3, (5,), generator=g)
    engine = DPEngine(model, {"grouping": "all-layer", "threshold": {"kind": "fixed", "value": 1.0}},
                      gradient_noise_multiplier=1.0, expected_batch_size=5)
    with pytest.raises(EngineError, match="changes sample 1's gradient when every other sample is replaced") as err:
        engine.backward(F.cross_entropy(model(x), y, reduction="none"))
    assert "backward hook" in err.value.hint
    assert all(p.grad is None for p in model.parameters())


def test_a_random_forward_coupling_a_checked_row_to_an_unchecked_one_is_refused_in_batch_mode(monkeypatch):
    """Row 1 (checked) reads row 2 (unchecked) through a detached term, under dropout: the replay alone
    differs, so the batch is replayed, where replacing the last checked row by the first moves neither;
    in a batch of copies of sample 1, sample 1's gradient moves."""
    monkeypatch.setattr(Certificate, "rows", lambda self, samples: [0, 1, samples - 1])   # row 2 unchecked
    model = _around(DropoutOverSwappedRows()).train()
    x, y = _data()
    engine = _engine(model)
    with pytest.raises(EngineError, match="changes sample 1's gradient when every other sample is replaced") as err:
        engine.backward(F.cross_entropy(model(x), y, reduction="none"))
    assert err.value.hint
    assert all(p.grad is None for p in model.parameters())
