"""`model.gradient_checkpointing: true` (docs/supported-models.md, "Gradient checkpointing"): a seeded run
trains the weights and charges the ledger of the run without it; a model transformers cannot
checkpoint is refused with a hint."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from dpclip.errors import DpclipError
from dpclip.recipe import load_recipe
from dpclip.rundir.checkpoint import latest_checkpoint
from dpclip.layout import MODEL_WEIGHTS
from dpclip.train.workflow import train
from tests.conftest import REPO

TINY = ["training.epochs=null", "training.steps=2", "training.batch_size=16", "training.micro_batch_size=8",
        "checkpoint.every_steps=2", "eval.every_steps=null", "data.num_examples=60", "data.max_length=16",
        "model.config.n_layer=2", "model.config.n_embd=16", "model.config.n_head=2", "model.config.n_positions=16",
        "privacy.unsafe_seeded_randomness=true"]


def _run(tmp_path, name, *extra):
    recipe = load_recipe(REPO / "recipes" / "gpt2-tiny-text.yaml", [f"output_dir={tmp_path}", *TINY, *extra])
    return train(recipe, run_dir=tmp_path / name).run_dir


def test_a_checkpointed_run_trains_the_weights_and_ledger_of_the_run_without_it(tmp_path, monkeypatch):
    from dpclip.engine.bookkeeping import Bookkeeper
    recomputed = []
    real = Bookkeeper._recomputation
    monkeypatch.setattr(Bookkeeper, "_recomputation", lambda self: recomputed.append(1) or real(self))
    plain = _run(tmp_path, "plain")
    assert recomputed == []
    checkpointed = _run(tmp_path, "checkpointed", "model.gradient_checkpointing=true")
    assert len(recomputed) > 0   # the layers' calls were recomputed in the backward
    ours = load_file(str(latest_checkpoint(checkpointed) / MODEL_WEIGHTS))
    theirs = load_file(str(latest_checkpoint(plain) / MODEL_WEIGHTS))
    assert ours.keys() == theirs.keys()
    for name in theirs:   # the same operations recomputed: equal to float32 rounding
        torch.testing.assert_close(ours[name], theirs[name], rtol=1e-5, atol=1e-6, msg=name)
    assert (json.loads((checkpointed / "ledger.json").read_text())
            == json.loads((plain / "ledger.json").read_text()))


def test_a_model_transformers_cannot_checkpoint_is_refused_with_a_hint(tmp_path, monkeypatch):
    from transformers import GPT2LMHeadModel
    monkeypatch.setattr(GPT2LMHeadModel, "supports_gradient_checkpointing", False)
    with pytest.raises(DpclipError) as err:
        _run(tmp_path, "refused", "model.gradient_checkpointing=true")
    assert "does not support gradient checkpointing" in err.value.message
    assert "gradient_checkpointing: false" in err.value.hint
