"""Every field of an export's privacy.json comes from the statement the run prints (issue 50,
item 2): mechanism × unit × parallel mode, each field checked against the printed lines."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from dpclip.accounting import PrivacyPlan, solve
from dpclip.accounting.plan import user_unit
from dpclip.export.card import privacy_card

REPO = Path(__file__).resolve().parents[2]

MECHANISMS = {
    "dp-sgd": {},
    "banded-mf": {"bands": 3},
    "blt": {"buffers": 2, "sensitivities": (1.0, 1.5, 1.9, 2.2, 2.4)},
}
PARALLEL = [(1, "data"), (2, "data"), (2, "fsdp"), (2, "pipeline")]


def _statement(mechanism: str, unit: str, world: int, parallel: str):
    plan = PrivacyPlan(sample_rate=0.05, steps=100 if mechanism != "blt" else 100, delta=1e-5, noise_multiplier=1.2,
                       **MECHANISMS[mechanism],
                       **({"unit": "user", "users": 400, "max_examples_per_user": 4} if unit == "user" else {}))
    if mechanism == "blt":   # 1/q = 20 groups, 100 steps: 5 participations
        plan = replace(plan, sensitivities=MECHANISMS["blt"]["sensitivities"])
    statement = solve(plan).statement
    return replace(statement, world_size=world, parallel=parallel)


@pytest.mark.parametrize("world, parallel", PARALLEL)
@pytest.mark.parametrize("unit", ["example", "user"])
@pytest.mark.parametrize("mechanism", sorted(MECHANISMS))
def test_privacy_json_says_what_the_printed_statement_says(mechanism, unit, world, parallel):
    statement = _statement(mechanism, unit, world, parallel)
    lines = statement.lines()
    card = privacy_card(statement, recipe_name="r", checkpoint="step_000100", checkpoint_step=100,
                        steps_planned=statement.steps, stopped="completed", label_names=None, search=None)
    text = "\n".join(lines)
    assert card["statement"] == lines
    # the unit and the neighbouring relation: the printed unit line's words
    unit_line = next(line for line in lines if line.startswith("privacy unit:"))
    assert card["unit_of_privacy"] in unit_line and card["neighbouring"] in unit_line
    assert ("person" in card["neighbouring"]) == (unit == "user")
    # the mechanism: named, and its amplification claim as the mechanism line makes it
    assert card["mechanism"]["kind"] == mechanism
    assert ("banded matrix factorization" in text) == (mechanism == "banded-mf")
    assert ("BLT" in text) == (mechanism == "blt")
    assert card["mechanism"]["amplification_by_sampling"] == ("no amplification by sampling" not in text)
    # the sampling assumption: cyclic where the mechanism line says so, never plain Poisson then
    assumption = card["sampling_assumption"]
    assert ("cyclic" in assumption) == ("cyclic" in text) == (mechanism != "dp-sgd")
    assert ("no amplification" in assumption) == (mechanism == "blt")
    assert (("each person" in assumption) == (unit == "user")) and ("each example" in assumption) == (unit != "user")
    # the processes
    assert card["processes"] == world
    if world > 1:
        assert card["distribution"] is not None and f"distribution: {card['distribution']}" in lines
    else:
        assert card["distribution"] is None and not any(line.startswith("distribution:") for line in lines)
    assert card["epsilon"] == statement.epsilon and card["steps"] == statement.steps


def test_the_former_card_claims_are_gone_for_correlated_noise():
    """What the issue found in an export of the banded-MF and BLT recipes."""
    for mechanism in ("banded-mf", "blt"):
        card = privacy_card(_statement(mechanism, "example", 1, "data"), recipe_name="r", checkpoint="c",
                            checkpoint_step=1, steps_planned=1, stopped="completed", label_names=None,
                            search=None)
        assert not card["sampling_assumption"].startswith("Poisson subsampling")
        assert card["mechanism"]["kind"] == mechanism


def test_user_unit_text_is_the_one_the_plan_prints():
    unit = user_unit(400, 4)
    statement = _statement("dp-sgd", "user", 1, "data")
    assert statement.unit == unit["unit"] and statement.neighbouring == unit["neighbouring"]


@pytest.mark.slow
@pytest.mark.parametrize("mechanism", ["{kind: banded-mf, bands: 2}", "{kind: blt, buffers: 2}", None])
def test_a_runs_export_summary_and_account_print_one_statement(cli, tmp_path, mechanism):
    """End to end on a run: `dpclip account RUN`, summary.json and the export's privacy.json and
    model_card.json carry the same statement, and the card names the run's mechanism."""
    import json

    from dpclip.recipe import load_recipe
    from dpclip.train.workflow import train

    recipe = load_recipe(REPO / "recipes" / "quickstart.yaml", [
        f"output_dir={tmp_path / 'runs'}", "training.epochs=null", "training.steps=6", "model.hidden=[8]",
        "eval.every_steps=null", "privacy.epsilon=null", "privacy.noise_multiplier=2.0",
        *([f"privacy.mechanism={mechanism}"] if mechanism else [])])
    run_dir = train(recipe).run_dir
    assert cli("export", run_dir, tmp_path / "out").code == 0
    card = json.loads((tmp_path / "out" / "privacy.json").read_text())
    model_card = json.loads((tmp_path / "out" / "model_card.json").read_text())
    summary = json.loads((run_dir / "summary.json").read_text())
    account = cli("account", run_dir, "--json")
    printed = json.loads(account.out)
    assert card["statement"] == summary["statement"] == printed["lines"]
    for fact in ("epsilon", "delta", "steps", "neighbouring", "noise_multiplier"):
        assert card[fact] == printed["statement"][fact], fact
    kind = "dp-sgd" if mechanism is None else mechanism.split(":")[1].split(",")[0].strip()
    assert card["mechanism"]["kind"] == model_card["privacy"]["mechanism"]["kind"] == kind
    assert model_card["privacy"]["sampling_assumption"] == card["sampling_assumption"]
    assert ("cyclic" in card["sampling_assumption"]) == (mechanism is not None)


@pytest.mark.parametrize("unit", ["example", "user"])
@pytest.mark.parametrize("mechanism, sampling", [("dp-sgd", "poisson"), ("banded-mf", "cyclic-poisson"),
                                                 ("blt", "cyclic")])
def test_privacy_json_sampling_names_the_sampling_that_ran(mechanism, unit, sampling):
    """privacy.json's `sampling` says what ran, as its `mechanism` and `sampling_assumption` do: a
    correlated-noise run samples its groups in turn, never plain Poisson batches."""
    statement = _statement(mechanism, unit, 1, "data")
    card = privacy_card(statement, recipe_name="r", checkpoint="c", checkpoint_step=1, steps_planned=1,
                        stopped="completed", label_names=None, search=None)
    assert card["sampling"] == sampling
    assert statement.to_dict()["sampling"] == sampling   # `dpclip account --json`'s statement
    assert card["sampling_assumption"].startswith(
        {"poisson": "Poisson", "cyclic-poisson": "cyclic Poisson", "cyclic": "cyclic sampling"}[sampling])
