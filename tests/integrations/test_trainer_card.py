"""The model card a DPTrainer's Trainer writes (create_model_card, push_to_hub) carries the
privacy statement: its table of training results is exact (docs/python-api.md)."""

from __future__ import annotations

import json

import pytest

from dpclip.integrations.trainer_card import EVALUATED, LOGGED_LOSS, PRIVACY_HEADING, with_statement
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


@pytest.mark.slow  # end to end: the slow set (README)
def test_an_evaluation_after_the_model_card_restates_the_card_as_privacy_json(tmp_path):
    trainer = DPTrainer(model=_bert(), args=_args(tmp_path), train_dataset=_rows(), eval_dataset=_rows(10),
                        data_collator=_collate,
                        privacy=PrivacyArguments(delta=1e-5, noise_multiplier=1.0, max_grad_norm=1.0))
    trainer.train()
    trainer.create_model_card()
    card = tmp_path / "out" / "README.md"
    assert f"- not covered by ε: {EVALUATED}" not in card.read_text()
    trainer.evaluate()
    privacy = json.loads((tmp_path / "out" / "privacy.json").read_text())
    text = card.read_text()
    assert EVALUATED in privacy["not_covered_by_epsilon"]
    assert f"- not covered by ε: {EVALUATED}" in text and text.count(PRIVACY_HEADING) == 1
    assert all(f"- {line}" in text for line in privacy["statement"])


def test_a_restated_card_keeps_one_privacy_section_in_its_place_and_what_follows_it(tmp_path):
    card = tmp_path / "README.md"
    card.write_text("# model\n\n## Training results\n\n| loss |\n")
    with_statement(card, ["ε = 1.0", "not covered by ε: a"])
    card.write_text(card.read_text() + "\n## Added by hand\n\ntext\n")
    with_statement(card, ["ε = 1.0", "not covered by ε: a", "not covered by ε: b"], restate=True)
    text = card.read_text()
    assert text.count(PRIVACY_HEADING) == 1 and "- not covered by ε: b" in text
    assert text.index("## Training results") < text.index(PRIVACY_HEADING) < text.index("## Added by hand")
    assert text.endswith("text\n")


def test_a_card_without_the_privacy_section_is_not_restated(tmp_path):
    card = tmp_path / "README.md"
    card.write_text("# someone else's card\n")
    with_statement(card, ["ε = 1.0"], restate=True)
    assert card.read_text() == "# someone else's card\n"
