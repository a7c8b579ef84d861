"""DPTrainer holds each training step to the rows its loader drew (dpclip/integrations/trainer_rows.py;
docs/python-api.md, "Hugging Face Trainer"). The noise is calibrated to one example moving one clipped row:
a per_sample_loss or a training_step override that gives the model rows built from several examples makes
one example move two, which neither the certificate nor the loss-alone check can see."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dpclip.errors import DpclipError
from dpclip.integrations.trainer_rows import PartRows
from dpclip.integrations.transformers import DPTrainer, PrivacyArguments, default_per_sample_loss
from tests.integrations.test_transformers import _args, _bert, _collate, _rows

PRIVACY = PrivacyArguments(delta=1e-5, noise_multiplier=1.0, max_grad_norm=1.0)
#: Poisson parts of one row (or none) mix nothing: rolling one row is itself, so such a step trains,
#: charged. At 5 rows a part that happened in ~4% of draws; at 16 never in practice.
BIG = {"per_device_train_batch_size": 16}


def _cutmix(inputs: dict) -> dict:
    """Every other token taken from the next example (token cutmix): each row holds two examples."""
    ids = inputs["input_ids"]
    keep = torch.arange(ids.shape[1], device=ids.device) % 2 == 0
    return {**inputs, "input_ids": torch.where(keep, ids, ids.roll(1, 0))}


def _cutmix_loss(model, inputs):
    logits = model(input_ids=_cutmix(inputs)["input_ids"], attention_mask=inputs["attention_mask"]).logits
    return F.cross_entropy(logits, inputs["labels"], reduction="none")


def _cast_loss(model, inputs):
    """The part's own rows, the mask cast to float: each example's row is still its own."""
    logits = model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"].float()).logits
    return F.cross_entropy(logits, inputs["labels"], reduction="none")


class CutmixInTrainingStep(DPTrainer):
    def training_step(self, model, inputs, num_items_in_batch=None):
        return super().training_step(model, _cutmix(inputs), num_items_in_batch)


class LoggingTrainingStep(DPTrainer):
    """An override that looks at the part and passes it on unchanged."""
    seen = 0

    def training_step(self, model, inputs, num_items_in_batch=None):
        self.seen += 1
        return super().training_step(model, inputs, num_items_in_batch)


def _refused_before_any_noise(trainer: DPTrainer, where: str) -> None:
    with pytest.raises(DpclipError, match=f"{where} is not the rows the data loader drew") as caught:
        trainer.train()
    assert "per_sample_loss" in caught.value.hint and "super().training_step" in caught.value.hint
    assert trainer.account.ledger.steps == 0
    assert all(p.grad is None for p in trainer.model.parameters())


@pytest.mark.parametrize("parts", [1, 2])
def test_a_per_sample_loss_that_gives_the_model_rows_of_two_examples_is_refused_before_any_noise(tmp_path, parts):
    trainer = DPTrainer(model=_bert(), args=_args(tmp_path, gradient_accumulation_steps=parts, **BIG),
                        train_dataset=_rows(), data_collator=_collate, privacy=PRIVACY, per_sample_loss=_cutmix_loss)
    _refused_before_any_noise(trainer, "the model's input in per_sample_loss")


@pytest.mark.parametrize("parts", [1, 2])
def test_a_training_step_override_that_mixes_the_part_is_refused_before_any_noise(tmp_path, parts):
    trainer = CutmixInTrainingStep(model=_bert(), args=_args(tmp_path, gradient_accumulation_steps=parts, **BIG),
                                   train_dataset=_rows(), data_collator=_collate, privacy=PRIVACY)
    _refused_before_any_noise(trainer, "an input of training_step")


@pytest.mark.slow   # a 3-step run
def test_an_override_passing_the_part_on_and_a_loss_casting_its_rows_train(tmp_path):
    trainer = LoggingTrainingStep(model=_bert(), args=_args(tmp_path, gradient_accumulation_steps=2),
                                  train_dataset=_rows(), data_collator=_collate, privacy=PRIVACY,
                                  per_sample_loss=_cast_loss)
    trainer.train()
    assert trainer.account.ledger.steps == 3 and trainer.seen == 6


@pytest.mark.slow   # a 3-step run
def test_the_default_loss_takes_the_part_as_drawn(tmp_path):
    trainer = DPTrainer(model=_bert(), args=_args(tmp_path), train_dataset=_rows(), data_collator=_collate,
                        privacy=PRIVACY, per_sample_loss=default_per_sample_loss)
    trainer.train()
    assert trainer.account.ledger.steps == 3


def test_a_part_with_a_tensor_expanded_over_its_rows_is_taken_as_drawn_and_a_reordered_one_is_not():
    """A collator's ``torch.ones(T).expand(b, T)`` mask is the part's own tensor: passed on, it trains."""
    ids = torch.arange(12).reshape(4, 3)
    part = {"input_ids": ids, "attention_mask": torch.ones(3, dtype=torch.int64).expand(4, 3)}
    rows = PartRows()
    rows.fetch([part, part])
    rows.take(dict(part))
    with pytest.raises(DpclipError, match="an input of training_step is not the rows"):
        rows.take({**part, "input_ids": ids.flip(0)})
