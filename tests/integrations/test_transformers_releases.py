"""DPTrainer: what leaves besides the noisy steps, and what it refuses to leave unchecked
(docs/python-api.md, "Hugging Face Trainer")."""

from __future__ import annotations

import json
import re
import shutil

import pytest
from transformers import HfArgumentParser, TrainingArguments

from dpclip.errors import DpclipError
from dpclip.integrations.transformers import PrivacyArguments
from tests.integrations.test_transformers import _trainer


def test_the_saved_trainer_state_counts_no_operations_of_the_private_batches(tmp_path):
    """total_flos summed 6·P·|B_t|·T_t over the Poisson draws: their realised sizes, without noise."""
    trainer = _trainer(tmp_path, save_strategy="steps", save_steps=2, max_steps=2)
    trainer.train()
    trainer.save_state()
    assert trainer.state.total_flos == 0
    for path in (tmp_path / "out" / "trainer_state.json", tmp_path / "out" / "checkpoint-2" / "trainer_state.json"):
        assert json.loads(path.read_text())["total_flos"] == 0


@pytest.mark.parametrize("change, message", [
    ({"include_num_input_tokens_seen": True}, "include_num_input_tokens_seen"),
    ({"include_num_input_tokens_seen": "non_padding"}, "include_num_input_tokens_seen"),
    ({"label_smoothing_factor": 0.1}, "label_smoothing_factor=0.1"),
])
def test_training_arguments_that_would_leak_or_be_ignored_are_refused_with_a_hint(tmp_path, change, message):
    with pytest.raises(DpclipError, match=re.escape(message)) as info:
        _trainer(tmp_path, **change)
    assert info.value.hint


def test_a_resume_from_a_checkpoint_moved_away_from_its_release_log_is_refused(tmp_path):
    _trainer(tmp_path, save_strategy="steps", save_steps=2, max_steps=3).train()
    shutil.copytree(tmp_path / "out" / "checkpoint-2", tmp_path / "moved" / "checkpoint-2")
    resumed = _trainer(tmp_path / "again", save_strategy="steps", save_steps=2, max_steps=3)
    with pytest.raises(DpclipError, match="no dpclip_releases.jsonl") as info:
        resumed.train(resume_from_checkpoint=str(tmp_path / "moved" / "checkpoint-2"))
    assert "dpclip_releases.jsonl" in info.value.hint
    assert all(p.grad is None for p in resumed.model.parameters())
    shutil.copy(tmp_path / "out" / "dpclip_releases.jsonl", tmp_path / "moved")   # the hint's way out
    again = _trainer(tmp_path / "again", save_strategy="steps", save_steps=2, max_steps=3)
    again.train(resume_from_checkpoint=str(tmp_path / "moved" / "checkpoint-2"))
    assert again.account.ledger.steps == 3


def test_the_clipping_block_parses_as_json_beside_the_training_arguments(tmp_path):
    parser = HfArgumentParser((TrainingArguments, PrivacyArguments))
    block = {"grouping": "layer", "threshold": {"kind": "fixed", "value": 1.0}}
    _, privacy = parser.parse_args_into_dataclasses(["--output_dir", str(tmp_path), "--delta", "1e-5",
                                                     "--noise_multiplier", "1", "--clipping", json.dumps(block)])
    assert privacy.clipping == block
    assert PrivacyArguments(delta=1e-5).clipping == {}
    with pytest.raises(DpclipError, match="clipping is not JSON") as info:
        PrivacyArguments(delta=1e-5, clipping="{grouping: layer}")
    assert "--clipping" in info.value.hint
