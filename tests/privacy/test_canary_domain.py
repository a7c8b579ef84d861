"""Out-of-distribution canaries carry nothing of the private data (issue 26, leak 1;
docs/auditing.md, "One-run audit").

The attacker holds the released model, which is trained on the canaries. If the canaries'
range were measured on the training rows, one example's extreme value would move it, and
the canaries (hence the model) would reveal it. So two private data sets that differ in
one example's extreme value must give the same canaries under the same canary seed.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from dpclip.data import load_data, make_canaries
from dpclip.errors import DpclipError
from dpclip.recipe.schema import Canaries
from dpclip.train.workflow import train


def _with_one_extreme_value(data, value: float):
    """``data`` with one training example's every feature set to ``value`` (its neighbour)."""
    features = data.train["features"].clone()
    features[0] = value
    return replace(data, train={**data.train, "features": features})


@pytest.mark.parametrize("extreme", [-3.0, 7.0])
def test_neighbouring_digits_sets_give_the_same_ood_canaries(quickstart, extreme):
    data = load_data(quickstart().data, seed=0)
    neighbour = _with_one_extreme_value(data, extreme)
    config = Canaries(count=50, kind="ood", seed=123)
    ours, theirs = make_canaries(data, config, 0), make_canaries(neighbour, config, 0)
    assert torch.equal(ours.tensors["features"], theirs.tensors["features"])
    assert torch.equal(ours.tensors["labels"], theirs.tensors["labels"])
    # drawn in the digits' documented domain (grey levels 0..16, scaled to [0, 1])
    assert 0.0 <= float(ours.tensors["features"].min()) and float(ours.tensors["features"].max()) <= 1.0


def _csv(path, rows):
    path.write_text("a,b,label\n" + "".join(f"{a},{b},{y}\n" for a, b, y in rows))
    return path


def _files_recipe(quickstart, path, *overrides):
    return quickstart(f"data={{source: files, format: csv, train: {path}, label_field: label}}",
                      "model.hidden=[8]", "training.epochs=null", "training.steps=2", "training.batch_size=8",
                      "training.micro_batch_size=8",
                      "checkpoint.every_steps=null", "eval.every_steps=null",
                      "audit.canaries.count=20", "audit.canaries.kind=ood", *overrides)


ROWS = [(i % 7, (3 * i) % 5, i % 2) for i in range(40)]


def test_neighbouring_files_give_the_same_canaries_in_the_declared_domain(quickstart, tmp_path):
    ours = _csv(tmp_path / "ours.csv", ROWS)
    theirs = _csv(tmp_path / "theirs.csv", [(1000, -1000, ROWS[0][2])] + ROWS[1:])
    canaries = []
    for path in (ours, theirs):
        recipe = _files_recipe(quickstart, path, "audit.canaries.domain=[-1, 8]", "audit.canaries.seed=5")
        canaries.append(make_canaries(load_data(recipe.data, seed=0), recipe.audit.canaries, recipe.seed))
    assert torch.equal(canaries[0].tensors["features"], canaries[1].tensors["features"])
    drawn = canaries[0].tensors["features"]
    assert float(drawn.min()) >= -1.0 and float(drawn.max()) <= 8.0


def test_ood_canaries_without_a_public_domain_are_refused_before_training(quickstart, tmp_path):
    recipe = _files_recipe(quickstart, _csv(tmp_path / "ours.csv", ROWS))
    with pytest.raises(DpclipError) as refused:
        train(recipe)
    assert "public feature domain" in str(refused.value)
    assert "audit.canaries.domain" in refused.value.hint
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())


@pytest.mark.parametrize("domain", ["[1, 1]", "[2, 1]", "[0, .inf]"])
def test_a_domain_that_is_not_an_interval_is_refused(quickstart, tmp_path, domain):
    with pytest.raises(DpclipError, match="domain"):
        _files_recipe(quickstart, _csv(tmp_path / "ours.csv", ROWS), f"audit.canaries.domain={domain}")


def test_two_runs_of_one_recipe_plant_different_canaries_unless_the_recipe_sets_their_seed(tiny_recipe):
    """An attacker holding the run's recipe.yaml must not rebuild the answer key: the canary
    seed is fresh OS entropy (20 inclusion bits agree by chance with probability 2^-20), and a
    resumed run and the audit read it back from audit/canaries.json."""
    import json

    from dpclip.data.canaries import canary_seed

    recipe = tiny_recipe("audit.canaries.count=20", "audit.canaries.kind=ood")
    secrets = []
    for _ in range(2):
        run = train(recipe).run_dir
        secrets.append(json.loads((run / "audit" / "canaries.json").read_text()))
        assert canary_seed(recipe.audit.canaries, run) == secrets[-1]["seed"]
    assert secrets[0]["seed"] != secrets[1]["seed"] and secrets[0]["included"] != secrets[1]["included"]
    seeded = tiny_recipe("audit.canaries.count=20", "audit.canaries.kind=ood", "audit.canaries.seed=7")
    assert canary_seed(seeded.audit.canaries) == 7 and canary_seed(recipe.audit.canaries) is None
