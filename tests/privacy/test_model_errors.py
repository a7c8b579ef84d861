"""An error of the user's model (or of torch) on the rows of a Poisson draw may name shapes that
follow the realised batch size, which no DpEvent accounts for: wherever it appears it says so
("not covered by ε"), and it keeps its type, so that whoever handles it (a rank's fault, a
resume) still does."""

from __future__ import annotations

import pytest
import torch

from dpclip.engine.precision import Precision
from dpclip.train.parts import assemble
from dpclip.train.step import PrivateStep
from tests.cli.test_train import short


def _failing_loss(model, rows):
    x = next(iter(rows.values()))
    raise RuntimeError(f"shape '{list(x.shape)}' is invalid for this layer")   # names the draw's size


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_model_error_on_a_drawn_batch_is_labelled_and_keeps_its_type(small_recipe, precision):
    parts = assemble(small_recipe())
    learner = parts.learner
    step = PrivateStep(learner.model, _failing_loss, learner.engine, learner.optimizer, parts.feed.data.train,
                       micro_batch_size=None, precision=Precision(precision, "cpu"))
    with pytest.raises(RuntimeError, match="is invalid") as info:
        step(torch.arange(7))
    notes = getattr(info.value, "__notes__", [])
    assert any("not covered by ε" in note for note in notes), notes
    assert any("training.precision: fp32" in note for note in notes) == (precision == "bf16"), notes


def test_dpclip_train_prints_a_model_error_labelled_without_a_traceback(cli, tmp_path, monkeypatch):
    monkeypatch.setattr(PrivateStep, "_micro_batches",
                        lambda self, parts, weights: _failing_loss(None, {"x": torch.zeros(len(parts[0][0]), 64)}))
    result = cli("train", *short(tmp_path))
    assert result.code == 1
    assert "error: unexpected RuntimeError: shape" in result.err and "not covered by ε" in result.err
    assert "Traceback" not in result.err
