"""An attacker reads what `dpclip tune-cost RECIPE` prints and writes (its table, --json, --out).

Its seconds per step are the median of a few private steps on Poisson batches drawn from the
private data, and its fixed seconds per run come from one whole two-step run on it: a step's time
follows its realised batch size, which a run's metrics.jsonl labels not covered by ε (`seconds`).
So every time tune-cost measured is labelled not covered by ε where it appears; a time the
operator gave (--no-measure --step-seconds) is no function of the data and carries no label."""

from __future__ import annotations

import json

import pytest

import dpclip.tuning.cost as cost
from dpclip.recipe import recipe_to_yaml

STEP, FIXED = 0.123, 4.56   # what the timing functions would measure on the private data


@pytest.fixture
def measured(monkeypatch):
    """tune-cost's measurements stubbed (the label depends on their source, not their value): a test
    of a few seconds, not the minute of warm-up steps and a whole two-step run on a loaded machine."""
    monkeypatch.setattr(cost, "measure_step_seconds", lambda recipe, steps, warmup_steps=1, on_step=None: STEP)
    monkeypatch.setattr(cost, "measure_fixed_seconds", lambda recipe: FIXED)


def _recipe_file(tiny_recipe, tmp_path):
    path = tmp_path / "recipe.yaml"
    path.write_text(recipe_to_yaml(tiny_recipe("training.steps=2", "model.hidden=[8]")))
    return path


def test_measured_step_times_are_labelled_not_covered_in_the_json_and_the_table(tiny_recipe, cli, tmp_path, measured):
    recipe = _recipe_file(tiny_recipe, tmp_path)
    out = tmp_path / "tune_cost.json"
    result = cli("tune-cost", recipe, "--out", out)
    assert result.code == 0, result.err
    compute = json.loads(out.read_text())["compute"]
    # the leaked quantity: a median of step times on the private data's Poisson draws
    assert compute["measured"] and compute["step_seconds"] == STEP and compute["run_fixed_seconds"] == FIXED
    assert "not covered by ε" in (compute.get("not_covered_by_epsilon") or "")
    table = result.out.split("compute", 1)[1].split("privacy:", 1)[0]
    assert "seconds per step (measured)" in table
    assert "not covered by ε" in " ".join(table.split())


def test_given_step_times_carry_no_label(tiny_recipe, cli, tmp_path):
    recipe = _recipe_file(tiny_recipe, tmp_path)
    result = cli("tune-cost", recipe, "--no-measure", "--step-seconds", "0.2", "--json")
    assert result.code == 0, result.err
    assert json.loads(result.out)["compute"].get("not_covered_by_epsilon") is None
