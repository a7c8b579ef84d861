"""DPTrainer holds a step to its draw's parts, each backwarded once (docs/python-api.md, "Hugging Face Trainer")."""

from __future__ import annotations

import pytest

from dpclip.errors import DpclipError
from dpclip.integrations.transformers import DPTrainer, PrivacyArguments
from tests.integrations.test_transformers import _args, _bert, _collate, _rows


class TrainingStepTwice(DPTrainer):
    """A subclass that runs each part's training step twice (a retry, an extra pass): every
    example's clipped gradient would enter its step twice, twice the sensitivity the noise is for."""

    def training_step(self, model, inputs, num_items_in_batch=None):
        super().training_step(model, inputs, num_items_in_batch)
        return super().training_step(model, inputs, num_items_in_batch)


@pytest.mark.parametrize("parts", [1, 2])
def test_a_part_backwarded_twice_in_one_step_is_refused_before_the_step_is_released(tmp_path, parts):
    trainer = TrainingStepTwice(model=_bert(), args=_args(tmp_path, gradient_accumulation_steps=parts),
                                train_dataset=_rows(), data_collator=_collate,
                                privacy=PrivacyArguments(delta=1e-5, noise_multiplier=1.0, max_grad_norm=1.0))
    with pytest.raises(DpclipError, match="more parts than"):
        trainer.train()
    assert trainer.account.ledger.steps == 0


def test_each_step_backwards_its_draw_s_parts_once(tmp_path):
    trainer = DPTrainer(model=_bert(), args=_args(tmp_path, gradient_accumulation_steps=3), train_dataset=_rows(),
                        data_collator=_collate, privacy=PrivacyArguments(delta=1e-5, noise_multiplier=1.0,
                                                                         max_grad_norm=1.0))
    trainer.train()
    assert trainer.account.ledger.steps == 3


def test_top_fraction_with_gradient_accumulation_is_refused_before_any_step(tmp_path):
    """The top-fraction rule ranks a whole draw in one backward; the Trainer's accumulation parts
    failed it at the first draw with two non-empty parts, after the steps before it were charged."""
    clipping = {"threshold": {"kind": "discriminative", "small": 0.5, "large": 2.0, "tail_rule": "top_fraction",
                              "top_fraction": 0.25}}
    with pytest.raises(DpclipError, match="gradient_accumulation_steps") as refused:
        DPTrainer(model=_bert(), args=_args(tmp_path, gradient_accumulation_steps=2), train_dataset=_rows(),
                  data_collator=_collate, privacy=PrivacyArguments(delta=1e-5, noise_multiplier=1.0, clipping=clipping))
    assert "gradient_accumulation_steps=1" in refused.value.hint
