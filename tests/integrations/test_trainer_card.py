"""The model card a DPTrainer's Trainer writes (create_model_card, push_to_hub) carries the
privacy statement: its table of training results is exact (docs/python-api.md)."""

from __future__ import annotations

import json

import pytest

from dpclip.integrations.trainer_card import LOGGED_LOSS, PRIVACY_HEADING
from dpclip.integrations.transformers import DPTrainer, PrivacyArguments
from tests.integrations.test_transformers import _args, _bert, _collate, _rows


@pytest.mark.slow  # end to end: the slow set (README)
def test_the_trainer_s_model_card_tabulates_exact_losses_under_the_privacy_statement(tmp_path):
    trainer = DPTrainer(model=_bert(), args=_args(tmp_path, logging_steps=1, eval_strategy="steps", eval_steps=1),
                        train_dataset=_rows(), eval_dataset=_rows(10), data_collator=_collate,
                        privacy=PrivacyArguments(delta=1e-5, noise_multiplier=1.0, max_grad_norm=1.0))
    trainer.train()
    trainer.create_model_card()
    card = (tmp_path / "out" / "README.md").read_text()
    privacy = json.loads((tmp_path / "out" / "privacy.json").read_text())
    assert "Training Loss" in card   # the Trainer's table of the exact per-step loss
    section = card[card.index(PRIVACY_HEADING):]
    assert "not covered by ε" in section.split("\n\n")[1]   # the table is said to be outside ε
    assert f"- {privacy['statement'][0]}" in section and privacy["statement"][0].startswith("ε = ")
    assert f"- not covered by ε: {LOGGED_LOSS}" in section
