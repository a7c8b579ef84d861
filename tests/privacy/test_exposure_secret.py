"""The planted secrets of canary exposure are the audit's answer key: an attacker holding the
recipe, every released file of the run and its export must not learn them."""

from __future__ import annotations

import json

import pytest

from dpclip import release
from dpclip.export import export_run
from dpclip.recipe import load_recipe
from dpclip.train.workflow import train
from tests.conftest import REPO

TINY = ["training.epochs=null", "training.steps=2", "training.batch_size=16", "training.micro_batch_size=16",
        "checkpoint.every_steps=null", "eval.every_steps=null", "data.num_examples=60", "data.max_length=32",
        "model.config.n_layer=1", "clipping.grouping=all-layer", "model.config.n_embd=16", "model.config.n_head=2",
        "model.config.n_positions=32",
        # 10 digits: an OS-entropy secret of 6 matched one of the 192 six-digit windows of the released
        # files (timestamps, floats) with probability 6e-4 per test; of 10, one of 106 windows: 3e-8
        "audit.exposure={length: 10, repetitions: [2], controls: 2}", "privacy.epsilon=null",
        "privacy.noise_multiplier=1.0"]


@pytest.mark.slow
def test_an_attacker_with_the_recipe_and_the_released_files_cannot_read_the_secrets(tmp_path):
    recipe = load_recipe(REPO / "recipes" / "gpt2-tiny-text.yaml", [f"output_dir={tmp_path / 'runs'}", *TINY])
    first, second = train(recipe).run_dir, train(recipe).run_dir
    answer = json.loads((first / "audit" / "exposure.json").read_text())
    other = json.loads((second / "audit" / "exposure.json").read_text())
    # the same recipe, seed included, plants other secrets: the recipe does not determine them
    assert set(answer["secrets"]).isdisjoint(other["secrets"])
    assert release.classify("audit/exposure.json").release == release.SECRET
    exported = export_run(first, tmp_path / "export").out_dir
    released = [p for p in first.rglob("*") if p.is_file()
                and release.classify(p.relative_to(first).as_posix()).release != release.SECRET]
    released += [p for p in exported.rglob("*") if p.is_file()]
    assert released
    for path in released:
        data = path.read_bytes()
        for secret in answer["secrets"]:
            assert secret.encode() not in data, (path, secret)
        assert answer["entropy"].encode() not in data, path
