"""DPTrainer(per_sample_loss=fn) checked to give each example alone its loss in the batch
(dpclip/integrations/loss_alone.py; docs/python-api.md, "Hugging Face Trainer")."""

from __future__ import annotations

import pytest

from dpclip.errors import DpclipError
from dpclip.integrations.transformers import DPTrainer, PrivacyArguments, default_per_sample_loss
from tests.integrations.test_transformers import _args, _bert, _collate, _rows


def _mixes_the_batch(model, inputs):
    losses = default_per_sample_loss(model, inputs)
    return losses * (losses / losses.mean()).detach()   # every row scaled by the batch: one example moves all


def _own_losses_doubled(model, inputs):
    return 2 * default_per_sample_loss(model, inputs)


def _custom(tmp_path, loss, **privacy_options):
    # A draw of fewer than 2 examples cannot mix them and is not checked; at an expected batch of 20 of
    # 40 rows that happens with probability 41 / 2**40 (at 5 of 40 it was 3%, a flaky refusal test).
    privacy = PrivacyArguments(delta=1e-5, noise_multiplier=1.0, max_grad_norm=1.0, verify_every=1, **privacy_options)
    return DPTrainer(model=_bert(), args=_args(tmp_path, max_steps=2, per_device_train_batch_size=20),
                     train_dataset=_rows(), data_collator=_collate, privacy=privacy, per_sample_loss=loss)


def test_a_per_sample_loss_that_mixes_the_batch_is_refused_before_any_noise(tmp_path):
    trainer = _custom(tmp_path, _mixes_the_batch)
    with pytest.raises(DpclipError, match="another loss alone than in its batch") as info:
        trainer.train()
    assert "dataset" in info.value.hint
    assert trainer.account.ledger.steps == 0
    assert all(p.grad is None for p in trainer.model.parameters())


def test_a_per_sample_loss_of_each_example_alone_trains(tmp_path):
    trainer = _custom(tmp_path, _own_losses_doubled)
    trainer.train()
    assert trainer.account.ledger.steps == 2


def test_a_compiled_trainer_checks_a_per_sample_loss_alone_too(tmp_path):
    """The compiled graph's first micro-batch runs through the eager engine, whose certificate check
    takes the loss alone as the uncompiled step's does: refused before anything is compiled or noised."""
    trainer = _custom(tmp_path, _mixes_the_batch, compile=True, compile_backend="aot_eager")
    with pytest.raises(DpclipError, match="another loss alone than in its batch"):
        trainer.train()
    assert trainer.account.ledger.steps == 0
    assert all(p.grad is None for p in trainer.model.parameters())
